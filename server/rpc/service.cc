#include "server/rpc/service.h"

#include <unistd.h>

#include <memory>
#include <string>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/inference/grpc_service.pb.h"
#include "server/base/status_macros.h"
#include "server/calls/execute.h"
#include "server/calls/request_reader.h"
#include "server/scheduling/work_item.h"
#include "spdlog/spdlog.h"

#ifndef MHA_VERSION
#define MHA_VERSION "dev"
#endif

namespace mha {

void AttentionService::CallDone(const std::string& ids, const char* rpc, absl::string_view shapes,
                                absl::string_view backend, const absl::Status& status, absl::Time start, double compute_seconds,
                                double flops) {
  const absl::Duration latency = absl::Now() - start;
  metrics_->RecordCall(rpc, status.code(), backend, absl::ToDoubleSeconds(latency), compute_seconds, flops);
  int64_t left_out = 0;
  if (!log_budget_.Take(absl::Now(), &left_out)) return;
  const std::string note =
      left_out > 0 ? absl::StrCat(" (", left_out, " call lines before this one left out: --log_max_calls_per_s)") : "";
  const int64_t latency_us = absl::ToInt64Microseconds(latency);
  // abseil 20220623's string_view is not std's, so fmt needs std views.
  const std::string_view shapes_sv(shapes.data(), shapes.size());
  const std::string_view backend_sv = backend.empty() ? "-" : std::string_view(backend.data(), backend.size());
  if (status.ok()) {
    spdlog::info("{} rpc={} {} backend={} status=OK latency_us={}{}", ids, rpc, shapes_sv, backend_sv,
                 latency_us, note);
  } else {
    spdlog::warn("{} rpc={} {} backend={} status={} latency_us={} error=\"{}\"{}", ids, rpc, shapes_sv,
                 backend_sv, absl::StatusCodeToString(status.code()), latency_us,
                 LogSafe(status.message(), 1024), note);
  }
}

namespace {

// "<host name>/<prefix>", the host name kept to [A-Za-z0-9._-] and 64 characters (a metadata value and a log
// field); "unknown" where the host has none.
std::string InstanceId(absl::string_view prefix) {
  char host[256] = {};
  std::string name;
  if (gethostname(host, sizeof(host) - 1) == 0) {
    for (const char* c = host; *c != '\0' && name.size() < 64; ++c) {
      if (absl::ascii_isalnum(static_cast<unsigned char>(*c)) || *c == '.' || *c == '_' || *c == '-') name += *c;
    }
  }
  return absl::StrCat(name.empty() ? "unknown" : name, "/", prefix);
}

}  // namespace

AttentionService::AttentionService(const ServerOptions& options, LayerStore* layers, BackendRegistry* backends,
                                   Scheduler* scheduler, ServerMetrics* metrics, const TokenAuth* auth,
                                   SessionStore* sessions)
    : options_(options),
      layers_(layers),
      backends_(backends),
      scheduler_(scheduler),
      metrics_(metrics),
      auth_(auth),
      sessions_(sessions),
      shared_memory_(options.max_shared_memory_regions, static_cast<int64_t>(options.max_shared_memory_mb) << 20),
      id_prefix_(absl::StrFormat("%08x", absl::Uniform<uint32_t>(absl::BitGen()))),
      instance_id_(InstanceId(id_prefix_)),
      log_budget_(options.log_max_calls_per_s) {
  validation_.layers = layers_;
  validation_.backends = backends_;
  validation_.max_message_bytes = static_cast<int64_t>(options.max_message_mb) << 20;
  validation_.max_scratch_bytes = static_cast<int64_t>(options.max_scratch_mb) << 20;
  validation_.max_request_flops = options.max_request_gflop * 1e9;
  validation_.max_reference_flops = options.max_reference_gflop * 1e9;
  validation_.shared_memory = &shared_memory_;
  default_deadline_ = absl::Seconds(options.default_deadline_s);
}

namespace {

// Metadata `key` of the call, empty when absent.
absl::string_view Metadata(const grpc::CallbackServerContext& context, const char* key) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(key);
  if (it == metadata.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

bool UsableRequestId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' || c == '/' ||
          c == '-')) {
      return false;
    }
  }
  return true;
}

