// An Extend request through what session_service.cc does with it once its sessions exist, shared by the targets
// that fuzz sessions (fuzz_extend_request, fuzz_create_session).
#ifndef MHA_TESTS_FUZZ_FUZZ_EXTEND_H_
#define MHA_TESTS_FUZZ_FUZZ_EXTEND_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/sessions/extend_plan.h"
#include "server/sessions/session_store.h"
#include "tests/fuzz/fuzz_env.h"

namespace mha::fuzz {

// The request alone validated (ValidateExtendRequest): its session ids, or the refusal (checked to be
// INVALID_ARGUMENT with a message; the caller returns).
absl::StatusOr<std::vector<std::string>> ExtendIds(const v1::ExtendRequest& request);

// `request` validated against `store`'s sessions (ValidateExtendHeld), or the refusal (checked to be one of the
// codes the contract names for that step).
absl::StatusOr<ExtendPlan> ValidateStep(const Env& env, SessionStore& store, const v1::ExtendRequest& request);

// A valid step, when small (fuzz_env.h), computed on the reference backend and the CPU backend, each on a
// reservation of its own, the last one committed. Aborts (a finding) on a refusal the contract does not name, a step
// that fails, or results that do not match their items. Returns whether it was computed and committed.
bool ComputeStep(const Env& env, SessionStore& store, const ExtendPlan& plan);

}  // namespace mha::fuzz

#endif  // MHA_TESTS_FUZZ_FUZZ_EXTEND_H_
