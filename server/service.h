// The gRPC edge: the Attention service on gRPC's callback API. Validation runs on the gRPC thread; compute is
// handed to the Scheduler, whose thread finishes the call. This is the only place absl::Status becomes
// grpc::Status.
#ifndef MHA_SERVER_SERVICE_H_
#define MHA_SERVER_SERVICE_H_

#include <atomic>
#include <memory>

#include "proto/mha/v1/attention.grpc.pb.h"
#include "server/backends/registry.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/server_options.h"
#include "server/validate.h"

namespace mha {

grpc::Status ToGrpcStatus(const absl::Status& status);

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // All pointers are borrowed and must outlive the service; options.backend must already be checked.
  AttentionService(const ServerOptions& options, LayerStore* layers, BackendRegistry* backends,
                   Scheduler* scheduler, ServerMetrics* metrics);

  grpc::ServerUnaryReactor* MultiHeadAttention(grpc::CallbackServerContext* context,
                                               const v1::MultiHeadAttentionRequest* request,
                                               v1::MultiHeadAttentionResponse* response) override;
  grpc::ServerUnaryReactor* ScaledDotProductAttention(grpc::CallbackServerContext* context,
                                                      const v1::ScaledDotProductAttentionRequest* request,
                                                      v1::ScaledDotProductAttentionResponse* response) override;
  grpc::ServerUnaryReactor* LoadLayer(grpc::CallbackServerContext* context, const v1::LoadLayerRequest* request,
                                      v1::LoadLayerResponse* response) override;
  grpc::ServerUnaryReactor* UnloadLayer(grpc::CallbackServerContext* context,
                                        const v1::UnloadLayerRequest* request,
                                        v1::UnloadLayerResponse* response) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext* context, const v1::ListLayersRequest* request,
                                       v1::ListLayersResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;

 private:
  // Logs one finished call (request id, rpc, shapes, backend, status, latency) and records it in the metrics.
  // backend is empty when no backend was involved; compute_seconds and flops when compute ran.
  void CallDone(uint64_t id, const char* rpc, absl::string_view shapes, absl::string_view backend,
                const absl::Status& status, absl::Time start, double compute_seconds = 0, double flops = 0);

  template <typename Request, typename Response, typename Plan>
  friend class ComputeCall;

  // Validates with `validate`, then hands the call to the scheduler as a WorkItem that runs `execute`.
  template <typename Request, typename Response, typename Plan>
  grpc::ServerUnaryReactor* Compute(const char* rpc, grpc::CallbackServerContext* context, const Request* request,
                                    Response* response,
                                    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
                                    absl::Status (*execute)(const Plan&, const StopSignal*, Response*),
                                    absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                                                  absl::Span<Response* const>));

  ServerOptions options_;
  LayerStore* layers_;
  BackendRegistry* backends_;
  Scheduler* scheduler_;
  ServerMetrics* metrics_;
  ValidationContext validation_;
  absl::Duration default_deadline_;
  std::atomic<uint64_t> next_request_id_{1};
};

}  // namespace mha

#endif  // MHA_SERVER_SERVICE_H_
