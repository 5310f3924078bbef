// The softmax statistics of a call between its backend and its response: room for the per-row values the backend
// writes (backend.h's RowStats), then the response's lse tensor and HeadStats (attention.proto) made from them.
#ifndef MHA_SERVER_CALLS_HEAD_STATS_H_
#define MHA_SERVER_CALLS_HEAD_STATS_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"
#include "server/calls/plan.h"

namespace mha {

// [items, heads, rows] values of each statistic asked for. Not thread-safe; the backend writes through View().
class StatsBuffers {
 public:
  // Nothing unless request.any(). Contribution only where `has_w_o` (a layer). The head statistics need lse (the
  // rows that see no key), so it is computed with them even when not returned.
  StatsBuffers(const StatsRequest& request, int64_t items, int64_t heads, int64_t rows, bool has_w_o);

  RowStats View();

  // The response's part: lse [items, heads, rows] (or [heads, rows] when !batched) when asked for, head_stats
  // (items x heads means over the rows that see a key) and row_stats (every row; 0 for rows that see none) when
  // asked for. visible_keys(item, row) is how many keys the row sees (for normalized_entropy).
  void Fill(absl::FunctionRef<int64_t(int64_t, int64_t)> visible_keys, bool batched, v1::Tensor* lse,
            v1::HeadStats* head_stats, v1::HeadStats* row_stats) const;
  // Fill into a response message (or ExtendResult) with fields lse, head_stats and row_stats, leaving unset the
  // ones not asked for.
  template <typename Message>
  void FillInto(absl::FunctionRef<int64_t(int64_t, int64_t)> visible_keys, bool batched, Message* m) const {
    if (!request_.any()) return;
    Fill(visible_keys, batched, request_.lse ? m->mutable_lse() : nullptr,
         request_.head_stats ? m->mutable_head_stats() : nullptr, request_.row_stats ? m->mutable_row_stats() : nullptr);
  }

 private:
  StatsRequest request_;
  int64_t items_, heads_, rows_;
  std::vector<float> lse_, entropy_, confidence_, distance_, sink_, contribution_;
};

}  // namespace mha

#endif  // MHA_SERVER_CALLS_HEAD_STATS_H_
