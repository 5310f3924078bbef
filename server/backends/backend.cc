#include "server/backends/backend.h"

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {

int64_t KvCacheLayout::KeyBytes() const {
  if (!Quantized()) return head_dim * block_tokens * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t depth = (head_dim + 1) / 2 * 2;  // quantized_cache.h: codes, then a bf16 scale per channel
  return depth * block_tokens + 2 * depth;
}

int64_t KvCacheLayout::ValueBytes() const {
  if (!Quantized()) return head_dim * block_tokens * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t tokens = (block_tokens + 3) / 4 * 4;  // codes, then a bf16 scale per token
  return tokens * head_dim + 2 * tokens;
}

absl::Status Backend::SupportsPaged(const PagedProblem&) const {
  return absl::UnimplementedError(absl::StrCat("sessions (paged attention over a KV cache) are not implemented on "
                                               "the ", name(), " backend"));
}

absl::Status Backend::PagedAttention(const PagedArgs& args) { return SupportsPaged(args.problem); }

absl::StatusOr<std::unique_ptr<CacheArena>> Backend::AllocateCacheArena(int64_t) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend keeps no cache memory of its own"));
}

RowStats RowStats::At(int64_t offset) const {
  RowStats at = *this;
  for (float** array : {&at.lse, &at.entropy, &at.confidence, &at.distance, &at.sink, &at.contribution}) {
    if (*array != nullptr) *array += offset;
  }
  return at;
}

absl::Status CheckPagedArgs(const PagedArgs& args) {
  const PagedProblem& p = args.problem;
  const KvCacheLayout& c = p.cache;
  if (c.num_kv_heads != p.heads.num_kv_heads || c.head_dim != p.heads.head_dim || c.block_tokens < 1) {
    return absl::InternalError("paged call: the cache layout does not match the heads");
  }
  for (size_t i = 0; i < args.sequences.size(); ++i) {
    const PagedSequence& seq = args.sequences[i];
    const int64_t tokens = seq.Keys();
    const bool inputs = p.d_model > 0 ? seq.x.data != nullptr
                                      : seq.q.data != nullptr &&
                                            (!seq.append || (seq.k.data != nullptr && seq.v.data != nullptr));
    if (seq.new_tokens < 1 || seq.length < 0 || !inputs || !seq.out.requested() ||
        static_cast<int64_t>(seq.blocks.size()) * c.block_tokens < tokens ||
        (p.return_weights != seq.weights.requested()) || (p.return_stats != seq.stats.any())) {
      return absl::InternalError(absl::StrCat("paged call: sequence ", i, " is malformed (", seq.blocks.size(),
                                              " blocks for ", tokens, " tokens)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mha
