// One validated call on its way to a backend: what the scheduler queues and what a scheduling policy may look at
// (the plan, the request's size, when it arrived, its deadline, whether its client still waits), and the two ways
// it can end. Each WorkItem ends exactly once: Run, or Reject.
#ifndef MHA_SERVER_WORK_ITEM_H_
#define MHA_SERVER_WORK_ITEM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/validate.h"

namespace mha {

class WorkItem {
 public:
  WorkItem(int64_t request_bytes, absl::Time received, absl::Time deadline)
      : request_bytes_(request_bytes), received_(received), deadline_(deadline) {}
  virtual ~WorkItem() = default;
  WorkItem(const WorkItem&) = delete;
  WorkItem& operator=(const WorkItem&) = delete;

  // The validated plan: backend, problem (shape, dtypes, weights), FLOPs.
  virtual const AttentionPlan& plan() const = 0;
  int64_t request_bytes() const { return request_bytes_; }  // what the item holds while it waits
  absl::Time received() const { return received_; }          // when the call reached the handler
  absl::Time deadline() const { return deadline_; }          // the client's, or InfiniteFuture()

  // True once the client cancelled or its deadline passed. Thread-safe.
  virtual bool IsCancelled() const = 0;
  // Computes and finishes the call (response, log line, metrics) after `waited` in the queue (zero for an item run
  // inline). Runs on the thread that computes.
  virtual void Run(absl::Duration waited) = 0;
  // Finishes the call with `status` (not OK) without computing: refused, cancelled before it started, or shutdown.
  virtual void Reject(const absl::Status& status) = 0;

 private:
  const int64_t request_bytes_;
  const absl::Time received_;
  const absl::Time deadline_;
};

}  // namespace mha

#endif  // MHA_SERVER_WORK_ITEM_H_
