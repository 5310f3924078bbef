// The CPU backend's prefill path over session caches: every new token of a sequence with more query rows per KV
// head than the decode path takes (paged_attention.h), attended over its cache's blocks read in place, in the
// cache's dtype, by the decode kernels (tile_kernels.h's PagedKernels, which widen or pair the elements as they
// load them). Work units of (sequence, KV head, tile of new tokens): the tile's G x tokens query rows (G query heads
// per KV head, all of them served from one read of each block) go block by block through FlashAttention's online
// softmax, causal within the chunk (each row sees the keys up to its own position), the next block prefetched while
// one computes. Units are taken longest first across the calling thread's team, so a causal chunk's late tiles,
// which see the most keys, do not finish last.
//
// It replaces gathering the whole history into fp32 on every step, which made a chunked prefill deep into a context
// cost about 3x an unchunked one. Sequences that ask for their weights, or caches whose blocks no decode kernel takes
// (block_tokens not a multiple of 16), still gather.
//
// Thread-safe: per-thread scratch; parallel over the calling thread's team.
#ifndef MHA_SERVER_BACKENDS_CPU_PAGED_PREFILL_H_
#define MHA_SERVER_BACKENDS_CPU_PAGED_PREFILL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha::cpu {

// Query rows of a prefill tile at most: G x its tokens.
inline constexpr int64_t kPrefillTileRows = 128;

// Whether `seq`, which does not take the decode path, takes the prefill path (else the gather path).
bool TakesPrefillPath(const PagedProblem& problem, const PagedSequence& seq);

// heads (row stride ldh) = the attention of every new token of each sequence taking the prefill path, for the
// queries q (fp32 rows of H d_k, rotated and unscaled, row stride ldq; sequence s's token i at row first_row[s] + i),
// after its keys and values are in the cache. Writes each sequence's statistics when asked. `stop` (may be null) is
// polled between units; its status is returned once it says stop.
absl::Status PrefillSequences(const kernels::TileKernels& tiles, const kernels::PagedKernels& kernels,
                              const PagedProblem& problem, absl::Span<const PagedSequence> sequences,
                              absl::Span<const int64_t> first_row, const float* q, int64_t ldq, float* heads,
                              int64_t ldh, const StopSignal* stop);

// Bytes of per-thread scratch the prefill path holds for `problem`, per thread.
int64_t PrefillBytesPerThread(const PagedProblem& problem);

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_PAGED_PREFILL_H_
