// Sharded decoding (mha_client decode --shards N): one logical head session spread over N head sessions, one per
// shard, each on its own server. Shard i holds the prefill's tokens [ShardBegin(T, N, i), ShardBegin(T, N, i + 1))
// at its own cache positions 0.. (so RoPE would place them wrongly: sharded runs use no RoPE). A decode step asks
// every shard for the new token's attention over what it holds, with return_lse: all but the last with
// ExtendItem.append = false and q alone, the last with k and v appended; the outputs merge by their lse
// (client/merge_attention.h) into exactly the attention over the whole context.
#ifndef MHA_CLIENT_DECODE_SHARDS_H_
#define MHA_CLIENT_DECODE_SHARDS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/attention_client.h"

namespace mha {

// The first token of shard `shard` (0 <= shard <= shards) of a context of `context` tokens cut into `shards`
// contiguous parts whose sizes differ by at most one; ShardBegin(context, shards, shards) == context.
int64_t ShardBegin(int64_t context, int shards, int shard);

// One item's answer from every shard: the merged output [n, H, d_k] (fp32, head-packed) and each shard's cache
// length after the call, in shard order.
struct ShardedResult {
  Array output;
  std::vector<int64_t> lengths;
};

// Sends requests[i] to *clients[i], all at once (a thread each but the last, which the calling thread sends), and
// merges item j's outputs across the shards by their lse. The requests must hold the same number of items, in the
// same order (one logical session each), with return_lse and fp32 outputs. Returns the first failing shard's error
// (naming the shard), or INTERNAL if a response lacks a result, an output or an lse. Thread-safe as the clients are.
absl::StatusOr<std::vector<ShardedResult>> ExtendShards(absl::Span<AttentionClient* const> clients,
                                                        absl::Span<const v1::ExtendRequest> requests);

}  // namespace mha

#endif  // MHA_CLIENT_DECODE_SHARDS_H_
