// KServe v2's ModelInferRequest read as one of the native compute requests, so that both front doors share one
// path inside (validation, scheduling, execution). A layer's model takes MultiHeadAttention's inputs by name, the
// model "sdpa" ScaledDotProductAttention's; docs/KSERVE.md has the table. Errors name the input, output or
// parameter as the client wrote it ("query", not a field number).
#ifndef MHA_SERVER_RPC_KSERVE_INFER_REQUEST_H_
#define MHA_SERVER_RPC_KSERVE_INFER_REQUEST_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/inference/grpc_service.pb.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// The model that serves ScaledDotProductAttention; every other model name is a registered layer.
inline constexpr char kSdpaModel[] = "sdpa";
// The one version of every model.
inline constexpr char kModelVersion[] = "1";

// An output a call returns, in the order the response lists them: the output, the attention weights, the lse
// [B, H, Tq], and HeadStats' fields [B, H] as head_entropy, head_normalized_entropy, head_confidence,
// head_distance, head_sink_mass and (a layer's) head_contribution (attention.proto's HeadStats).
enum class KServeOutput {
  kOutput,
  kAttentionWeights,
  kLse,
  kEntropy,
  kNormalizedEntropy,
  kConfidence,
  kDistance,
  kSinkMass,
  kContribution,
};
inline constexpr KServeOutput kOutputs[] = {
    KServeOutput::kOutput,     KServeOutput::kAttentionWeights, KServeOutput::kLse,
    KServeOutput::kEntropy,    KServeOutput::kNormalizedEntropy, KServeOutput::kConfidence,
    KServeOutput::kDistance,   KServeOutput::kSinkMass,         KServeOutput::kContribution};
// Whether `output` is one of HeadStats' fields.
inline bool IsHeadStat(KServeOutput output) { return output >= KServeOutput::kEntropy; }

struct KServeCall {
  // Exactly one is set: `mha` for a layer's model (its `layer` names it), `sdpa` for the model "sdpa".
  std::unique_ptr<v1::MultiHeadAttentionRequest> mha;
  std::unique_ptr<v1::ScaledDotProductAttentionRequest> sdpa;
  std::vector<KServeOutput> outputs;  // at least one
};

// The KServe name of an output.
const char* OutputName(KServeOutput output);
// The KServe datatype ("FP32", "FP16", "BF16") of a tensor dtype.
const char* DatatypeName(v1::DataType dtype);

// NOT_FOUND for a version other than "" and "1"; OK otherwise (the model's existence is checked elsewhere).
absl::Status CheckModelVersion(const std::string& model, const std::string& version);

// Translates `request`, whose tensors' bytes are moved out of it (not copied). INVALID_ARGUMENT naming the input,
// output or parameter for what the model does not take: an unknown or repeated name, a wrong datatype, a shape
// whose bytes do not match, contents both raw and typed, an unknown parameter or one of the wrong type.
absl::StatusOr<KServeCall> TranslateInferRequest(inference::ModelInferRequest* request);

}  // namespace mha

#endif  // MHA_SERVER_RPC_KSERVE_INFER_REQUEST_H_