// The trace id of a W3C traceparent ("00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"), empty if malformed.
absl::string_view TraceId(absl::string_view traceparent) {
  if (traceparent.size() != 55 || traceparent[2] != '-' || traceparent[35] != '-' || traceparent[52] != '-') return {};
  for (size_t i = 0; i < traceparent.size(); ++i) {
    if (i != 2 && i != 35 && i != 52 && !absl::ascii_isxdigit(static_cast<unsigned char>(traceparent[i]))) return {};
  }
  return traceparent.substr(3, 32);
}

}  // namespace

std::string AttentionService::Identify(grpc::CallbackServerContext* context) {
  const absl::string_view given = Metadata(*context, "x-request-id");
  std::string id = UsableRequestId(given) ? std::string(given)
                                          : absl::StrFormat("%s-%x", id_prefix_, next_request_id_++);
  context->AddInitialMetadata("x-request-id", id);
  context->AddInitialMetadata("mha-instance-id", instance_id_);
  const absl::string_view trace = TraceId(Metadata(*context, "traceparent"));
  return trace.empty() ? absl::StrCat("rid=", id) : absl::StrCat("rid=", id, " trace=", trace);
}

// Compute requests from this size on are read by ReadComputeRequest; below it protobuf's own parse is a few
// microseconds quicker (measured on the tiny (1,16,64) call) and validation's scan of a small tensor costs nothing.
constexpr size_t kReadInPiecesBytes = 64 << 10;

// How close to its deadline a call that ended without a request message counts as having reached it (Admit).
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(100);

template <typename Request>
absl::Status AttentionService::Admit(const char* rpc, Role role, const grpc::CallbackServerContext& context,
                                     const grpc::ByteBuffer* bytes, Request* request,
                                     std::vector<FiniteScan>* scans, SessionCaller* caller) const {
  if (auth_ != nullptr) {
    absl::StatusOr<TokenAuth::Principal> principal = auth_->Authenticate(Metadata(context, "authorization"), role, rpc);
    if (!principal.ok()) return principal.status();
    if (caller != nullptr) *caller = {principal->id, principal->role == Role::kAdmin};
  }
  // gRPC starts a unary handler without a payload when the call ended before its request message arrived: every
  // gRPC client sends the message with the call, so that is a client that gave up while sending. Over TCP that
  // includes a deadline passing first (the in-process transport ends such a call without starting the handler):
  // counted as DEADLINE_EXCEEDED, what its client saw, when the deadline is past or within kDeadlineSlack, since the
  // client's own timer usually cancels the stream a little before the server's copy of the deadline expires (the
  // grpc-timeout header is rounded up, to 10 ms for timeouts of 1-10 s and 100 ms for 10-100 s). Otherwise
  // CANCELLED, not a request that does not parse. A 0-byte message (all fields at their defaults) is a payload,
  // validated like any other.
  if (!bytes->Valid()) {
    if (absl::FromChrono(context.deadline()) - absl::Now() <= kDeadlineSlack) {
      return absl::DeadlineExceededError("the call reached its deadline before its request message arrived");
    }
    return absl::CancelledError(
        "no request message arrived: the client cancelled the call before sending it (or closed it without one)");
  }
  const size_t size = bytes->Length();
  // Either parse releases the wire bytes once read, as gRPC's own handlers do, so that a call computing holds its
  // request once, not twice (the buffer is gRPC's, alive until the call finishes, and read by nothing else).
  auto* wire = const_cast<grpc::ByteBuffer*>(bytes);
  bool parsed;
  if (scans != nullptr && size >= kReadInPiecesBytes) {
    // A large compute request: its activations' bytes copied once and scanned for inf and NaN on the way.
    parsed = ReadComputeRequest(*wire, request, scans).ok();
    wire->Clear();
  } else {
    parsed = grpc::SerializationTraits<Request>::Deserialize(wire, request).ok();
  }
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat("the request (", size, " bytes) does not parse as ",
                                                   Request::descriptor()->full_name(),
                                                   "; is the client's proto ",
                                                   Request::descriptor()->file()->package(), "'s?"));
  }
  return absl::OkStatus();
}

