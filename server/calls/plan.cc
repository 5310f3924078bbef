#include "server/calls/plan.h"

namespace mha {

double StatsRequest::ResponseBytes(int64_t heads, int64_t rows) const {
  const double values = static_cast<double>(heads) * static_cast<double>(rows);
  // lse as a tensor; six repeated floats of HeadStats per head, and per row with row_stats (5 bytes each at most).
  return (lse ? 4 * values + 64 : 0) + (head_stats ? 6 * 5 * heads + 64 : 0) + (row_stats ? 6 * 5 * values : 0);
}

int64_t StatsRequest::WorkspaceBytes(int64_t heads, int64_t rows) const {
  // lse (kept for the head statistics too), then six statistics and normalized entropy's row values.
  const int64_t arrays = (any() ? 1 : 0) + (head_stats ? 7 : 0);
  return arrays * heads * rows * static_cast<int64_t>(sizeof(float));
}

}  // namespace mha
