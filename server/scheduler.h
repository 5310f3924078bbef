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
  Scheduler(int compute_threads, int max_queue);
  // Runs every job already accepted, then joins the worker.
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `job` to run on the compute thread. RESOURCE_EXHAUSTED when max_queue jobs are already waiting;
  // UNAVAILABLE after Shutdown(). Thread-safe.
  absl::Status Submit(std::function<void()> job);
  // Stops accepting work; jobs already queued still run. Thread-safe, idempotent.
  void Shutdown();
  int queued() const;

 private:
  void Run();

  const int compute_threads_;
  const int max_queue_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULER_H_