// One compute call as the scheduler sees it. Owns the request, the validated plan (which may point into the
// request) and the response; borrows the context and the output buffer, which gRPC keeps until the reactor
// finishes.
template <typename Request, typename Response, typename Plan>
class ComputeCall final : public WorkItem {
 public:
  using Execute = absl::Status (*)(const Plan&, const StopSignal*, Reply<Response>*);
  using ExecuteBatch = absl::Status (*)(absl::Span<const Plan* const>, const StopSignal*,
                                        absl::Span<Reply<Response>* const>);

  ComputeCall(AttentionService* service, std::string id, const char* rpc, grpc::CallbackServerContext* context,
              grpc::ServerUnaryReactor* reactor, std::unique_ptr<Request> request, grpc::ByteBuffer* out,
              Plan plan, Execute execute, ExecuteBatch execute_batch, ComputeAnswer<Response> answer,
              int64_t request_bytes, absl::Time received, absl::Time deadline)
      : WorkItem(request_bytes, received, deadline),
        service_(service),
        id_(std::move(id)),
        rpc_(rpc),
        context_(context),
        reactor_(reactor),
        request_(std::move(request)),
        out_(out),
        plan_(std::move(plan)),
        execute_(execute),
        execute_batch_(execute_batch),
        answer_(std::move(answer)) {}

  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return context_->IsCancelled(); }

  absl::Status Run(absl::Duration waited) override {
    const absl::Time started = absl::Now();
    absl::Status status = execute_(plan_, this, &reply_);
    const absl::Time computed = absl::Now();
    // A call whose client gave up or whose deadline passed while it computed ended so, whatever the backend said.
    if (status.ok()) status = Check();
    Timing* timing = reply_.message.mutable_timing();
    timing->set_queue_us(absl::ToInt64Microseconds(waited));
    timing->set_compute_us(absl::ToInt64Microseconds(computed - started));
    timing->set_handler_us(absl::ToInt64Microseconds(computed - received()));
    Finish(status, absl::ToDoubleSeconds(computed - started));
    return status;
  }

  // The batch key names the rpc, so `others` are calls of this same type.
  absl::Status RunBatch(absl::Span<WorkItem* const> others, absl::Span<const absl::Duration> waited) override {
    std::vector<WorkItem*> items = {this};
    items.insert(items.end(), others.begin(), others.end());
    std::vector<ComputeCall*> calls;
    std::vector<const Plan*> plans;
    std::vector<Reply<Response>*> replies;
    for (WorkItem* item : items) {
      calls.push_back(static_cast<ComputeCall*>(item));
      plans.push_back(&calls.back()->plan_);
      replies.push_back(&calls.back()->reply_);
    }
    const BatchStop stop(items);
    const absl::Time started = absl::Now();
    const absl::Status status = execute_batch_(plans, &stop, replies);
    const absl::Time computed = absl::Now();
    for (size_t i = 0; i < calls.size(); ++i) {
      ComputeCall& call = *calls[i];
      Timing* timing = call.reply_.message.mutable_timing();
      timing->set_queue_us(absl::ToInt64Microseconds(waited[i]));
      timing->set_compute_us(absl::ToInt64Microseconds(computed - started));
      timing->set_handler_us(absl::ToInt64Microseconds(computed - call.received()));
      call.Finish(status.ok() ? call.Check() : status, absl::ToDoubleSeconds(computed - started));
    }
    return status;
  }

  void Reject(const absl::Status& status) override { Finish(status, 0); }

 private:
  using Timing = v1::Timing;

  void Finish(absl::Status status, double compute_seconds) {
    if (status.ok()) {
      // The response's tensors keep their share of the in-flight memory until gRPC lets go of them, once sent (or
      // once the call ends unsent): a client that never reads cannot make the server hold more than the limit.
      auto hold = std::make_shared<const InflightHold>(TakeResponseHold());
      for (TensorBytes* tensor : {&reply_.output, &reply_.attention_weights}) {
        if (hold->bytes() > 0 && tensor->field != 0 && tensor->data.size() > 0) {
          tensor->data = SliceKeeping(std::move(tensor->data), hold);
        }
      }
    }
    status = answer_(std::move(status), &reply_, out_);
    service_->CallDone(id_, rpc_, plan_.shapes, plan_.backend->name(), status, received(), compute_seconds,
                       status.ok() ? plan_.flops : 0);
    reactor_->Finish(ToGrpcStatus(status));
  }

  AttentionService* const service_;
  const std::string id_;
  const char* const rpc_;
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  const std::unique_ptr<Request> request_;
  grpc::ByteBuffer* const out_;
  Reply<Response> reply_;
  const Plan plan_;
  const Execute execute_;
  const ExecuteBatch execute_batch_;  // null when calls of this rpc are never batched
  const ComputeAnswer<Response> answer_;
};

