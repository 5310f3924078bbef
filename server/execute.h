// The compute step of a call, on the thread that computes it: decodes what validation left encoded (the attention
// mask, checked for NaN and +inf while decoding; inline weights), hands the plan's backend the wire's tensors and
// the response's bytes, and fills the response.
#ifndef MHA_SERVER_EXECUTE_H_
#define MHA_SERVER_EXECUTE_H_

#include "absl/status/status.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/validate.h"

namespace mha {

// `plan` must come from validating the request it borrows from. Fills output, attention_weights (when requested)
// and backend; INVALID_ARGUMENT for a mask value that is NaN or +inf, `stop`'s status once it says stop (it may be
// null), the backend's error otherwise.
absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, const StopSignal* stop,
                                       v1::MultiHeadAttentionResponse* response);
// Computes the calls of `plans` (non-empty, all with one batch_key) as one backend call along the batch dimension
// and fills responses[i] as ExecuteMultiHeadAttention would for plans[i] alone. The status applies to every call.
absl::Status ExecuteMultiHeadAttentionBatch(absl::Span<const MhaPlan* const> plans, const StopSignal* stop,
                                            absl::Span<v1::MultiHeadAttentionResponse* const> responses);
absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan, const StopSignal* stop,
                                              v1::ScaledDotProductAttentionResponse* response);

}  // namespace mha

#endif  // MHA_SERVER_EXECUTE_H_
