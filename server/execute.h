// The compute step of a call: decodes the validated inputs to fp32, runs the plan's backend, and writes the
// response tensors. Runs on the scheduler's compute thread. fp32 inputs are read in place and fp32 outputs are
// written straight into the response's bytes; fp16/bf16 are converted at these edges.
#ifndef MHA_SERVER_EXECUTE_H_
#define MHA_SERVER_EXECUTE_H_

#include "absl/status/status.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/validate.h"

namespace mha {

// `plan` must come from validating the request it borrows from. Fills output, attention_weights and backend.
absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, v1::MultiHeadAttentionResponse* response);
absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan, v1::ScaledDotProductAttentionResponse* response);

}  // namespace mha

#endif  // MHA_SERVER_EXECUTE_H_
