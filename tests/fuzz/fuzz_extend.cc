#include "tests/fuzz/fuzz_extend.h"

#include "proto/mha/v1/tensor_codec.h"
#include "server/sessions/execute_session.h"
#include "server/sessions/validate_session.h"

namespace mha::fuzz {
namespace {

void CheckResults(const ExtendPlan& plan, const v1::ExtendResponse& response) {
  if (response.results_size() != static_cast<int>(plan.items.size())) {
    Fail("results do not match items", absl::InternalError(""));
  }
  for (int i = 0; i < response.results_size(); ++i) {
    const v1::ExtendResult& result = response.results(i);
    CheckOutput(result.output(), "output");
    if (result.output().shape(0) != plan.items[i].new_tokens || result.output().dtype() != plan.paged.output_dtype) {
      Fail("output shape or dtype", absl::InternalError(ShapeString(result.output().shape())));
    }
    if (plan.paged.return_weights) CheckOutput(result.attention_weights(), "attention_weights");
    if (result.length() != plan.items[i].length + plan.items[i].new_tokens) {
      Fail("length after the call", absl::InternalError(""));
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExtendIds(const v1::ExtendRequest& request) {
  absl::StatusOr<std::vector<std::string>> ids = ValidateExtendRequest(request, /*max_items=*/1024);
  if (!ids.ok()) CheckRefusal(ids.status(), {absl::StatusCode::kInvalidArgument});
  return ids;
}

absl::StatusOr<ExtendPlan> ValidateStep(const Env& env, SessionStore& store, const v1::ExtendRequest& request) {
  absl::StatusOr<ExtendPlan> plan = ValidateExtendHeld(request, store, {}, env.context);
  if (!plan.ok()) {
    CheckRefusal(plan.status(), {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                 absl::StatusCode::kFailedPrecondition, absl::StatusCode::kOutOfRange,
                                 absl::StatusCode::kUnimplemented, absl::StatusCode::kResourceExhausted});
  }
  return plan;
}

bool ComputeStep(const Env& env, SessionStore& store, const ExtendPlan& plan) {
  if (!SmallEnough(plan)) return false;
  const std::vector<Backend*> backends = {env.reference, env.cpu};
  for (size_t b = 0; b < backends.size(); ++b) {
    ExtendPlan on = plan;
    on.backend = backends[b];
    if (!on.backend->SupportsPaged(on.paged).ok()) continue;
    absl::StatusOr<ExtendReservation> reservation = store.Reserve(on.reserve);
    if (!reservation.ok()) {
      CheckRefusal(reservation.status(), {absl::StatusCode::kResourceExhausted});
      return false;
    }
    Count(Stage::kComputed);
    v1::ExtendResponse response;
    const absl::Status status = ExecuteExtend(on, *reservation, nullptr, &response);
    if (!status.ok()) Fail("execution failed", status);
    CheckResults(on, response);
    if (b + 1 == backends.size()) {
      reservation->Commit();
      return true;
    }
  }
  return false;
}

}  // namespace mha::fuzz
