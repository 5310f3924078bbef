// The gRPC edge: the Attention service on gRPC's callback API. Validation runs on the gRPC thread; compute is
// handed to the Scheduler, whose thread finishes the call; session calls wait their turn at the sessions' sequencer
// first (session_service.cc). This is the only place absl::Status becomes grpc::Status (with session_service.cc,
// its other half).
#ifndef MHA_SERVER_RPC_SERVICE_H_
#define MHA_SERVER_RPC_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "server/backends/registry.h"
#include "server/base/grpc_status.h"
#include "server/base/log_budget.h"
#include "server/base/log_safe.h"
#include "server/calls/execute.h"
#include "server/calls/validate.h"
#include "server/config/server_options.h"
#include "server/layers/layer_store.h"
#include "server/metrics/metrics.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/transport/auth.h"
#include "server/transport/shared_memory.h"

namespace mha {

// The generated service with every method taking its raw bytes, so that a request that does not parse gets
// INVALID_ARGUMENT and a log line (gRPC's own parsing answers UNIMPLEMENTED with no message), and so that the token
// check comes before any parsing.
using RawSessionService = v1::Attention::WithRawCallbackMethod_CreateSession<
    v1::Attention::WithRawCallbackMethod_Extend<v1::Attention::WithRawCallbackMethod_ForkSession<
        v1::Attention::WithRawCallbackMethod_TruncateSession<v1::Attention::WithRawCallbackMethod_CloseSession<
            v1::Attention::WithRawCallbackMethod_ListSessions<v1::Attention::Service>>>>>>;
using RawAttentionService = v1::Attention::WithRawCallbackMethod_MultiHeadAttention<
    v1::Attention::WithRawCallbackMethod_ScaledDotProductAttention<v1::Attention::WithRawCallbackMethod_LoadLayer<
        v1::Attention::WithRawCallbackMethod_UnloadLayer<v1::Attention::WithRawCallbackMethod_ListLayers<
            v1::Attention::WithRawCallbackMethod_GetServerInfo<
                v1::Attention::WithRawCallbackMethod_RegisterSharedMemory<
                    v1::Attention::WithRawCallbackMethod_UnregisterSharedMemory<
                        v1::Attention::WithRawCallbackMethod_GetSharedMemoryStatus<RawSessionService>>>>>>>>>;

// The serialized response for a call that ended OK; INTERNAL should serialization fail.
template <typename Response>
absl::Status Serialize(const Response& response, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  const grpc::Status status = grpc::SerializationTraits<Response>::Serialize(response, out, &own_buffer);
  if (status.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cannot serialize the response: ", status.error_message()));
}

// How a front door answers a finished compute call: given the status the call reached and its reply (empty when
// the call never computed), writes the response into `out` when the status is OK and returns the status the call
// ends with. The native RPCs encode the reply as is; server/kserve translates it.
template <typename Response>
using ComputeAnswer = std::function<absl::Status(absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out)>;

class AttentionService final : public RawAttentionService {
 public:
  // All pointers are borrowed and must outlive the service; options.backend must already be checked. `auth` may
  // be null: no token is needed then.
  AttentionService(const ServerOptions& options, LayerStore* layers, BackendRegistry* backends,
                   Scheduler* scheduler, ServerMetrics* metrics, const TokenAuth* auth, SessionStore* sessions);

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
  // The session RPCs (session_service.cc).
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Extend(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

 private:
  // Logs one finished call (`ids` from Identify, rpc, shapes, backend, status, latency) and records it in the
  // metrics. backend is empty when no backend was involved; compute_seconds and flops when compute ran.
  void CallDone(const std::string& ids, const char* rpc, absl::string_view shapes, absl::string_view backend,
                const absl::Status& status, absl::Time start, double compute_seconds = 0, double flops = 0);

  template <typename Request, typename Response, typename Plan>
  friend class ComputeCall;
  template <typename Request, typename Response, typename Handle>
  friend class SequencedCall;
  friend class ExtendCall;
  friend class ExtendWork;
  // The KServe v2 front door (server/kserve): the same admission, validation, scheduling, logs and metrics.
  friend class KServeService;

  // What a call knows when it arrives.
  struct CallStart {
    std::string id;  // from Identify
    absl::Time received;
    int64_t request_bytes = 0;  // on the wire
  };
  CallStart Begin(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes);

  // The call's identity for logs: "rid=<id>", plus " trace=<trace id>" when the client sent a W3C traceparent. The
  // request id is the client's x-request-id metadata when it is 1..128 characters of [A-Za-z0-9._:/-], else a new
  // one; either way it is returned in the response's x-request-id metadata.
  std::string Identify(grpc::CallbackServerContext* context);

  // The token check (when tokens are configured) and the parse of `bytes` into `request`; the first error. With
  // `scans`, `request` is a compute request read by ReadComputeRequest, which fills them. With `caller`, who calls
  // (the token's identity and whether it is an admin's), for the sessions it owns.
  template <typename Request>
  absl::Status Admit(const char* rpc, Role role, const grpc::CallbackServerContext& context,
                     const grpc::ByteBuffer* bytes, Request* request, std::vector<FiniteScan>* scans,
                     SessionCaller* caller = nullptr) const;

  // A session RPC that runs when its sessions are free (SessionSequencer): admits, asks `ids` for the session ids
  // the request names (their errors answer at once), then at its turn answers with what `handle` returns.
  template <typename Request, typename Response, typename Ids, typename Handle>
  grpc::ServerUnaryReactor* Sequenced(const char* rpc, grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out, Ids ids, Handle handle);
  // The call's deadline: the client's, or the server's default for a client that set none.
  absl::Time DeadlineOf(const grpc::CallbackServerContext& context, absl::Time received) const;

  // Admits, validates with `validate`, then hands the call to the scheduler as a WorkItem that runs `execute`.
  template <typename Request, typename Response, typename Plan>
  grpc::ServerUnaryReactor* Compute(const char* rpc, grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out,
                                    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
                                    absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*),
                                    absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                                                  absl::Span<Reply<Response>* const>));
  // Compute's second half, for a request already admitted with status `admitted` (its error ends the call at once,
  // through `answer`): validates, then hands the call to the scheduler; `answer` writes its response.
  template <typename Request, typename Response, typename Plan>
  grpc::ServerUnaryReactor* Submit(const char* rpc, grpc::CallbackServerContext* context, CallStart start,
                                   const absl::Status& admitted, std::unique_ptr<Request> request,
                                   std::vector<FiniteScan> scans, grpc::ByteBuffer* out,
                                   absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
                                   absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*),
                                   absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*,
                                                                 absl::Span<Reply<Response>* const>),
                                   ComputeAnswer<Response> answer);

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
  SessionStore* sessions_;
  SharedMemoryRegistry shared_memory_;
  ValidationContext validation_;
  absl::Duration default_deadline_;
  const std::string id_prefix_;  // random per process, so that ids of restarted replicas do not collide
  // "<host name>/<id_prefix_>": GetServerInfo's instance_id and every response's mha-instance-id metadata.
  const std::string instance_id_;
  std::atomic<uint64_t> next_request_id_{1};
  LogBudget log_budget_;  // call lines per second (--log_max_calls_per_s)
};

template <typename Request, typename Response, typename Handle>
grpc::ServerUnaryReactor* AttentionService::Answer(const char* rpc, Role role, grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out,
                                                   Handle handle) {
  const absl::Time start = absl::Now();
  const std::string id = Identify(context);
  Request request;
  Response response;
  std::string detail = "-";
  absl::Status status = Admit(rpc, role, *context, bytes, &request, nullptr);
  if (status.ok()) status = handle(request, &response, &detail);
  if (status.ok()) status = Serialize(response, out);
  CallDone(id, rpc, detail, "", status, start);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace mha

#endif  // MHA_SERVER_RPC_SERVICE_H_
