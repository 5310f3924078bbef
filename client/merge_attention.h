// Attention outputs computed over disjoint sets of keys (shards of one context: split-KV decoding, ring attention,
// a context spread over sessions on several servers) merged into the output over all of them, by each shard's
// log-sum-exp. The C++ twin of the Python client's merge_attention (client/python/mhaclient.py).
#ifndef MHA_CLIENT_MERGE_ATTENTION_H_
#define MHA_CLIENT_MERGE_ATTENTION_H_

#include <vector>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace mha {

struct MergedAttention {
  Array output;  // [..., T, H, d_k]
  Array lse;     // [..., H, T]
};

// outputs: per shard an array laid out [..., T, H, d_k] (head-packed: ScaledDotProductAttention's [B, Tq, H, d_k], a
// head session's ExtendResult.output [n, H, d_k]); lses: per shard its lse [..., H, T] (asked for with return_lse).
// Returns lse = logsumexp_s lse_s and output = sum_s exp(lse_s - lse) output_s, computed in double and exact up to
// rounding. A row whose lse is -inf in every shard (no visible key anywhere) comes out zero with lse -inf, never NaN;
// a shard whose lse is -inf for a row adds nothing to it, whatever its output holds there. A layer's output
// [..., d_model] has already mixed the heads and cannot be merged so.
// INVALID_ARGUMENT when there is no shard, the counts of outputs and lses differ, an output has fewer than 3
// dimensions, the outputs' shapes differ, an lse is not [..., H, T] of them, or an array's values do not fill its
// shape.
absl::StatusOr<MergedAttention> MergeAttention(const std::vector<Array>& outputs, const std::vector<Array>& lses);

}  // namespace mha

#endif  // MHA_CLIENT_MERGE_ATTENTION_H_