template <typename Request, typename Response, typename Plan>
grpc::ServerUnaryReactor* AttentionService::Compute(
    const char* rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out,
    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
    absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*),
    absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                  absl::Span<Reply<Response>* const>)) {
  CallStart start = Begin(context, bytes);
  auto request = std::make_unique<Request>();
  std::vector<FiniteScan> scans;
  const absl::Status admitted = Admit(rpc, Role::kCompute, *context, bytes, request.get(), &scans);
  ComputeAnswer<Response> answer = [](absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out) {
    return status.ok() ? reply->Encode(out) : status;
  };
  return Submit(rpc, context, std::move(start), admitted, std::move(request), std::move(scans), out, validate,
                execute, execute_batch, std::move(answer));
}

AttentionService::CallStart AttentionService::Begin(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* bytes) {
  CallStart start;
  start.received = absl::Now();
  start.id = Identify(context);
  start.request_bytes = static_cast<int64_t>(bytes->Length());
  return start;
}

template <typename Request, typename Response, typename Plan>
grpc::ServerUnaryReactor* AttentionService::Submit(
    const char* rpc, grpc::CallbackServerContext* context, CallStart start, const absl::Status& admitted,
    std::unique_ptr<Request> request, std::vector<FiniteScan> scans, grpc::ByteBuffer* out,
    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
    absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*),
    absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                  absl::Span<Reply<Response>* const>),
    ComputeAnswer<Response> answer) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  ValidationContext validation = validation_;
  validation.finite_scans = scans;
  absl::StatusOr<Plan> plan = admitted.ok() ? validate(*request, validation) : absl::StatusOr<Plan>(admitted);
  if (!plan.ok()) {
    Reply<Response> none;
    const absl::Status status = answer(plan.status(), &none, out);
    CallDone(start.id, rpc, "-", "", status, start.received);
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }
  scheduler_->Submit(std::make_unique<ComputeCall<Request, Response, Plan>>(
      this, std::move(start.id), rpc, context, reactor, std::move(request), out, *std::move(plan), execute,
      execute_batch, std::move(answer), start.request_bytes, start.received, DeadlineOf(*context, start.received)));
  return reactor;
}

absl::Time AttentionService::DeadlineOf(const grpc::CallbackServerContext& context, absl::Time received) const {
  // gRPC reports "none" as the clock's far end.
  const absl::Time deadline = absl::FromChrono(context.deadline());
  return deadline - received > absl::Hours(24 * 365) ? received + default_deadline_ : deadline;
}

// The requests other files admit through this file's template: the session RPCs' (session_service.cc) and the KServe
// front door's (server/kserve).
#define MHA_INSTANTIATE_ADMIT(Request)                                                                          \
  template absl::Status AttentionService::Admit(const char*, Role, const grpc::CallbackServerContext&,         \
                                                const grpc::ByteBuffer*, Request*, std::vector<FiniteScan>*,   \
                                                SessionCaller*) const;
MHA_INSTANTIATE_ADMIT(v1::CreateSessionRequest)
MHA_INSTANTIATE_ADMIT(v1::ExtendRequest)
MHA_INSTANTIATE_ADMIT(v1::ForkSessionRequest)
MHA_INSTANTIATE_ADMIT(v1::TruncateSessionRequest)
MHA_INSTANTIATE_ADMIT(v1::CloseSessionRequest)
MHA_INSTANTIATE_ADMIT(v1::ListSessionsRequest)
MHA_INSTANTIATE_ADMIT(inference::ServerLiveRequest)
MHA_INSTANTIATE_ADMIT(inference::ServerReadyRequest)
MHA_INSTANTIATE_ADMIT(inference::ModelReadyRequest)
MHA_INSTANTIATE_ADMIT(inference::ServerMetadataRequest)
MHA_INSTANTIATE_ADMIT(inference::ModelMetadataRequest)
MHA_INSTANTIATE_ADMIT(inference::ModelConfigRequest)
MHA_INSTANTIATE_ADMIT(inference::ModelInferRequest)
MHA_INSTANTIATE_ADMIT(inference::ModelStatisticsRequest)
MHA_INSTANTIATE_ADMIT(inference::RepositoryIndexRequest)
MHA_INSTANTIATE_ADMIT(inference::SystemSharedMemoryStatusRequest)
MHA_INSTANTIATE_ADMIT(inference::SystemSharedMemoryRegisterRequest)
MHA_INSTANTIATE_ADMIT(inference::SystemSharedMemoryUnregisterRequest)
#undef MHA_INSTANTIATE_ADMIT

