// A serialized ScaledDotProductAttentionRequest through what the server does with it (service.cc): parse, validate
// and, when valid and small (fuzz_env.h), execute on the reference backend, the CPU backend and one CPU tile-kernel
// variant. Findings: sanitizer reports, an error code the contract does not name for these steps, an output whose
// bytes do not match its shape.
#include <cstdio>
#include <cstdlib>

#include "proto/mha/v1/tensor_codec.h"
#include "server/calls/execute.h"
#include "server/calls/validate.h"
#include "tests/fuzz/fuzz_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  v1::ScaledDotProductAttentionRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  Count(Stage::kParsed);
  ResetSharedMemory(env);
  absl::StatusOr<SdpaPlan> plan = ValidateScaledDotProductAttention(request, env.context);
  if (!plan.ok()) {
    CheckRefusal(plan.status(), {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                 absl::StatusCode::kUnimplemented, absl::StatusCode::kResourceExhausted});
    return 0;
  }
  Count(Stage::kValid);
  if (!SmallEnough(*plan)) return 0;
  for (Backend* backend : env.BackendsFor(size)) {
    SdpaPlan on = *plan;
    on.backend = backend;
    if (!backend->Supports(on.problem).ok()) continue;
    on.workspace_bytes = backend->WorkspaceBytes(on.problem);
    if (!SmallEnough(on)) continue;
    Count(Stage::kComputed);
    SdpaReply reply;
    const absl::Status status = ExecuteScaledDotProductAttention(on, nullptr, &reply);
    if (!status.ok()) {
      if (status.code() != absl::StatusCode::kInvalidArgument) Fail("execution failed", status);
      continue;
    }
    const v1::ScaledDotProductAttentionResponse response = reply.Assembled();
    const AttentionShape& s = on.problem.shape;
    CheckComputedOutput(on, response.output());
    const std::vector<int64_t> want = {s.batch, s.q_len, s.heads.num_heads, s.heads.head_dim};
    if (std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()) != want) {
      Fail("output shape", absl::InternalError(ShapeString(response.output().shape())));
    }
    if (on.problem.return_weights) CheckOutput(response.attention_weights(), "attention_weights");
    if (response.ByteSizeLong() > static_cast<size_t>(on.response_bytes)) {
      Fail("response larger than validation said", absl::InternalError(""));
    }
  }
  return 0;
}
