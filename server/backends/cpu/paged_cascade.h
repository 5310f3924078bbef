// Cascade decode on the CPU (paged_attention.h's decode path): sequences of one call whose caches start with the same
// blocks (forks, or sessions that attached one prompt's blocks by prefix key) read those blocks once for all of
// them. Their query rows are stacked into one larger group against each shared block (FlashInfer's cascade
// attention), through the prefill kernels, which serve many rows from each vector of K^T or V they load; each row's
// partial softmax state over the shared blocks is then merged by log-sum-exp with its state over the sequence's own
// blocks (paged_merge.h), as flash-decoding merges the splits of one cache. The result equals computing the
// sequences apart up to the order of the sums (within the conformance suite's tolerances, not bit for bit).
//
// Thread-safe: per-thread scratch.
#ifndef MHA_SERVER_BACKENDS_CPU_PAGED_CASCADE_H_
#define MHA_SERVER_BACKENDS_CPU_PAGED_CASCADE_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha::cpu {

// Stacked rows of a group at most (64 sequences of a GQA group of 4 decoding a token each): the prefill kernels'
// buffers per thread stay within a few MiB. A larger set of sequences sharing blocks forms several groups.
inline constexpr int64_t kCascadeMaxRows = 256;

// Sequences (indices into the call's) that read `blocks` leading blocks in common, each block full and seen whole by
// every query row of every member; member m's rows are stacked rows row0[m].. (G new_tokens of them, token-major).
struct SharedGroup {
  std::vector<int64_t> members;
  std::vector<int64_t> row0;
  int64_t rows = 0;
  int64_t blocks = 0;
};

// The groups among the sequences that take the decode path: at least two sequences each, the same addresses in
// blocks[0, blocks). Sequences in no group compute alone.
std::vector<SharedGroup> FindSharedPrefixes(const PagedProblem& p, absl::Span<const PagedSequence> sequences);

// Floats of one KV head's partial softmax state of `rows` rows: d_k accumulators per row (relative to the row's
// max), then the rows' maxima, their sums, and their kernels::kStatsPerRow statistics' accumulators.
inline int64_t PartialFloats(const HeadSpec& h, int64_t rows) {
  return rows * (h.head_dim + 2 + kernels::kStatsPerRow);
}

// Shared blocks [b0, b1) of a group, every KV head, into its partial states at `partial` (Hkv PartialFloats(rows)
// of them, head after head). q (fp32 rows of H d_k, rotated and unscaled, stride ldq; sequence s's token i at row
// first_row[s] + i) is scaled by q_scale; log2: the scores are in log2 units.
void RunSharedBlocks(const kernels::TileKernels& tiles, const kernels::PagedKernels& kernels, const PagedProblem& p,
                     const SharedGroup& group, absl::Span<const PagedSequence> sequences,
                     absl::Span<const int64_t> first_row, const float* q, int64_t ldq, float q_scale, bool log2,
                     int64_t b0, int64_t b1, float* partial);

// Bytes of per-thread scratch RunSharedBlocks holds for `problem`, per thread.
int64_t SharedBlocksBytesPerThread(const PagedProblem& problem);

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_PAGED_CASCADE_H_
