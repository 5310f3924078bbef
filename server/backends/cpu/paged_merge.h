// One query row's result from the partial softmax states of the key ranges it was computed over (flash-decoding's
// splits of a cache, or a prefill tile's single pass), merged by their log-sum-exp: the paged paths' one rule for
// the output row, its statistics, a row that sees no key (zeros) and a NaN score (NaN).
#ifndef MHA_SERVER_BACKENDS_CPU_PAGED_MERGE_H_
#define MHA_SERVER_BACKENDS_CPU_PAGED_MERGE_H_

#include <cstdint>

#include "absl/types/span.h"
#include "server/backends/backend.h"

namespace mha::cpu {

// One key range's state of a row, in the scores' units: d_k accumulators relative to `max` (the range's max score,
// -inf when it saw no key), `sum` of its weights, and its kernels::kStatsPerRow statistics' accumulators (read only
// when the sequence asks for more than lse).
struct SplitRow {
  const float* acc;
  float max;
  float sum;
  const float* stats;
};

// out[0, head_dim) = the merged, normalised row; writes row `stats_row` of seq.stats when any are asked for.
// `log2_units`: the scores are in log2 units (weights 2^x).
void MergeRow(absl::Span<const SplitRow> splits, int64_t head_dim, bool log2_units, const PagedSequence& seq,
              int64_t stats_row, float* out);

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_PAGED_MERGE_H_
