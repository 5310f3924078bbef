#include "server/scheduler.h"

#include <omp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mha {

Scheduler::Scheduler(const SchedulerOptions& options, ServerMetrics* metrics)
    : options_(options), metrics_(metrics), worker_([this] { Run(); }) {}

Scheduler::~Scheduler() {
  Shutdown();
  worker_.join();
}

bool Scheduler::RunsInline(const WorkItem& item) const {
  const double limit = std::min(options_.inline_max_flops, item.plan().backend->inline_max_flops());
  return limit > 0 && item.plan().flops <= limit;
}

void Scheduler::Submit(std::unique_ptr<WorkItem> item) {
  if (RunsInline(*item)) {
    item->Run(absl::ZeroDuration());
    return;
  }
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      refused = absl::UnavailableError("server is shutting down");
    } else if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "compute queue is full (", options_.max_queue, " requests waiting, --max_queue_size); retry later"));
    } else if (!queue_.empty() && queued_bytes_ + item->request_bytes() > options_.max_queued_bytes) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "compute queue is full (", queued_bytes_, " bytes of requests waiting, --max_queued_mb); retry later"));
    } else {
      queued_bytes_ += item->request_bytes();
      queue_.push_back({std::move(item), absl::Now()});
      SetDepth();
    }
  }
  if (!refused.ok()) item->Reject(refused);
}

void Scheduler::SetDepth() {
  if (metrics_ != nullptr) metrics_->SetQueueDepth(static_cast<int>(queue_.size()));
}

void Scheduler::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

int Scheduler::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

bool Scheduler::AwaitRunning(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&running_), timeout);
}

void Scheduler::Run() {
  // The OpenMP thread count is per calling thread: set it once here, where every queued computation runs.
  omp_set_num_threads(options_.compute_threads);
  for (;;) {
    std::unique_ptr<WorkItem> item;
    absl::Time queued_at;
    {
      absl::MutexLock lock(&mu_);
      running_ = false;
      mu_.Await(absl::Condition(
          +[](Scheduler* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->stopping_ || !s->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front().item);
      queued_at = queue_.front().queued_at;
      queue_.pop_front();
      queued_bytes_ -= item->request_bytes();
      SetDepth();
      running_ = true;
    }
    if (item->IsCancelled()) {
      item->Reject(absl::CancelledError("the call was cancelled or passed its deadline before compute started"));
    } else {
      item->Run(absl::Now() - queued_at);
    }
  }
}

}  // namespace mha
