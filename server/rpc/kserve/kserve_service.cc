#include "server/rpc/kserve/kserve_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/build_info.h"
#include "server/base/log_safe.h"
#include "server/base/status_macros.h"
#include "server/rpc/compute_call.h"
#include "server/rpc/kserve/infer_request.h"
#include "server/rpc/kserve/infer_response.h"
#include "server/rpc/kserve/model_info.h"

namespace mha {
namespace {

namespace kv = inference;

// The protocol extensions served, as ServerMetadata lists them.
constexpr const char* kExtensions[] = {"model_configuration", "system_shared_memory", "statistics", "parameters"};

// The calls' rpc name in logs and metrics: static, since the call keeps the pointer until it finishes.
constexpr char kInferRpc[] = "ModelInfer";

// Statistics are kept for this many models at most beyond those served.
constexpr size_t kMaxStatsModels = 1024;

// A ModelInfer call's answer: its reply in KServe's encoding, and the call recorded in its model's statistics.
template <typename Response>
class KServeEncoder final : public ReplyEncoder<Response> {
 public:
  KServeEncoder(ModelStats* stats, std::string model, std::string id, std::vector<KServeOutput> outputs,
                absl::Time received)
      : stats_(stats), model_(std::move(model)), id_(std::move(id)), outputs_(std::move(outputs)),
        received_(received) {}

  absl::Status Encode(absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out) override {
    const v1::Timing& timing = reply->message.timing();
    if (status.ok()) {
      status = EncodeInferResponse(model_, id_, outputs_,
                                   {&reply->output, reply->message.has_output() ? &reply->message.output() : nullptr,
                                    &reply->attention_weights, &reply->message.lse(), &reply->message.head_stats(),
                                    reply->message.backend(), &timing},
                                   out);
    }
    ModelStats::Call call;
    call.ok = status.ok();
    call.finished = absl::Now();
    call.total = call.finished - received_;
    call.queue = absl::Microseconds(timing.queue_us());
    call.compute = absl::Microseconds(timing.compute_us());
    const v1::Tensor& output = reply->message.has_output() ? reply->message.output() : reply->output.header;
    call.batch_items = output.shape_size() > 0 ? output.shape(0) : 0;
    stats_->Record(model_, call);
    return status;
  }

