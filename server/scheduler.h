// Decides where and when each validated call computes. Policies, in order:
//  - inline: a call the backend runs single-threaded in tens of microseconds (Backend::inline_max_flops, capped by
//    SchedulerOptions::inline_max_flops) runs on the gRPC thread that received it, where the hand-off would cost
//    as much as the work;
//  - queue: everything else waits in a bounded FIFO for one dedicated compute thread, so that gRPC's threads stay
//    responsive (health checks answer while a long request computes) and concurrent calls do not each start
//    OpenMP teams on the same cores. A full queue refuses new work instead of buffering requests without limit;
//    an item whose client gave up while it waited is rejected when its turn comes, not computed.
#ifndef MHA_SERVER_SCHEDULER_H_
#define MHA_SERVER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics.h"
#include "server/work_item.h"

namespace mha {

struct SchedulerOptions {
  int compute_threads = 1;        // OpenMP threads of the compute thread's computations
  int max_queue = 64;             // items waiting (not running) at most
  int64_t max_queued_bytes = 0;   // request bytes the waiting items may hold together
  double inline_max_flops = 0;    // the inline policy's limit; 0 = never inline
};

class Scheduler {
 public:
  // `metrics` (may be null) receives the queue depth; borrowed.
  Scheduler(const SchedulerOptions& options, ServerMetrics* metrics);
  // Runs every item already accepted, then joins the compute thread.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Takes `item` and sees that it ends: runs it now on the calling thread (inline), queues it, or rejects it with
  // RESOURCE_EXHAUSTED (max_queue items waiting, or their bytes would pass max_queued_bytes; an item alone larger
  // than that still queues when nothing waits) or UNAVAILABLE (after Shutdown). Thread-safe.
  void Submit(std::unique_ptr<WorkItem> item);
  // Stops accepting work; items already queued still run. Thread-safe, idempotent.
  void Shutdown();
  int queued() const;
  // Blocks until an item is computing on the compute thread, or `timeout` passes; true if one is. For tests that
  // must know a long call has started.
  bool AwaitRunning(absl::Duration timeout) const;

 private:
  bool RunsInline(const WorkItem& item) const;
  // Publishes the queue's length; under mu_, so that the gauge follows the queue's order of events.
  void SetDepth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();

  const SchedulerOptions options_;
  ServerMetrics* const metrics_;
  mutable absl::Mutex mu_;
  struct Queued {
    std::unique_ptr<WorkItem> item;
    absl::Time queued_at;
  };
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULER_H_
