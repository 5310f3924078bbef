// The session RPCs of mha.v1.Attention (CreateSession, Extend, ForkSession, TruncateSession, CloseSession,
// ListSessions). Every call waits at the sessions' sequencer for the sessions it names (sequencer.h has an Extend's
// whole trip), then runs: the calls that do not compute answer at their turn; an Extend is validated against its
// held sessions, reserves its blocks and goes to the scheduler, which computes it (in steps, batched with other
// Extends), commits it, answers it and lets its sessions go.
#ifndef MHA_SERVER_RPC_SESSION_SERVICE_H_
#define MHA_SERVER_RPC_SESSION_SERVICE_H_

#include "grpcpp/grpcpp.h"
#include "server/rpc/call.h"
#include "server/rpc/service_parts.h"

namespace mha {

// Thread-safe; borrows the parts.
class SessionService {
 public:
  explicit SessionService(const ServiceParts& parts) : parts_(parts) {}

  // Each takes its call from the handler and returns its reactor.
  grpc::ServerUnaryReactor* CreateSession(Call call);
  grpc::ServerUnaryReactor* Extend(Call call);
  // An Extend that is one step of a stream (extend_stream.h): the same trip, ending through the step's Call.
  void ExtendStep(Call call);
  grpc::ServerUnaryReactor* ForkSession(Call call);
  grpc::ServerUnaryReactor* TruncateSession(Call call);
  grpc::ServerUnaryReactor* CloseSession(Call call);
  grpc::ServerUnaryReactor* ListSessions(Call call);

 private:
  const ServiceParts parts_;
};

}  // namespace mha

#endif  // MHA_SERVER_RPC_SESSION_SERVICE_H_
