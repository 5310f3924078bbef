#include "server/rpc/kserve/kserve_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/status_macros.h"
#include "server/rpc/kserve/infer_request.h"
#include "server/rpc/kserve/infer_response.h"
#include "server/rpc/kserve/model_info.h"

#ifndef MHA_VERSION
#define MHA_VERSION "dev"
#endif

namespace mha {
namespace {

namespace kv = inference;

// The protocol extensions served, as ServerMetadata lists them.
constexpr const char* kExtensions[] = {"model_configuration", "system_shared_memory", "statistics", "parameters"};

// The calls' rpc name in logs and metrics: static, since the call keeps the pointer until it finishes.
constexpr char kInferRpc[] = "ModelInfer";

// Statistics are kept for this many models at most beyond those served.
constexpr size_t kMaxStatsModels = 1024;

}  // namespace

KServeService::KServeService(AttentionService* attention, std::function<bool()> live, std::function<bool()> ready)
    : attention_(attention), live_(std::move(live)), ready_(std::move(ready)) {}

absl::StatusOr<std::shared_ptr<const Layer>> KServeService::FindModel(const std::string& name,
                                                                     const std::string& version) const {
  RETURN_IF_ERROR(CheckModelVersion(name, version));
  if (name == kSdpaModel) return std::shared_ptr<const Layer>();
  absl::StatusOr<std::shared_ptr<const Layer>> layer = attention_->layers_->Get(name);
  if (!layer.ok() && absl::IsNotFound(layer.status())) {
    return absl::NotFoundError(absl::StrCat("model '", name, "' is not served; RepositoryIndex lists the models"));
  }
  return layer;
}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ServerLiveRequest, kv::ServerLiveResponse>(
      "ServerLive", Role::kCompute, context, request, response,
      [this](const kv::ServerLiveRequest&, kv::ServerLiveResponse* response, std::string*) {
        response->set_live(live_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ServerReadyRequest, kv::ServerReadyResponse>(
      "ServerReady", Role::kCompute, context, request, response,
      [this](const kv::ServerReadyRequest&, kv::ServerReadyResponse* response, std::string*) {
        response->set_ready(ready_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ModelReadyRequest, kv::ModelReadyResponse>(
      "ModelReady", Role::kCompute, context, request, response,
      [this](const kv::ModelReadyRequest& request, kv::ModelReadyResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        response->set_ready(FindModel(request.name(), request.version()).ok() && ready_());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ServerMetadataRequest, kv::ServerMetadataResponse>(
      "ServerMetadata", Role::kCompute, context, request, response,
      [](const kv::ServerMetadataRequest&, kv::ServerMetadataResponse* response, std::string*) {
        response->set_name(kPlatform);
        response->set_version(MHA_VERSION);
        for (const char* extension : kExtensions) response->add_extensions(extension);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ModelMetadataRequest, kv::ModelMetadataResponse>(
      "ModelMetadata", Role::kCompute, context, request, response,
      [this](const kv::ModelMetadataRequest& request, kv::ModelMetadataResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        ASSIGN_OR_RETURN(std::shared_ptr<const Layer> layer, FindModel(request.name(), request.version()));
        *response = ModelMetadataOf(layer.get());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::ModelConfig(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return attention_->Answer<kv::ModelConfigRequest, kv::ModelConfigResponse>(
      "ModelConfig", Role::kCompute, context, request, response,
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
  return attention_->Answer<kv::ModelStatisticsRequest, kv::ModelStatisticsResponse>(
      "ModelStatistics", Role::kCompute, context, request, response,
      [this](const kv::ModelStatisticsRequest& request, kv::ModelStatisticsResponse* response, std::string* detail) {
        *detail = absl::StrCat("model=", LogSafe(request.name()));
        if (!request.name().empty()) {
          RETURN_IF_ERROR(FindModel(request.name(), request.version()).status());
          *response->add_model_stats() = stats_.Get(request.name());
          return absl::OkStatus();
        }
        for (const auto& layer : attention_->layers_->List()) *response->add_model_stats() = stats_.Get(layer->name);
        *response->add_model_stats() = stats_.Get(kSdpaModel);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KServeService::RepositoryIndex(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return attention_->Answer<kv::RepositoryIndexRequest, kv::RepositoryIndexResponse>(
      "RepositoryIndex", Role::kCompute, context, request, response,
      [this](const kv::RepositoryIndexRequest&, kv::RepositoryIndexResponse* response, std::string*) {
        std::vector<std::string> names;
        for (const auto& layer : attention_->layers_->List()) names.push_back(layer->name);
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
  return attention_->Answer<kv::SystemSharedMemoryStatusRequest, kv::SystemSharedMemoryStatusResponse>(
      "SystemSharedMemoryStatus", Role::kCompute, context, request, response,
      [this](const kv::SystemSharedMemoryStatusRequest& request, kv::SystemSharedMemoryStatusResponse* response,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        const SharedMemoryRegistry& registry = attention_->shared_memory_;
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
  return attention_->Answer<kv::SystemSharedMemoryRegisterRequest, kv::SystemSharedMemoryRegisterResponse>(
      "SystemSharedMemoryRegister", Role::kCompute, context, request, response,
      [this](const kv::SystemSharedMemoryRegisterRequest& request, kv::SystemSharedMemoryRegisterResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()), " key=", LogSafe(request.key()),
                               " bytes=", request.byte_size());
        if (request.offset() != 0) {
          return absl::InvalidArgumentError(
              "offset: regions are mapped from the object's start; register with offset 0 and give each tensor's "
              "shared_memory_offset");
        }
        return attention_->shared_memory_.Register(request.name(), request.key(), request.byte_size());
      });
}

grpc::ServerUnaryReactor* KServeService::SystemSharedMemoryUnregister(grpc::CallbackServerContext* context,
                                                                      const grpc::ByteBuffer* request,
                                                                      grpc::ByteBuffer* response) {
  return attention_->Answer<kv::SystemSharedMemoryUnregisterRequest, kv::SystemSharedMemoryUnregisterResponse>(
      "SystemSharedMemoryUnregister", Role::kCompute, context, request, response,
      [this](const kv::SystemSharedMemoryUnregisterRequest& request, kv::SystemSharedMemoryUnregisterResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return attention_->shared_memory_.Unregister(request.name());
      });
}

template <typename Response>
ComputeAnswer<Response> KServeService::Answer(std::string model, std::string id, std::vector<KServeOutput> outputs,
                                              absl::Time received) {
  return [this, model = std::move(model), id = std::move(id), outputs = std::move(outputs), received](
             absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out) {
    const v1::Timing& timing = reply->message.timing();
    if (status.ok()) {
      status = EncodeInferResponse(model, id, outputs,
                                   {&reply->output, reply->message.has_output() ? &reply->message.output() : nullptr,
                                    &reply->attention_weights, &reply->message.lse(), &reply->message.head_stats(),
                                    reply->message.backend(), &timing},
                                   out);
    }
    ModelStats::Call call;
    call.ok = status.ok();
    call.finished = absl::Now();
    call.total = call.finished - received;
    call.queue = absl::Microseconds(timing.queue_us());
    call.compute = absl::Microseconds(timing.compute_us());
    const v1::Tensor& output = reply->message.has_output() ? reply->message.output() : reply->output.header;
    call.batch_items = output.shape_size() > 0 ? output.shape(0) : 0;
    stats_.Record(model, call);
    return status;
  };
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  AttentionService::CallStart start = attention_->Begin(context, bytes);
  const absl::Time received = start.received;
  kv::ModelInferRequest request;
  absl::Status status = attention_->Admit(kInferRpc, Role::kCompute, *context, bytes, &request, nullptr);
  if (status.ok()) status = FindModel(request.model_name(), request.model_version()).status();
  absl::StatusOr<KServeCall> call =
      status.ok() ? TranslateInferRequest(&request) : absl::StatusOr<KServeCall>(status);
  // Statistics are kept for served models only, so that a client naming ever new models cannot grow them.
  std::string model = status.ok() ? request.model_name() : "";
  if (!model.empty()) {
    stats_.Prune(kMaxStatsModels, [this](const std::string& name) {
      return name == kSdpaModel || attention_->layers_->Get(name).ok();
    });
  }
  std::vector<KServeOutput> outputs = call.ok() ? call->outputs : std::vector<KServeOutput>{};
  // What the call holds is the translated request (a BOOL mask grows to twice its bytes): the scheduler's
  // in-flight and queued limits count that.
  if (call.ok()) {
    const int64_t held = static_cast<int64_t>(call->sdpa != nullptr ? call->sdpa->ByteSizeLong()
                                                                     : call->mha->ByteSizeLong());
    start.request_bytes = std::max(start.request_bytes, held);
  }
  if (call.ok() && call->sdpa != nullptr) {
    using SdpaResponse = v1::ScaledDotProductAttentionResponse;
    return attention_->Submit<v1::ScaledDotProductAttentionRequest, SdpaResponse, SdpaPlan>(
        kInferRpc, context, std::move(start), absl::OkStatus(), std::move(call->sdpa), {}, out,
        &ValidateScaledDotProductAttention, &ExecuteScaledDotProductAttention, nullptr,
        Answer<SdpaResponse>(std::move(model), request.id(), std::move(outputs), received));
  }
  auto mha = call.ok() ? std::move(call->mha) : std::make_unique<v1::MultiHeadAttentionRequest>();
  ComputeAnswer<v1::MultiHeadAttentionResponse> answer =
      Answer<v1::MultiHeadAttentionResponse>(model, request.id(), std::move(outputs), received);
  if (model.empty()) {
    answer = [](absl::Status status, MhaReply*, grpc::ByteBuffer*) { return status; };
  }
  return attention_->Submit(kInferRpc, context, std::move(start), call.status(), std::move(mha), {}, out,
                            &ValidateMultiHeadAttention, &ExecuteMultiHeadAttention,
                            &ExecuteMultiHeadAttentionBatch, std::move(answer));
}

}  // namespace mha
