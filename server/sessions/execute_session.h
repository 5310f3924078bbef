// The compute step of an Extend whose blocks are reserved: the plan's backend appends each item's new tokens to its
// cache and attends (Backend::PagedAttention), writing each result's output and weights into the response. A call
// may compute in steps of bounded rows (chunked prefill), and steps of several calls that share a batch key may
// compute as one backend call (continuous batching).
#ifndef MHA_SERVER_SESSIONS_EXECUTE_SESSION_H_
#define MHA_SERVER_SESSIONS_EXECUTE_SESSION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/calls/head_stats.h"
#include "server/sessions/extend_plan.h"
#include "server/sessions/session_store.h"

namespace mha {

// One Extend's work, in steps. The first step takes the items' new tokens in order up to `max_step_rows` rows and
// the attention work (query-key pairs) of that many tokens on an empty cache (an item's tokens split where the
// budget ends), the next step goes on from there, and so on; a step's part of an item appends its tokens beyond the
// ones before it, so the steps together compute what one call would. While relaxed, steps are bounded in rows only
// (for a call that has the backend to itself: small steps deep into a long context cost more in all). A call
// that returns weights or statistics, has an item that does not append, or gets max_step_rows <= 0 computes in one
// step. Borrows `plan`, `reservation` (Reserve's for plan.reserve) and `response`, which outlive it; not
// thread-safe.
class ExtendSteps {
 public:
  // Sets response->backend. The results (one per item: the cache's length after the call, output and weights
  // allocated) and the statistics' buffers come with the first TakeNext: a call holds their bytes only once the
  // scheduler admitted it against --max_inflight_mb (they are in its plan's response_bytes).
  ExtendSteps(const ExtendPlan& plan, const ExtendReservation& reservation, int64_t max_step_rows,
              v1::ExtendResponse* response);
  ExtendSteps(const ExtendSteps&) = delete;
  ExtendSteps& operator=(const ExtendSteps&) = delete;

  bool done() const { return next_item_ == whole_.size(); }
  int64_t steps() const { return steps_; }  // taken so far
  // Whether the next steps are bounded in rows alone.
  void set_relaxed(bool relaxed) { relaxed_ = relaxed; }
  // The next step's rows (new tokens) and FLOPs; 0 once done.
  int64_t NextRows() const;
  double NextFlops() const;
  // Appends the next step's sequences (views into the request, the reservation and the response) to *sequences
  // and counts them as computed. Requires !done().
  void TakeNext(std::vector<PagedSequence>* sequences);
  // Once every step computed: writes the statistics asked for into the results.
  void FillStats();

 private:
  // Visits the items' parts of the next step: visit(item index, first new token, tokens).
  template <typename Visit>
  void ForNext(Visit visit) const;
  void AllocateOutputs();

  const ExtendPlan& plan_;
  v1::ExtendResponse* const response_;
  const int64_t max_step_rows_;  // <= 0: no limit
  bool relaxed_ = false;
  std::vector<PagedSequence> whole_;  // each item's whole call
  std::vector<StatsBuffers> stats_;
  size_t next_item_ = 0;    // the first item with tokens left
  int64_t next_token_ = 0;  // its first token left
  int64_t steps_ = 0;
  bool allocated_ = false;
};

// Computes `sequences` (steps of Extend calls whose plans share `plan`'s batch key: backend, heads, cache layout,
// layer, dtypes and what is returned) as one backend call. `stop` may be null.
absl::Status ComputeExtendStep(const ExtendPlan& plan, absl::Span<const PagedSequence> sequences,
                               const StopSignal* stop);

// Computes a whole Extend in one backend call: ExtendSteps without a row limit, its one step, and the statistics.
absl::Status ExecuteExtend(const ExtendPlan& plan, const ExtendReservation& reservation, const StopSignal* stop,
                           v1::ExtendResponse* response);

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_EXECUTE_SESSION_H_
