#include "server/rpc/call.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/mha/v1/tensor_wire.h"
#include "server/base/grpc_status.h"
#include "server/base/log_safe.h"
#include "spdlog/spdlog.h"

namespace mha {
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

// Compute requests from this size on are read by ReadComputeRequest; below it protobuf's own parse is a few
// microseconds quicker and validation's scan of a small tensor costs nothing.
constexpr size_t kReadInPiecesBytes = 64 << 10;

// How close to its deadline a call that ended without a request message counts as having reached it (Admit).
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(100);

// gRPC's default unary reactor, but counted in progress until gRPC is done with the call (OnDone: its status sent,
// or the call cancelled), then deleted by itself.
class CountedReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit CountedReactor(std::shared_ptr<std::atomic<int64_t>> in_progress) : in_progress_(std::move(in_progress)) {
    in_progress_->fetch_add(1, std::memory_order_acq_rel);
  }
  void OnDone() override {
    in_progress_->fetch_sub(1, std::memory_order_acq_rel);
    delete this;
  }
  // Its reactions are trivial (OnDone above; OnCancel does nothing), so gRPC may run them inline on the thread that
  // completes the call, as it does the default reactor's, instead of a hop through its executor per call (which
  // also hands gRPC's own call objects between threads in ways TSan cannot see: every call that ended before its
  // request arrived was reported).
  bool InternalInlineable() override { return true; }

 private:
  const std::shared_ptr<std::atomic<int64_t>> in_progress_;
};

}  // namespace

CallEdge::CallEdge(const TokenAuth* auth, ServerMetrics* metrics, int log_max_calls_per_s,
                   absl::Duration default_deadline)
    : auth_(auth),
      metrics_(metrics),
      log_budget_(log_max_calls_per_s),
      default_deadline_(default_deadline),
      id_prefix_(absl::StrFormat("%08x", absl::Uniform<uint32_t>(absl::BitGen()))),
      instance_id_(InstanceId(id_prefix_)) {}

std::string CallEdge::RequestId(const grpc::CallbackServerContext& context) {
  const absl::string_view given = Metadata(context, "x-request-id");
  if (UsableRequestId(given)) return std::string(given);
  return absl::StrFormat("%s-%x", id_prefix_, next_request_id_++);
}

Call::Call(CallEdge* edge, const char* rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
           grpc::ByteBuffer* response)
    : edge_(edge),
      rpc_(rpc),
      context_(context),
      reactor_(new CountedReactor(edge->calls_in_progress_)),
      request_(request),
      response_(response),
      received_(absl::Now()),
      request_bytes_(static_cast<int64_t>(request->Length())) {
  const std::string id = edge->RequestId(*context);
  context->AddInitialMetadata("x-request-id", id);
  context->AddInitialMetadata("mha-instance-id", edge->instance_id_);
  SetIds(id);
  // gRPC reports "no deadline" as the clock's far end.
  const absl::Time deadline = absl::FromChrono(context->deadline());
  deadline_ = deadline - received_ > absl::Hours(24 * 365) ? received_ + edge->default_deadline_ : deadline;
}

Call::Call(CallEdge* edge, const char* rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
           grpc::ByteBuffer* response, CallEnd* end, absl::string_view request_id)
    : edge_(edge),
      rpc_(rpc),
      context_(context),
      reactor_(nullptr),
      end_(end),
      request_(request),
      response_(response),
      received_(absl::Now()),
      request_bytes_(static_cast<int64_t>(request->Length())) {
  SetIds(request_id);
  deadline_ = std::min(absl::FromChrono(context->deadline()), received_ + edge->default_deadline_);
}

void Call::SetIds(absl::string_view request_id) {
  const absl::string_view trace = TraceId(Metadata(*context_, "traceparent"));
  ids_ = trace.empty() ? absl::StrCat("rid=", request_id) : absl::StrCat("rid=", request_id, " trace=", trace);
}

Call::Call(Call&& other) noexcept
    : edge_(other.edge_),
      rpc_(other.rpc_),
      context_(other.context_),
      reactor_(other.reactor_),
      end_(other.end_),
      request_(other.request_),
      response_(other.response_),
      ids_(std::move(other.ids_)),
      caller_(std::move(other.caller_)),
      received_(other.received_),
      deadline_(other.deadline_),
      request_bytes_(other.request_bytes_),
      finished_(std::exchange(other.finished_, true)) {}

Call::~Call() {
  if (!finished_) Finish(absl::InternalError("the server dropped the call without an answer"));
}

