// The second front door: KServe v2's inference.GRPCInferenceService (the Open Inference Protocol that Triton,
// OpenVINO Model Server and KServe's runtimes serve), on the same port as mha.v1.Attention. Every registered layer
// is a model of its name, version "1"; the model "sdpa" is ScaledDotProductAttention. ModelInfer is translated
// (infer_request.h) and runs as the native compute calls do (the same Call, validation, scheduler, logs and
// metrics), answered in KServe's encoding; shared memory is the server's one registry. Methods take raw bytes for
// the same reasons as the native ones.
#ifndef MHA_SERVER_RPC_KSERVE_KSERVE_SERVICE_H_
#define MHA_SERVER_RPC_KSERVE_KSERVE_SERVICE_H_

#include <functional>
#include <memory>
#include <string>

#include "proto/inference/grpc_service.grpc.pb.h"
#include "server/rpc/call.h"
#include "server/rpc/kserve/infer_request.h"
#include "server/rpc/kserve/model_stats.h"
#include "server/rpc/service_parts.h"

namespace mha {

using RawKServeHealth = inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithRawCallbackMethod_ModelConfig<
                        inference::GRPCInferenceService::Service>>>>>>;
using RawKServeService = inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
    inference::GRPCInferenceService::WithRawCallbackMethod_ModelStatistics<
        inference::GRPCInferenceService::WithRawCallbackMethod_RepositoryIndex<
            inference::GRPCInferenceService::WithRawCallbackMethod_SystemSharedMemoryStatus<
                inference::GRPCInferenceService::WithRawCallbackMethod_SystemSharedMemoryRegister<
                    inference::GRPCInferenceService::WithRawCallbackMethod_SystemSharedMemoryUnregister<
                        RawKServeHealth>>>>>>;

class KServeService final : public RawKServeService {
 public:
  // Borrows the parts. `live` and `ready` read the server's health (service "" and mha.v1.Attention) for ServerLive
  // and ServerReady.
  KServeService(const ServiceParts& parts, std::function<bool()> live, std::function<bool()> ready);

  using Reactor = grpc::ServerUnaryReactor;
  using Context = grpc::CallbackServerContext;
  Reactor* ServerLive(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ServerReady(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  // ready = false for a model that is not served.
  Reactor* ModelReady(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ServerMetadata(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ModelMetadata(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ModelConfig(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ModelInfer(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ModelStatistics(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* RepositoryIndex(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* SystemSharedMemoryStatus(Context* context, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  Reactor* SystemSharedMemoryRegister(Context* context, const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  Reactor* SystemSharedMemoryUnregister(Context* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;

 private:
  // The layer model `name` serves (null for "sdpa"); NOT_FOUND, naming the model, when none is served or the
  // version is not "1".
  absl::StatusOr<std::shared_ptr<const Layer>> FindModel(const std::string& name, const std::string& version) const;
  // The call of `rpc` on these arguments.
  Call Start(const char* rpc, Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
    return Call(parts_.edge, rpc, context, request, response);
  }

  const ServiceParts parts_;
  const std::function<bool()> live_, ready_;
  ModelStats stats_;
};

}  // namespace mha

#endif  // MHA_SERVER_RPC_KSERVE_KSERVE_SERVICE_H_
