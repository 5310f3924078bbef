// Runs compute jobs one at a time on a dedicated thread, so that gRPC's threads stay responsive (health checks
// answer while a long request computes) and concurrent calls do not each start OpenMP regions on the same cores.
// The queue is bounded: a full queue refuses new work instead of buffering requests without limit.
#ifndef MHA_SERVER_SCHEDULER_H_
#define MHA_SERVER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace mha {

class Scheduler {
 public:
  // compute_threads: OpenMP threads the worker uses for each job. max_queue: jobs waiting (not running) at most.
  // max_queued_bytes: the request bytes those waiting jobs may hold together (each job declares its own).
  Scheduler(int compute_threads, int max_queue, int64_t max_queued_bytes);
  // Runs every job already accepted, then joins the worker.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `job`, which holds `bytes` of request data until it runs, for the compute thread. RESOURCE_EXHAUSTED
  // when max_queue jobs are already waiting or their bytes would pass max_queued_bytes (a job alone larger than
  // that still runs when nothing waits); UNAVAILABLE after Shutdown(). Thread-safe.
  absl::Status Submit(std::function<void()> job, int64_t bytes = 0);
  // Stops accepting work; jobs already queued still run. Thread-safe, idempotent.
  void Shutdown();
  int queued() const;

 private:
  void Run();

  const int compute_threads_;
  const int max_queue_;
  const int64_t max_queued_bytes_;
  mutable absl::Mutex mu_;
  struct Job {
    std::function<void()> run;
    int64_t bytes;
  };
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULER_H_
