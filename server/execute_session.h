// The compute step of an Extend whose blocks are reserved: the plan's backend appends each item's new tokens to its
// cache and attends (Backend::PagedAttention), writing each result's output and weights into the response.
#ifndef MHA_SERVER_EXECUTE_SESSION_H_
#define MHA_SERVER_EXECUTE_SESSION_H_

#include "absl/status/status.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/sessions/session_store.h"
#include "server/validate_session.h"

namespace mha {

// Fills response->results (one per item: output, weights when asked, the cache's length after the call) and
// response->backend. `reservation` must be Reserve's for plan.reserve; the caller commits it when this returns OK
// and the call is still wanted. `stop` may be null.
absl::Status ExecuteExtend(const ExtendPlan& plan, const ExtendReservation& reservation, const StopSignal* stop,
                           v1::ExtendResponse* response);

}  // namespace mha

#endif  // MHA_SERVER_EXECUTE_SESSION_H_