// The compute calls the KServe front door submits.
template grpc::ServerUnaryReactor* AttentionService::Submit(
    const char*, grpc::CallbackServerContext*, CallStart, const absl::Status&,
    std::unique_ptr<v1::MultiHeadAttentionRequest>, std::vector<FiniteScan>, grpc::ByteBuffer*,
    absl::StatusOr<MhaPlan> (*)(const v1::MultiHeadAttentionRequest&, const ValidationContext&),
    absl::Status (*)(const MhaPlan&, const StopSignal*, MhaReply*),
    absl::Status (*)(absl::Span<const MhaPlan* const>, const StopSignal*, absl::Span<MhaReply* const>),
    ComputeAnswer<v1::MultiHeadAttentionResponse>);
template grpc::ServerUnaryReactor* AttentionService::Submit(
    const char*, grpc::CallbackServerContext*, CallStart, const absl::Status&,
    std::unique_ptr<v1::ScaledDotProductAttentionRequest>, std::vector<FiniteScan>, grpc::ByteBuffer*,
    absl::StatusOr<SdpaPlan> (*)(const v1::ScaledDotProductAttentionRequest&, const ValidationContext&),
    absl::Status (*)(const SdpaPlan&, const StopSignal*, SdpaReply*),
    absl::Status (*)(absl::Span<const SdpaPlan* const>, const StopSignal*, absl::Span<SdpaReply* const>),
    ComputeAnswer<v1::ScaledDotProductAttentionResponse>);

grpc::ServerUnaryReactor* AttentionService::MultiHeadAttention(grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request,
                                                               grpc::ByteBuffer* response) {
  return Compute("MultiHeadAttention", context, request, response, &ValidateMultiHeadAttention,
                 &ExecuteMultiHeadAttention, &ExecuteMultiHeadAttentionBatch);
}

grpc::ServerUnaryReactor* AttentionService::ScaledDotProductAttention(grpc::CallbackServerContext* context,
                                                                      const grpc::ByteBuffer* request,
                                                                      grpc::ByteBuffer* response) {
  return Compute<v1::ScaledDotProductAttentionRequest, v1::ScaledDotProductAttentionResponse, SdpaPlan>(
      "ScaledDotProductAttention", context, request, response, &ValidateScaledDotProductAttention,
      &ExecuteScaledDotProductAttention, nullptr);
}