 private:
  ModelStats* const stats_;
  const std::string model_, id_;
  const std::vector<KServeOutput> outputs_;
  const absl::Time received_;
};

}  // namespace

KServeService::KServeService(const ServiceParts& parts, std::function<bool()> live, std::function<bool()> ready)
    : parts_(parts), live_(std::move(live)), ready_(std::move(ready)) {}

absl::StatusOr<std::shared_ptr<const Layer>> KServeService::FindModel(const std::string& name,
                                                                     const std::string& version) const {
  RETURN_IF_ERROR(CheckModelVersion(name, version));
  if (name == kSdpaModel) return std::shared_ptr<const Layer>();
  absl::StatusOr<std::shared_ptr<const Layer>> layer = parts_.layers->Get(name);
  if (!layer.ok() && absl::IsNotFound(layer.status())) {
    return absl::NotFoundError(absl::StrCat("model '", name, "' is not served; RepositoryIndex lists the models"));
  }
  return layer;
}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ServerLiveRequest, kv::ServerLiveResponse>(
      Start("ServerLive", context, request, response), Role::kCompute,
      [this](const kv::ServerLiveRequest&, kv::ServerLiveResponse* response, std::string*) {
        response->set_live(live_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ServerReadyRequest, kv::ServerReadyResponse>(
      Start("ServerReady", context, request, response), Role::kCompute,
      [this](const kv::ServerReadyRequest&, kv::ServerReadyResponse* response, std::string*) {
        response->set_ready(ready_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ModelReadyRequest, kv::ModelReadyResponse>(
      Start("ModelReady", context, request, response), Role::kCompute,
      [this](const kv::ModelReadyRequest& request, kv::ModelReadyResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        response->set_ready(FindModel(request.name(), request.version()).ok() && ready_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ServerMetadataRequest, kv::ServerMetadataResponse>(
      Start("ServerMetadata", context, request, response), Role::kCompute,
      [](const kv::ServerMetadataRequest&, kv::ServerMetadataResponse* response, std::string*) {
        response->set_name(kPlatform);
        response->set_version(ProjectVersion());
        for (const char* extension : kExtensions) response->add_extensions(extension);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ModelMetadataRequest, kv::ModelMetadataResponse>(
      Start("ModelMetadata", context, request, response), Role::kCompute,
      [this](const kv::ModelMetadataRequest& request, kv::ModelMetadataResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        ASSIGN_OR_RETURN(std::shared_ptr<const Layer> layer, FindModel(request.name(), request.version()));
        *response = ModelMetadataOf(layer.get());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelConfig(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<kv::ModelConfigRequest, kv::ModelConfigResponse>(
      Start("ModelConfig", context, request, response), Role::kCompute,
      [this](const kv::ModelConfigRequest& request, kv::ModelConfigResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        ASSIGN_OR_RETURN(std::shared_ptr<const Layer> layer, FindModel(request.name(), request.version()));
        *response->mutable_config() = ModelConfigOf(layer.get());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelStatistics(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return AnswerNow<kv::ModelStatisticsRequest, kv::ModelStatisticsResponse>(
      Start("ModelStatistics", context, request, response), Role::kCompute,
      [this](const kv::ModelStatisticsRequest& request, kv::ModelStatisticsResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        if (!request.name().empty()) {
          RETURN_IF_ERROR(FindModel(request.name(), request.version()).status());
          *response->add_model_stats() = stats_.Get(request.name());
          return absl::OkStatus();
        }
        for (const auto& layer : parts_.layers->List()) *response->add_model_stats() = stats_.Get(layer->name);
        *response->add_model_stats() = stats_.Get(kSdpaModel);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::RepositoryIndex(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return AnswerNow<kv::RepositoryIndexRequest, kv::RepositoryIndexResponse>(
      Start("RepositoryIndex", context, request, response), Role::kCompute,
      [this](const kv::RepositoryIndexRequest&, kv::RepositoryIndexResponse* response, std::string*) {
        std::vector<std::string> names;
        for (const auto& layer : parts_.layers->List()) names.push_back(layer->name);
        names.push_back(kSdpaModel);
        for (const std::string& name : names) {
          kv::RepositoryIndexResponse::ModelIndex* model = response->add_models();
          model->set_name(name);
          model->set_version(kModelVersion);
          model->set_state("READY");
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::SystemSharedMemoryStatus(grpc::CallbackServerContext* context,
                                                                  const grpc::ByteBuffer* request,
                                                                  grpc::ByteBuffer* response) {
  return AnswerNow<kv::SystemSharedMemoryStatusRequest, kv::SystemSharedMemoryStatusResponse>(
      Start("SystemSharedMemoryStatus", context, request, response), Role::kCompute,
      [this](const kv::SystemSharedMemoryStatusRequest& request, kv::SystemSharedMemoryStatusResponse* response,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        const SharedMemoryRegistry& registry = *parts_.shared_memory;
        // Every region of a server without shared memory: none, as tritonclient's cleanup expects.
        if (request.name().empty() && registry.max_regions() == 0) return absl::OkStatus();
        ASSIGN_OR_RETURN(std::vector<std::shared_ptr<const SharedMemoryRegion>> regions,
                         registry.List(request.name()));
        for (const auto& region : regions) {
          kv::SystemSharedMemoryStatusResponse::RegionStatus& status = (*response->mutable_regions())[region->name()];
          status.set_name(region->name());
          status.set_key(region->key());
          status.set_byte_size(region->size());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::SystemSharedMemoryRegister(grpc::CallbackServerContext* context,
                                                                    const grpc::ByteBuffer* request,
                                                                    grpc::ByteBuffer* response) {
  return AnswerNow<kv::SystemSharedMemoryRegisterRequest, kv::SystemSharedMemoryRegisterResponse>(
      Start("SystemSharedMemoryRegister", context, request, response), Role::kCompute,
      [this](const kv::SystemSharedMemoryRegisterRequest& request, kv::SystemSharedMemoryRegisterResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()), " key=", LogSafe(request.key()),
                               " bytes=", request.byte_size());
        if (request.offset() != 0) {
          return absl::InvalidArgumentError(
              "offset: regions are mapped from the object's start; register with offset 0 and give each tensor's "
              "shared_memory_offset");
        }
        return parts_.shared_memory->Register(request.name(), request.key(), request.byte_size());
      });
}

grpc::ServerUnaryReactor* KServeService::SystemSharedMemoryUnregister(grpc::CallbackServerContext* context,
                                                                      const grpc::ByteBuffer* request,
                                                                      grpc::ByteBuffer* response) {
  return AnswerNow<kv::SystemSharedMemoryUnregisterRequest, kv::SystemSharedMemoryUnregisterResponse>(
      Start("SystemSharedMemoryUnregister", context, request, response), Role::kCompute,
      [this](const kv::SystemSharedMemoryUnregisterRequest& request, kv::SystemSharedMemoryUnregisterResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return parts_.shared_memory->Unregister(request.name());
      });
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  using MhaResponse = v1::MultiHeadAttentionResponse;
  Call call = Start(kInferRpc, context, bytes, out);
  const absl::Time received = call.received();
  kv::ModelInferRequest request;
  absl::Status status = call.Admit(Role::kCompute, &request);
  // The model is resolved once, here; validation takes the layer found (ValidationContext::layer).
  absl::StatusOr<std::shared_ptr<const Layer>> layer =
      status.ok() ? FindModel(request.model_name(), request.model_version())
                  : absl::StatusOr<std::shared_ptr<const Layer>>(status);
  if (!layer.ok()) {
    return SubmitCompute(std::move(call), layer.status(), std::make_unique<v1::MultiHeadAttentionRequest>(), {},
                         kMhaRoute, std::make_unique<NativeReplyEncoder<MhaResponse>>(), *parts_.validation,
                         parts_.scheduler);
  }
  // Statistics are kept for served models only, so that a client naming ever new models cannot grow them.
  const std::string model = request.model_name();
  stats_.Prune(kMaxStatsModels, [this](const std::string& name) {
    return name == kSdpaModel || parts_.layers->Get(name).ok();
  });
  absl::StatusOr<KServeCall> translated = TranslateInferRequest(&request);
  // A client gone while its request was translated (a pass over its bytes) ends here, not after validation.
  if (translated.ok()) {
    if (absl::Status wanted = call.StillWanted("was translated from KServe"); !wanted.ok()) translated = wanted;
  }
  if (!translated.ok()) {
    return SubmitCompute(std::move(call), translated.status(), std::make_unique<v1::MultiHeadAttentionRequest>(), {},
                         kMhaRoute, std::make_unique<KServeEncoder<MhaResponse>>(&stats_, model, request.id(),
                                                                                 std::vector<KServeOutput>(), received),
                         *parts_.validation, parts_.scheduler);
  }
  // What the call holds is the translated request (a BOOL mask grows to twice its bytes): the scheduler's
  // in-flight and queued limits count that.
  const google::protobuf::Message& held = translated->sdpa != nullptr
                                              ? static_cast<const google::protobuf::Message&>(*translated->sdpa)
                                              : *translated->mha;
  call.set_request_bytes(std::max(call.request_bytes(), static_cast<int64_t>(held.ByteSizeLong())));
  ValidationContext validation = *parts_.validation;
  validation.layer = *layer;
  if (translated->sdpa != nullptr) {
    using SdpaResponse = v1::ScaledDotProductAttentionResponse;
    return SubmitCompute(std::move(call), absl::OkStatus(), std::move(translated->sdpa), {}, kSdpaRoute,
                         std::make_unique<KServeEncoder<SdpaResponse>>(&stats_, model, request.id(),
                                                                       std::move(translated->outputs), received),
                         validation, parts_.scheduler);
  }
  return SubmitCompute(std::move(call), absl::OkStatus(), std::move(translated->mha), {}, kMhaRoute,
                       std::make_unique<KServeEncoder<MhaResponse>>(&stats_, model, request.id(),
                                                                    std::move(translated->outputs), received),
                       validation, parts_.scheduler);
}

}  // namespace mha
