// Validation of the session RPCs' requests (mha.v1 CreateSession, Extend): errors name the field with expected and
// given values, as validate.h's do. An Extend is validated twice: on the gRPC thread what the request says by itself
// (ids, which tensors, their encodings and finiteness), and when its sessions are held what depends on them (their
// kinds, layers, head configurations, cache lengths and limits), which then cannot change until the call ends.
#ifndef MHA_SERVER_SESSIONS_VALIDATE_SESSION_H_
#define MHA_SERVER_SESSIONS_VALIDATE_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/calls/validate.h"
#include "server/sessions/extend_plan.h"
#include "server/sessions/session_store.h"

namespace mha {

// A layer session's caches at most, and a head session's num_layers.
inline constexpr int kMaxSessionCaches = 1024;

// The configuration CreateSession asks for: layers looked up in context.layers (NOT_FOUND naming layers[i]), or
// heads resolved.
absl::StatusOr<SessionConfig> ValidateCreateSession(const v1::CreateSessionRequest& request,
                                                    const ValidationContext& context);

// The session ids an Extend names, checked (well-formed, each once, at most `max_items` of them: no call names more
// sessions than may be open, --max_sessions), with every present tensor's encoding and values, and which kind of
// session its items are for (the same for all).
absl::StatusOr<std::vector<std::string>> ValidateExtendRequest(const v1::ExtendRequest& request, int max_items);

// INVALID_ARGUMENT naming the field for kinds, layers, configurations, dtypes and shapes that do not match the
// sessions; FAILED_PRECONDITION for an expected_length that differs or a layer unloaded since; OUT_OF_RANGE past
// max_tokens; NOT_FOUND from the store; and the response, work and working-memory limits of validate.h.
absl::StatusOr<ExtendPlan> ValidateExtendHeld(const v1::ExtendRequest& request, const SessionStore& store,
                                              const SessionCaller& caller, const ValidationContext& context);

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_VALIDATE_SESSION_H_
