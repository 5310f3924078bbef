// Shared-prefix keys (mha.v1 CreateSessionRequest.prefix_keys): a chain of SHA-256 digests, one per full block of
// token ids, so that two callers with the same leading tokens (and extra bytes) compute the same keys and the
// second one's session attaches the blocks the first one's filled. Python's mhaclient.prefix_keys computes the same
// bytes.
#ifndef MHA_CLIENT_PREFIX_KEYS_H_
#define MHA_CLIENT_PREFIX_KEYS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace mha {

// The keys of the floor(tokens.size() / block_tokens) full blocks of `tokens` (block_tokens >= 1: the server's
// kv_block_tokens, GetServerInfo's limits). Key i = SHA-256(key i-1 (none for block 0) | the length of `extra` as 8
// bytes little-endian | extra | block i's token ids as 8-byte little-endian integers): 32 bytes each. `extra`
// names what else the blocks' keys and values depend on (the model, a LoRA adapter, a tokenizer revision).
std::vector<std::string> PrefixKeys(absl::Span<const int64_t> tokens, int64_t block_tokens,
                                    absl::string_view extra = "");

}  // namespace mha

#endif  // MHA_CLIENT_PREFIX_KEYS_H_
