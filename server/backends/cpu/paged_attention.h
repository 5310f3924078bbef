// The CPU backend's attention over session caches (backend.h's PagedArgs), after the new tokens' q, k and v are
// projected and rotated:
//  - WriteTokens puts each sequence's new keys and values into their cache slots, in the cache's dtype;
//  - PagedAttend computes every new token's attention over its whole cache. A sequence with few query rows per KV
//    head (H / Hkv query heads times its new tokens, up to kDecodeRows) that returns no weights takes the decode
//    path: work units of (sequence, KV head, range of blocks), each streaming its KV head's part of its blocks once
//    from memory for every query row of the head's group, through the decode kernels (tile_kernels.h's
//    PagedKernels) with FlashAttention's online softmax; a long cache is split over the threads (flash-decoding)
//    and the splits are merged by their log-sum-exp, so one long session uses every core. A sequence with more
//    rows (a prefill's chunk) takes the prefill path (paged_prefill.h), over the blocks in place as well; one that
//    asks for its weights, or a cache whose blocks no paged kernel takes, gathers its cache into fp32 rows and runs
//    the tile kernels' Attend (the gather path).
//
// Thread-safe: scratch belongs to the calling OpenMP threads; parallel over the calling thread's team.
#ifndef MHA_SERVER_BACKENDS_CPU_PAGED_ATTENTION_H_
#define MHA_SERVER_BACKENDS_CPU_PAGED_ATTENTION_H_

#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha::cpu {

// Query rows per KV head up to which a sequence without weights takes the decode path.
inline constexpr int64_t kDecodeRows = 16;

// Whether `seq` of a call of `problem` takes the decode path.
bool TakesDecodePath(const PagedProblem& problem, const PagedSequence& seq);

// An 8-bit cache's scales in a KV head's K part and V part (quantized_cache.h; null for the other dtypes).
const uint16_t* KeyScales(const KvCacheLayout& cache, const char* key_part);
const uint16_t* ValueScales(const KvCacheLayout& cache, const char* value_part);
// Whether the paged kernels take `cache`'s blocks as far as its dtype goes: an 8-bit cache's head_dim and block up to
// kernels::kQuantizedMaxElements (their kernels' stack buffers); every other cache.
bool QuantizedKernelsTake(const KvCacheLayout& cache);

// Rows of the new tokens of every sequence, one after another: sequence s's token i is row first_row[s] + i.
struct PagedRows {
  absl::Span<const int64_t> first_row;
  int64_t total = 0;
};

// The new tokens' q, k and v, fp32 rows (PagedRows' order) with their strides in elements: the caller's scratch,
// which it projects and rotates in place; PagedAttend only reads them.
struct PagedQkv {
  float* q;
  float* k;
  float* v;
  int64_t ldq, ldk, ldv;
};

// Calls each(s) for every sequence s of a call: a batch of short appends (more than one sequence, none of more than
// kShortSequenceTokens new tokens: a decode step) one sequence per thread of the calling team, whose per-sequence
// work (conversions, RoPE angles, cache writes) is otherwise serial at a few microseconds each; any other call's
// sequences one after another, each parallel inside as its size asks. `each` must be safe to run for distinct
// sequences at once.
inline constexpr int64_t kShortSequenceTokens = 16;
void ForEachSequence(absl::Span<const PagedSequence> sequences, absl::FunctionRef<void(size_t)> each);

// Writes the new tokens' k and v (fp32 rows of Hkv d_k values, row stride ldk / ldv) into their slots of every
// sequence's cache, rounded to the cache's dtype.
void WriteTokens(const KvCacheLayout& cache, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                 const float* k, int64_t ldk, const float* v, int64_t ldv);

// heads (row stride ldh, H d_k values per row) = each new token's attention over its cache, for the queries qkv.q
// (rotated, unscaled), after WriteTokens put qkv.k and qkv.v into the caches. Writes each sequence's weights (fp32
// computed, encoded into seq.weights) when requested. `fp32_tiles` is the fp32 tile set for head_dim (the gather
// path). `stop` (may be null) is polled between work units; its status is returned once it says stop.
// The decode path runs `decode` (the kernels for problem.cache.dtype), the gather path fp32_tiles.
absl::Status PagedAttend(const kernels::TileKernels& fp32_tiles, const kernels::PagedKernels& decode,
                         const PagedProblem& problem, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                         const PagedQkv& qkv, float* heads, int64_t ldh, const StopSignal* stop);

// Bytes of working memory PagedAttend needs beyond its inputs and outputs.
int64_t PagedAttendBytes(const kernels::TileKernels& fp32_tiles, const PagedProblem& problem, int threads);

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_PAGED_ATTENTION_H_