absl::Status Call::Admit(Role role, google::protobuf::Message* request, std::vector<FiniteScan>* scans) {
  if (edge_->auth_ != nullptr) {
    absl::StatusOr<TokenAuth::Principal> principal =
        edge_->auth_->Authenticate(Metadata(*context_, "authorization"), role, rpc_);
    if (!principal.ok()) return principal.status();
    caller_ = {principal->id, principal->role == Role::kAdmin};
  }
  // gRPC starts a unary handler without a payload when the call ended before its request message arrived: every
  // gRPC client sends the message with the call, so that is a client that gave up while sending. Over TCP that
  // includes a deadline passing first: counted as DEADLINE_EXCEEDED, what its client saw, when the deadline is past
  // or within kDeadlineSlack (the grpc-timeout header is rounded up, so the client's own timer usually fires a
  // little first). Otherwise CANCELLED, not a request that does not parse. A 0-byte message (all fields at their
  // defaults) is a payload, validated like any other.
  if (!request_->Valid()) {
    if (absl::FromChrono(context_->deadline()) - absl::Now() <= kDeadlineSlack) {
      return absl::DeadlineExceededError("the call reached its deadline before its request message arrived");
    }
    return absl::CancelledError(
        "no request message arrived: the client cancelled the call before sending it (or closed it without one)");
  }
  const size_t size = request_->Length();
  // Either parse releases the wire bytes once read, as gRPC's own handlers do, so that a call computing holds its
  // request once, not twice (the buffer is gRPC's, alive until the call finishes, and read by nothing else).
  auto* wire = const_cast<grpc::ByteBuffer*>(request_);
  bool parsed;
  if (scans != nullptr && size >= kReadInPiecesBytes) {
    parsed = ReadComputeRequest(*wire, request, scans).ok();
    wire->Clear();
  } else {
    parsed = grpc::SerializationTraits<google::protobuf::Message>::Deserialize(wire, request).ok();
  }
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat("the request (", size, " bytes) does not parse as ",
                                                   request->GetDescriptor()->full_name(), "; is the client's proto ",
                                                   request->GetDescriptor()->file()->package(), "'s?"));
  }
  return absl::OkStatus();
}

absl::Status Call::StillWanted(absl::string_view doing) const {
  if (context_->IsCancelled()) {
    return absl::CancelledError(absl::StrCat("the client cancelled the call while it ", doing));
  }
  if (absl::Now() > deadline_) {
    return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed while it ", doing));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* Call::Finish(const absl::Status& status, const CallOutcome& outcome) {
  // A second Finish (a bug) must not finish gRPC's reactor twice, which would end the process.
  if (finished_) {
    spdlog::error("{} rpc={}: finished twice; the second status ({}) is dropped", ids_, rpc_, status.ToString());
    return reactor_;
  }
  finished_ = true;
  const absl::Duration latency = absl::Now() - received_;
  edge_->metrics_->RecordCall(rpc_, status.code(), outcome.backend, absl::ToDoubleSeconds(latency),
                              outcome.compute_seconds, outcome.flops);
  int64_t left_out = 0;
  if (edge_->log_budget_.Take(absl::Now(), &left_out)) {
    const std::string note =
        left_out > 0 ? absl::StrCat(" (", left_out, " call lines before this one left out: --log_max_calls_per_s)")
                     : "";
    const int64_t latency_us = absl::ToInt64Microseconds(latency);
    // abseil 20220623's string_view is not std's, so fmt needs std views.
    const std::string_view detail(outcome.detail.data(), outcome.detail.size());
    const std::string_view backend =
        outcome.backend.empty() ? "-" : std::string_view(outcome.backend.data(), outcome.backend.size());
    if (status.ok()) {
      spdlog::info("{} rpc={} {} backend={} status=OK latency_us={}{}", ids_, rpc_, detail, backend, latency_us,
                   note);
    } else {
      spdlog::warn("{} rpc={} {} backend={} status={} latency_us={} error=\"{}\"{}", ids_, rpc_, detail, backend,
                   absl::StatusCodeToString(status.code()), latency_us, LogSafe(status.message(), 1024), note);
    }
  }
  if (end_ != nullptr) {
    end_->End(ToGrpcStatus(status));
  } else {
    reactor_->Finish(ToGrpcStatus(status));
  }
  return reactor_;
}

absl::Status Serialize(const google::protobuf::Message& response, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(response, out, &own_buffer);
  if (status.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cannot serialize the response: ", status.error_message()));
}

absl::Status SerializeHolding(const google::protobuf::Message& response, InflightHold hold, grpc::ByteBuffer* out) {
  if (absl::Status status = Serialize(response, out); !status.ok() || hold.bytes() == 0) return status;
  std::vector<grpc::Slice> slices;
  if (!out->Dump(&slices).ok()) return absl::OkStatus();  // an empty message: nothing to hold
  const auto keep = std::make_shared<const InflightHold>(std::move(hold));
  for (grpc::Slice& slice : slices) slice = SliceKeeping(std::move(slice), keep);
  grpc::ByteBuffer held(slices.data(), slices.size());
  out->Swap(&held);
  return absl::OkStatus();
}

}  // namespace mha
