// A synthetic call a backend runs to warm up and to show its speed: self-attention on constant inputs and weights.
#ifndef MHA_SERVER_BACKENDS_SYNTHETIC_H_
#define MHA_SERVER_BACKENDS_SYNTHETIC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace mha {

// Runs MultiHeadAttention on `backend` for one sequence of `tokens` tokens of width d_model with `heads` heads
// (fp32, fused Q|K|V weights, no mask); returns its AttentionFlops, or the backend's error.
absl::StatusOr<double> RunSyntheticLayer(Backend& backend, int64_t tokens, int64_t d_model, int64_t heads);

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_SYNTHETIC_H_