grpc::ServerUnaryReactor* AttentionService::LoadLayer(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return Answer<v1::LoadLayerRequest, v1::LoadLayerResponse>(
      "LoadLayer", Role::kAdmin, context, request, response,
      [this](const v1::LoadLayerRequest& request, v1::LoadLayerResponse* response, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        absl::StatusOr<std::shared_ptr<const Layer>> layer =
            layers_->Load(request.name(), "rpc", request.weights(), request.heads(), "weights");
        if (!layer.ok()) return layer.status();
        *response->mutable_layer() = (*layer)->Info();
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::UnloadLayer(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return Answer<v1::UnloadLayerRequest, v1::UnloadLayerResponse>(
      "UnloadLayer", Role::kAdmin, context, request, response,
      [this](const v1::UnloadLayerRequest& request, v1::UnloadLayerResponse*, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return layers_->Remove(request.name());
      });
}

grpc::ServerUnaryReactor* AttentionService::ListLayers(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return Answer<v1::ListLayersRequest, v1::ListLayersResponse>(
      "ListLayers", Role::kCompute, context, request, response,
      [this](const v1::ListLayersRequest&, v1::ListLayersResponse* response, std::string*) {
        for (const auto& layer : layers_->List()) *response->add_layers() = layer->Info();
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return Answer<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
      "GetServerInfo", Role::kCompute, context, request, response,
      [this](const v1::GetServerInfoRequest&, v1::GetServerInfoResponse* response, std::string*) {
        response->set_version(MHA_VERSION);
        response->set_instance_id(instance_id_);
        for (const BackendEntry& entry : backends_->entries()) {
          v1::BackendInfo* info = response->add_backends();
          info->set_name(entry.name);
          info->set_device(entry.device);
          info->set_available(entry.available());
          info->set_detail(entry.detail);
          if (entry.available()) info->set_gflops(scheduler_->Rate(entry.backend.get()) / 1e9);
        }
        response->set_default_backend(backends_->NameFor(v1::BACKEND_AUTO));
        v1::ServerLimits* limits = response->mutable_limits();
        limits->set_max_message_bytes(validation_.max_message_bytes);
        limits->set_max_queue_size(options_.max_queue_size);
        limits->set_compute_threads(options_.threads);
        limits->set_max_layer_bytes(layers_->max_total_bytes());
        limits->set_max_layers(layers_->max_layers());
        limits->set_max_queued_bytes(static_cast<int64_t>(options_.max_queued_mb) << 20);
        limits->set_max_scratch_bytes(validation_.max_scratch_bytes);
        limits->set_max_request_gflop(options_.max_request_gflop);
        limits->set_max_shared_memory_regions(shared_memory_.max_regions());
        limits->set_max_shared_memory_bytes(shared_memory_.max_regions() > 0 ? shared_memory_.max_bytes() : 0);
        const SessionStoreOptions& sessions = sessions_->options();
        limits->set_kv_cache_bytes(sessions_->capacity_bytes());
        limits->set_kv_block_tokens(static_cast<int32_t>(sessions.block_tokens));
        limits->set_max_sessions(sessions.max_sessions);
        limits->set_max_session_tokens(sessions.max_tokens);
        limits->set_session_idle_s(static_cast<int32_t>(absl::ToInt64Seconds(sessions.idle_timeout)));
        limits->set_max_session_idle_s(static_cast<int32_t>(absl::ToInt64Seconds(sessions.max_idle_timeout)));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(grpc::CallbackServerContext* context,
                                                                 const grpc::ByteBuffer* request,
                                                                 grpc::ByteBuffer* response) {
  return Answer<v1::RegisterSharedMemoryRequest, v1::RegisterSharedMemoryResponse>(
      "RegisterSharedMemory", Role::kCompute, context, request, response,
      [this](const v1::RegisterSharedMemoryRequest& request, v1::RegisterSharedMemoryResponse*, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()), " key=", LogSafe(request.key()),
                               " bytes=", request.byte_size());
        return shared_memory_.Register(request.name(), request.key(), request.byte_size());
      });
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(grpc::CallbackServerContext* context,
                                                                   const grpc::ByteBuffer* request,
                                                                   grpc::ByteBuffer* response) {
  return Answer<v1::UnregisterSharedMemoryRequest, v1::UnregisterSharedMemoryResponse>(
      "UnregisterSharedMemory", Role::kCompute, context, request, response,
      [this](const v1::UnregisterSharedMemoryRequest& request, v1::UnregisterSharedMemoryResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return shared_memory_.Unregister(request.name());
      });
}

grpc::ServerUnaryReactor* AttentionService::GetSharedMemoryStatus(grpc::CallbackServerContext* context,
                                                                  const grpc::ByteBuffer* request,
                                                                  grpc::ByteBuffer* response) {
  return Answer<v1::GetSharedMemoryStatusRequest, v1::GetSharedMemoryStatusResponse>(
      "GetSharedMemoryStatus", Role::kCompute, context, request, response,
      [this](const v1::GetSharedMemoryStatusRequest& request, v1::GetSharedMemoryStatusResponse* response,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        ASSIGN_OR_RETURN(std::vector<std::shared_ptr<const SharedMemoryRegion>> regions,
                         shared_memory_.List(request.name()));
        for (const auto& region : regions) {
          v1::SharedMemoryRegionStatus* status = response->add_regions();
          status->set_name(region->name());
          status->set_key(region->key());
          status->set_byte_size(region->size());
          status->set_intact(region->Intact().ok());
        }
        return absl::OkStatus();
      });
}

}  // namespace mha
