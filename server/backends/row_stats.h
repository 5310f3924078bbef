// Turning the softmax's per-row sums into RowStats' values (backend.h), for every backend: one rule for what a
// row's statistics are, and for a row that sees no key.
#ifndef MHA_SERVER_BACKENDS_ROW_STATS_H_
#define MHA_SERVER_BACKENDS_ROW_STATS_H_

#include <cstdint>

#include "server/backends/backend.h"

namespace mha {

// A row's softmax state in the scores' units (`unit` = ln 2 for scores in log2 units, 1 for natural ones): the max
// m of its visible scores, sum = sum_j w_j with w_j = exp(s_j - m) (2^ in log2 units), and the accumulators
// entropy_sum = sum_j w_j (s_j - m), distance_sum = sum_j w_j |pos - j|, sink_sum = the w_j of the sink keys.
struct RowSums {
  double max = 0, sum = 0, entropy_sum = 0, distance_sum = 0, sink_sum = 0;
};

// Writes element `row` of each requested array of `stats` but contribution: lse = m unit + ln(sum), entropy =
// ln(sum) - unit entropy_sum / sum, confidence = 1 / sum, distance and sink divided by sum; a row with sum 0 (no
// visible key) gets lse -inf and zeros, one with a NaN sum NaN everywhere.
void WriteRowStats(const RowStats& stats, int64_t row, const RowSums& sums, double unit);

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_ROW_STATS_H_
