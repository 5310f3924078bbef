// The gRPC edge: the Attention service on gRPC's callback API. Validation runs on the gRPC thread; compute is
// handed to the Scheduler, whose thread finishes the call. This is the only place absl::Status becomes
// grpc::Status.
#ifndef MHA_SERVER_SERVICE_H_
#define MHA_SERVER_SERVICE_H_

#include <atomic>
#include <memory>
#include <vector>

#include "proto/mha/v1/attention.grpc.pb.h"
#include "server/auth.h"
#include "server/backends/registry.h"
#include "server/execute.h"
#include "server/layer_store.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/server_options.h"
#include "server/shared_memory.h"
#include "server/validate.h"

namespace mha {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The generated service with every method taking its raw bytes, so that a request that does not parse gets
// INVALID_ARGUMENT and a log line (gRPC's own parsing answers UNIMPLEMENTED with no message), and so that the token
// check comes before any parsing.
using RawAttentionService = v1::Attention::WithRawCallbackMethod_MultiHeadAttention<
    v1::Attention::WithRawCallbackMethod_ScaledDotProductAttention<v1::Attention::WithRawCallbackMethod_LoadLayer<
        v1::Attention::WithRawCallbackMethod_UnloadLayer<v1::Attention::WithRawCallbackMethod_ListLayers<
            v1::Attention::WithRawCallbackMethod_GetServerInfo<
                v1::Attention::WithRawCallbackMethod_RegisterSharedMemory<
                    v1::Attention::WithRawCallbackMethod_UnregisterSharedMemory<
                        v1::Attention::WithRawCallbackMethod_GetSharedMemoryStatus<v1::Attention::Service>>>>>>>>>;

class AttentionService final : public RawAttentionService {
 public:
  // All pointers are borrowed and must outlive the service; options.backend must already be checked. `auth` may
  // be null: no token is needed then.
  AttentionService(const ServerOptions& options, LayerStore* layers, BackendRegistry* backends,
                   Scheduler* scheduler, ServerMetrics* metrics, const TokenAuth* auth);

  // Each takes a serialized request and fills `response` with the serialized response.
  grpc::ServerUnaryReactor* MultiHeadAttention(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ScaledDotProductAttention(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* LoadLayer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnloadLayer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(grpc::CallbackServerContext* context,
                                                 const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetSharedMemoryStatus(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) override;

 private:
  // Logs one finished call (`ids` from Identify, rpc, shapes, backend, status, latency) and records it in the
  // metrics. backend is empty when no backend was involved; compute_seconds and flops when compute ran.
  void CallDone(const std::string& ids, const char* rpc, absl::string_view shapes, absl::string_view backend,
                const absl::Status& status, absl::Time start, double compute_seconds = 0, double flops = 0);

  template <typename Request, typename Response, typename Plan>
  friend class ComputeCall;

  // The call's identity for logs: "rid=<id>", plus " trace=<trace id>" when the client sent a W3C traceparent. The
  // request id is the client's x-request-id metadata when it is 1..128 characters of [A-Za-z0-9._:/-], else a new
  // one; either way it is returned in the response's x-request-id metadata.
  std::string Identify(grpc::CallbackServerContext* context);

  // The token check (when tokens are configured) and the parse of `bytes` into `request`; the first error. With
  // `scans`, `request` is a compute request read by ReadComputeRequest, which fills them.
  template <typename Request>
  absl::Status Admit(const char* rpc, Role role, const grpc::CallbackServerContext& context,
                     const grpc::ByteBuffer* bytes, Request* request, std::vector<FiniteScan>* scans) const;

  // Admits, validates with `validate`, then hands the call to the scheduler as a WorkItem that runs `execute`.
  template <typename Request, typename Response, typename Plan>
  grpc::ServerUnaryReactor* Compute(const char* rpc, grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out,
                                    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
                                    absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*),
                                    absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                                                  absl::Span<Reply<Response>* const>));

  // Admits, then answers at once with what `handle` returns (its log detail in `detail`): the RPCs that do not
  // compute.
  template <typename Request, typename Response, typename Handle>
  grpc::ServerUnaryReactor* Answer(const char* rpc, Role role, grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out, Handle handle);

  ServerOptions options_;
  LayerStore* layers_;
  BackendRegistry* backends_;
  Scheduler* scheduler_;
  ServerMetrics* metrics_;
  const TokenAuth* auth_;
  SharedMemoryRegistry shared_memory_;
  ValidationContext validation_;
  absl::Duration default_deadline_;
  const std::string id_prefix_;  // random per process, so that ids of restarted replicas do not collide
  std::atomic<uint64_t> next_request_id_{1};
};

}  // namespace mha

#endif  // MHA_SERVER_SERVICE_H_
