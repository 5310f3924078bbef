#include "server/scheduler.h"

#include <omp.h>

#include "absl/strings/str_cat.h"

namespace mha {

Scheduler::Scheduler(int compute_threads, int max_queue, int64_t max_queued_bytes)
    : compute_threads_(compute_threads),
      max_queue_(max_queue),
      max_queued_bytes_(max_queued_bytes),
      worker_([this] { Run(); }) {}

Scheduler::~Scheduler() {
  Shutdown();
  worker_.join();
}

absl::Status Scheduler::Submit(std::function<void()> job, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (static_cast<int>(queue_.size()) >= max_queue_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("compute queue is full (", max_queue_, " requests waiting, --max_queue_size); retry later"));
  }
  if (!queue_.empty() && queued_bytes_ + bytes > max_queued_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("compute queue is full (", queued_bytes_,
                                                     " bytes of requests waiting, --max_queued_mb); retry later"));
  }
  queued_bytes_ += bytes;
  queue_.push_back(Job{std::move(job), bytes});
  return absl::OkStatus();
}

void Scheduler::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

int Scheduler::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void Scheduler::Run() {
  // The OpenMP thread count is per calling thread: set it once here, where every computation runs.
  omp_set_num_threads(compute_threads_);
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Scheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->stopping_ || !s->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front().run);
      queued_bytes_ -= queue_.front().bytes;
      queue_.pop_front();
    }
    job();
  }
}

}  // namespace mha
