#include "server/backends/cpu/paged_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/backends/cpu/tile_kernels.h"
#include "server/backends/row_stats.h"

namespace mha::cpu {

void MergeRow(absl::Span<const SplitRow> splits, int64_t dk, bool log2_units, const PagedSequence& seq,
              int64_t stats_row, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto weight = [&](float x) { return log2_units ? std::exp2(x) : std::exp(x); };
  const bool stats = seq.stats.softmax();  // accumulators beyond max and sum: zero for lse alone
  float max = kNegInf, sum = 0.0f;
  bool nan = false;
  for (const SplitRow& split : splits) {
    max = std::max(max, split.max);
    nan |= std::isnan(split.sum);
  }
  if (max == kNegInf || nan) {  // nothing visible: zeros; a NaN score: NaN, as the stateless paths give
    std::fill_n(out, dk, nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
    RowSums none;
    none.sum = nan ? std::numeric_limits<double>::quiet_NaN() : 0.0;
    if (stats) WriteRowStats(seq.stats, stats_row, none, 1.0);
    return;
  }
  std::fill_n(out, dk, 0.0f);
  RowSums sums;
  sums.max = max;
  for (const SplitRow& split : splits) {
    if (split.max == kNegInf) continue;
    const float w = weight(split.max - max);
    sum += w * split.sum;
    for (int64_t d = 0; d < dk; ++d) out[d] += w * split.acc[d];
    if (!stats) continue;
    // A split's sums are relative to its own max: rescaled to the merged one as the online softmax does.
    sums.entropy_sum += w * (split.stats[0] + split.sum * (split.max - max));
    sums.distance_sum += w * split.stats[1];
    sums.sink_sum += w * split.stats[2];
  }
  const float inverse = 1.0f / sum;
  for (int64_t d = 0; d < dk; ++d) out[d] *= inverse;
  sums.sum = sum;
  if (stats) WriteRowStats(seq.stats, stats_row, sums, log2_units ? M_LN2 : 1.0);
}

}  // namespace mha::cpu
