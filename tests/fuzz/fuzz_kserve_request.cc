// A serialized KServe v2 ModelInferRequest through what the KServe front door does with it (server/kserve): parse,
// translate into the native request, validate it. Computing is the native targets' (fuzz_mha_request,
// fuzz_sdpa_request): a translated request is one of theirs. Findings: sanitizer reports, a refusal with another
// code than the contract names, a translation that leaves the inputs' bytes behind or grows them past twice.
#include <cstdint>

#include "server/calls/validate.h"
#include "server/rpc/kserve/infer_request.h"
#include "tests/fuzz/fuzz_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  Count(Stage::kParsed);
  const size_t parsed_bytes = request.ByteSizeLong();
  absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  if (!call.ok()) {
    CheckRefusal(call.status(), {absl::StatusCode::kInvalidArgument});
    return 0;
  }
  const size_t translated = call->sdpa != nullptr ? call->sdpa->ByteSizeLong() : call->mha->ByteSizeLong();
  if (translated > 2 * parsed_bytes + 4096) {
    Fail("translation grew the request", absl::InternalError(std::to_string(translated)));
  }
  if (call->outputs.empty()) Fail("no output to return", absl::InternalError(""));
  ResetSharedMemory(env);
  const absl::Status valid = call->sdpa != nullptr
                                 ? ValidateScaledDotProductAttention(*call->sdpa, env.context).status()
                                 : ValidateMultiHeadAttention(*call->mha, env.context).status();
  if (!valid.ok()) {
    CheckRefusal(valid, {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                         absl::StatusCode::kUnimplemented, absl::StatusCode::kResourceExhausted});
    return 0;
  }
  Count(Stage::kValid);
  return 0;
}
