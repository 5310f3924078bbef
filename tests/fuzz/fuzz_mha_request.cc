// A serialized MultiHeadAttentionRequest through what the server does with it (service.cc): parse, validate and,
// when valid and small (fuzz_env.h), execute on the reference backend, the CPU backend and one CPU tile-kernel
// variant; a plan that may be batched also runs as a batch of two. Findings: sanitizer reports, an error code the
// contract does not name for these steps, an output whose bytes do not match its shape.
#include <cstdio>
#include <cstdlib>

#include "proto/mha/v1/tensor_codec.h"
#include "server/calls/execute.h"
#include "server/calls/validate.h"
#include "tests/fuzz/fuzz_env.h"

namespace mha::fuzz {
namespace {

void CheckResponse(const MhaPlan& plan, const v1::MultiHeadAttentionResponse& response) {
  const AttentionShape& s = plan.problem.shape;
  CheckComputedOutput(plan, response.output());
  const std::vector<int64_t> want = {s.batch, s.q_len, s.d_model};
  if (std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()) != want ||
      response.output().dtype() != plan.problem.output_dtype) {
    Fail("output shape or dtype", absl::InternalError(ShapeString(response.output().shape())));
  }
  if (plan.problem.return_weights) CheckOutput(response.attention_weights(), "attention_weights");
  if (response.ByteSizeLong() > static_cast<size_t>(plan.response_bytes)) {
    Fail("response larger than validation said", absl::InternalError(""));
  }
}

}  // namespace
}  // namespace mha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  v1::MultiHeadAttentionRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;  // not a message: not worth keeping
  Count(Stage::kParsed);
  ResetSharedMemory(env);
  absl::StatusOr<MhaPlan> plan = ValidateMultiHeadAttention(request, env.context);
  if (!plan.ok()) {
    CheckRefusal(plan.status(), {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                 absl::StatusCode::kUnimplemented, absl::StatusCode::kResourceExhausted});
    return 0;
  }
  Count(Stage::kValid);
  if (!SmallEnough(*plan)) return 0;
  for (Backend* backend : env.BackendsFor(size)) {
    MhaPlan on = *plan;
    on.backend = backend;
    if (!backend->Supports(on.problem).ok()) continue;
    on.workspace_bytes = backend->WorkspaceBytes(on.problem);
    if (!SmallEnough(on)) continue;
    Count(Stage::kComputed);
    MhaReply reply;
    const absl::Status status = ExecuteMultiHeadAttention(on, nullptr, &reply);
    // Execution may only refuse what validation leaves to it: NaN or +inf in the attention mask.
    if (!status.ok()) {
      if (status.code() != absl::StatusCode::kInvalidArgument) Fail("execution failed", status);
      continue;
    }
    CheckResponse(on, reply.Assembled());
    if (!on.batch_key.empty()) {
      MhaReply first, second;
      const MhaPlan* plans[] = {&on, &on};
      MhaReply* replies[] = {&first, &second};
      const absl::Status batch = ExecuteMultiHeadAttentionBatch(plans, nullptr, replies);
      if (!batch.ok()) Fail("a batch of two failed where the call alone succeeded", batch);
      CheckResponse(on, first.Assembled());
      CheckResponse(on, second.Assembled());
    }
  }
  return 0;
}
