#include "server/backends/row_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mha {

void WriteRowStats(const RowStats& stats, int64_t row, const RowSums& s, double unit) {
  const auto put = [row](float* array, double value) {
    if (array != nullptr) array[row] = static_cast<float>(value);
  };
  if (std::isnan(s.sum)) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (float* array : {stats.lse, stats.entropy, stats.confidence, stats.distance, stats.sink}) put(array, nan);
    return;
  }
  if (s.sum <= 0) {
    put(stats.lse, -std::numeric_limits<double>::infinity());
    for (float* array : {stats.entropy, stats.confidence, stats.distance, stats.sink}) put(array, 0.0);
    return;
  }
  const double log_sum = std::log(s.sum);
  put(stats.lse, s.max * unit + log_sum);
  // Rounding can leave a one-key row's entropy a hair below zero.
  put(stats.entropy, std::max(0.0, log_sum - unit * s.entropy_sum / s.sum));
  put(stats.confidence, 1.0 / s.sum);
  put(stats.distance, s.distance_sum / s.sum);
  put(stats.sink, s.sink_sum / s.sum);
}

}  // namespace mha
