// The native front door: mha.v1.Attention on gRPC's callback API. Stateless compute calls are validated on the
// handler's thread and computed by the scheduler (compute_call.h); layer, info and shared-memory calls answer at
// once; the session RPCs are SessionService's (session_service.h), ExtendStream's steps too (extend_stream.h).
// Every call, and every step of a stream, goes through one Call (call.h).
#ifndef MHA_SERVER_RPC_SERVICE_H_
#define MHA_SERVER_RPC_SERVICE_H_

#include <utility>

#include "grpcpp/grpcpp.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "server/rpc/extend_stream.h"
#include "server/rpc/service_parts.h"
#include "server/rpc/session_service.h"

namespace mha {

// The generated service with every method taking its raw bytes, so that a request that does not parse gets
// INVALID_ARGUMENT and a log line (gRPC's own parsing answers UNIMPLEMENTED with no message), and so that the token
// check comes before any parsing.
using RawSessionService = v1::Attention::WithRawCallbackMethod_CreateSession<
    v1::Attention::WithRawCallbackMethod_Extend<v1::Attention::WithRawCallbackMethod_ExtendStream<
        v1::Attention::WithRawCallbackMethod_ForkSession<v1::Attention::WithRawCallbackMethod_TruncateSession<
            v1::Attention::WithRawCallbackMethod_CloseSession<
                v1::Attention::WithRawCallbackMethod_ListSessions<v1::Attention::Service>>>>>>>;
using RawAttentionService = v1::Attention::WithRawCallbackMethod_MultiHeadAttention<
    v1::Attention::WithRawCallbackMethod_ScaledDotProductAttention<v1::Attention::WithRawCallbackMethod_LoadLayer<
        v1::Attention::WithRawCallbackMethod_UnloadLayer<v1::Attention::WithRawCallbackMethod_ListLayers<
            v1::Attention::WithRawCallbackMethod_GetServerInfo<
                v1::Attention::WithRawCallbackMethod_RegisterSharedMemory<
                    v1::Attention::WithRawCallbackMethod_UnregisterSharedMemory<
                        v1::Attention::WithRawCallbackMethod_GetSharedMemoryStatus<RawSessionService>>>>>>>>>;

class AttentionService final : public RawAttentionService {
 public:
  explicit AttentionService(const ServiceParts& parts) : parts_(parts), sessions_(parts) {}

  using Reactor = grpc::ServerUnaryReactor;
  using Context = grpc::CallbackServerContext;
  // Each takes a serialized request and fills `response` with the serialized response.
  Reactor* MultiHeadAttention(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ScaledDotProductAttention(Context* context, const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  Reactor* LoadLayer(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* UnloadLayer(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ListLayers(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* GetServerInfo(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* RegisterSharedMemory(Context* context, const grpc::ByteBuffer* request,
                                grpc::ByteBuffer* response) override;
  Reactor* UnregisterSharedMemory(Context* context, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  Reactor* GetSharedMemoryStatus(Context* context, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // The session RPCs, SessionService's.
  Reactor* CreateSession(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* Extend(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ExtendStream(Context* context) override;
  Reactor* ForkSession(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* TruncateSession(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* CloseSession(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  Reactor* ListSessions(Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;

 private:
  // The call of `rpc` on these arguments.
  Call Start(const char* rpc, Context* context, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
    return Call(parts_.edge, rpc, context, request, response);
  }

  const ServiceParts parts_;
  SessionService sessions_;
  const StepRunner extend_step_ = [this](Call step) { sessions_.ExtendStep(std::move(step)); };
};

}  // namespace mha

#endif  // MHA_SERVER_RPC_SERVICE_H_
