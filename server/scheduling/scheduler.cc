#include "server/scheduling/scheduler.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace mha {
namespace {

// Calls at least this large teach the scheduler their backend's rate (smaller ones are dominated by overheads).
constexpr double kRateSampleFlops = 5e7;
// Weight of the newest observation in the rate's exponential average.
constexpr double kRateWeight = 0.2;

}  // namespace

Scheduler::Scheduler(const SchedulerOptions& options, ServerMetrics* metrics)
    : options_(options), metrics_(metrics) {
  threads_.emplace_back([this] { Run(true); });
  for (int i = 0; i < options_.concurrent_threads; ++i) threads_.emplace_back([this] { Run(false); });
}

Scheduler::~Scheduler() {
  Shutdown();
  for (std::thread& thread : threads_) thread.join();
}

bool Scheduler::OnComputeThread(const WorkItem& item) const {
  return options_.concurrent_threads == 0 || item.plan().backend->concurrent_calls() <= 1;
}

std::deque<Scheduler::Queued>::iterator Scheduler::NextFor(bool compute_thread) {
  // The eligible item of the owner served least so far, the earliest of its items (queue order breaks ties).
  auto next = queue_.end();
  double next_served = 0;
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const WorkItem& item = *it->item;
    if (OnComputeThread(item) != compute_thread) continue;
    if (!compute_thread) {  // a concurrent thread: only a backend with a free slot
      const Backend* backend = item.plan().backend;
      const auto running = std::count_if(running_.begin(), running_.end(),
                                         [backend](const Running& r) { return r.backend == backend; });
      if (running >= backend->concurrent_calls()) continue;
    }
    const auto found = served_.find(item.owner());
    const double served = found != served_.end() ? found->second : 0;
    if (next == queue_.end() || served < next_served) {
      next = it;
      next_served = served;
    }
  }
  return next;
}

void Scheduler::Activate(const WorkItem& item) {
  if (active_[item.owner()]++ > 0) return;
  double& served = served_[item.owner()];
  served = std::max(served, virtual_now_);
}

void Scheduler::Charge(const std::vector<std::pair<std::string, double>>& flops_of, double seconds) {
  double flops = 0;
  for (const auto& [owner, f] : flops_of) flops += f;
  for (const auto& [owner, f] : flops_of) {
    served_[owner] += seconds * (flops > 0 ? f / flops : 1.0 / static_cast<double>(flops_of.size()));
  }
}

bool Scheduler::RunsInline(const WorkItem& item) const {
  const double limit = std::min(options_.inline_max_flops, item.plan().backend->inline_max_flops());
  return limit > 0 && item.plan().flops <= limit;
}

double Scheduler::EstimateSeconds(const WorkItem& item, double flops) const {
  const auto rate = rates_.find(item.plan().backend);
  if (rate == rates_.end() || !std::isfinite(flops)) return 0;
  return flops / rate->second;
}

absl::Status Scheduler::Admit(const WorkItem& item) const {
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (static_cast<int>(queue_.size()) >= options_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "compute queue is full (", options_.max_queue, " requests waiting, --max_queue_size); retry later"));
  }
  if (!queue_.empty() && queued_bytes_ + item.request_bytes() > options_.max_queued_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "compute queue is full (", queued_bytes_, " bytes of requests waiting, --max_queued_mb); retry later"));
  }
  // A call alone past the limit still runs when nothing else holds memory.
  const int64_t held = ledger_->load(std::memory_order_relaxed);
  if ((inflight_ > 0 || held > 0) && held + item.memory_bytes() > options_.max_inflight_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server's in-flight memory is taken (", held, " bytes held by ", inflight_,
        " calls and responses not yet sent, this one needs ", item.memory_bytes(), "; --max_inflight_mb); retry "
        "later"));
  }
  const double compute_s = EstimateSeconds(item, item.plan().flops);
  if (compute_s > 0) {
    const absl::Time now = absl::Now();
    // Conservative with concurrent threads: as if everything ahead ran one after another.
    double wait_s = queued_seconds_;
    for (const Running& r : running_) wait_s += std::max(0.0, r.estimate_s - absl::ToDoubleSeconds(now - r.since));
    const double left_s = absl::ToDoubleSeconds(item.deadline() - now);
    if (wait_s + compute_s > left_s) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "refused at arrival: about %.3f s of compute (%.3g GFLOP at the %s backend's %.1f GFLOP/s) behind %.3f s "
          "of queued work would end past the deadline, %.3f s away",
          compute_s, item.plan().flops / 1e9, std::string(item.plan().backend->name()),
          rates_.at(item.plan().backend) / 1e9, wait_s, left_s));
    }
  }
  return absl::OkStatus();
}

void Scheduler::Submit(std::unique_ptr<WorkItem> item) {
  item->abort_ = &abort_;
  last_submit_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  if (RunsInline(*item)) {
    // The item reports its own status; inline calls teach no rate. A small call in steps takes them all here.
    do {
      item->Run(absl::ZeroDuration()).IgnoreError();
    } while (item->Unfinished());
    return;
  }
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    refused = Admit(*item);
    if (refused.ok()) {
      const double estimate = EstimateSeconds(*item, item->plan().flops);
      queued_bytes_ += item->request_bytes();
      item->hold_ = InflightHold(ledger_, item->memory_bytes());
      ++inflight_;
      queued_seconds_ += estimate;
      Activate(*item);
      queue_.push_back({std::move(item), absl::Now(), estimate});
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

void Scheduler::Abort() {
  abort_ = true;
  Shutdown();
}

bool Scheduler::AwaitRunning(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const auto running = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !running_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&running), timeout);
}

bool Scheduler::AwaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const auto idle = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return running_.empty() && queue_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

bool Scheduler::AwaitQueued(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const auto queued = [this, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return static_cast<int>(queue_.size()) >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&queued), timeout);
}

absl::Duration Scheduler::StuckFor() const {
  absl::MutexLock lock(&mu_);
  if (running_.empty() || queue_.empty()) return absl::ZeroDuration();
  absl::Time oldest = absl::InfiniteFuture();
  for (const Running& r : running_) oldest = std::min(oldest, r.since);
  return absl::Now() - oldest;
}

absl::Duration Scheduler::SinceLastSubmit() const {
  const int64_t last = last_submit_ns_.load(std::memory_order_relaxed);
  return last == 0 ? absl::InfiniteDuration() : absl::Nanoseconds(absl::GetCurrentTimeNanos() - last);
}

int Scheduler::QueueDepth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void Scheduler::ObserveRate(const Backend* backend, double flops, double seconds) {
  if (!(flops > 0 && seconds > 0)) return;
  absl::MutexLock lock(&mu_);
  const double rate = flops / seconds;
  auto [it, inserted] = rates_.emplace(backend, rate);
  if (!inserted) it->second = (1 - kRateWeight) * it->second + kRateWeight * rate;
}

double Scheduler::Rate(const Backend* backend) const {
  absl::MutexLock lock(&mu_);
  const auto rate = rates_.find(backend);
  return rate == rates_.end() ? 0 : rate->second;
}

void Scheduler::TakeBatchable(const WorkItem& first, int64_t* rows, std::vector<Queued>* batch) {
  const std::string& key = first.plan().batch_key;
  for (auto it = queue_.begin(); it != queue_.end() && *rows < options_.max_batch_rows;) {
    const AttentionPlan& plan = it->item->plan();
    if (plan.batch_key != key || *rows + it->item->NextRows() > options_.max_batch_rows) {
      ++it;
      continue;
    }
    *rows += it->item->NextRows();
    queued_bytes_ -= it->item->request_bytes();
    queued_seconds_ = std::max(0.0, queued_seconds_ - it->estimate_s);
    batch->push_back(std::move(*it));
    it = queue_.erase(it);
  }
}

void Scheduler::Compute(Queued first, std::vector<Queued> batch, std::list<Running>::iterator running) {
  std::vector<Queued> calls;
  calls.push_back(std::move(first));
  for (Queued& q : batch) calls.push_back(std::move(q));
  std::vector<std::string> owners;
  for (const Queued& q : calls) owners.push_back(q.item->owner());
  double seconds = 0;                                  // computing
  std::vector<std::pair<std::string, double>> flops_of;  // each computed item's owner and FLOPs
  // Calls whose clients gave up while they waited end here, uncomputed.
  std::vector<Queued> live;
  for (Queued& q : calls) {
    if (absl::Status stop = q.item->Check(); !stop.ok()) {
      q.item->Reject(stop.code() != absl::StatusCode::kCancelled ? stop
                     : q.stepped ? absl::CancelledError("the client cancelled the call between its compute steps")
                                 : absl::CancelledError("the client cancelled the call before compute started"));
    } else {
      live.push_back(std::move(q));
    }
  }
  if (!live.empty()) {
    const absl::Time start = absl::Now();
    absl::Status status;
    double flops = 0;
    for (const Queued& q : live) {
      flops += q.item->NextFlops();
      flops_of.emplace_back(q.item->owner(), std::isfinite(q.item->NextFlops()) ? q.item->NextFlops() : 0.0);
    }
    // Recorded before the calls finish, so that a client that sees its answer sees its batch counted.
    if (metrics_ != nullptr && std::isfinite(flops)) metrics_->RecordBatch(static_cast<int>(live.size()));
    if (live.size() == 1) {
      status = live[0].item->Run(start - live[0].queued_at);
    } else {
      std::vector<WorkItem*> others;
      std::vector<absl::Duration> waited = {start - live[0].queued_at};
      for (size_t i = 1; i < live.size(); ++i) {
        others.push_back(live[i].item.get());
        waited.push_back(start - live[i].queued_at);
      }
      status = live[0].item->RunBatch(others, waited);
    }
    seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (status.ok() && flops >= kRateSampleFlops && std::isfinite(flops)) {
      ObserveRate(live[0].item->plan().backend, flops, seconds);
    }
  }
  // The calls' holds go back as `calls` is destroyed, but for what their responses took along (TakeResponseHold).
  // A call with steps left waits again, behind what arrived meanwhile, still admitted.
  absl::MutexLock lock(&mu_);
  running_.erase(running);
  Charge(flops_of, seconds);
  for (const std::string& owner : owners) {
    if (--active_[owner] == 0) active_.erase(owner);
  }
  int requeued = 0;
  for (Queued& q : live) {
    if (!q.item->Unfinished()) continue;
    q.queued_at = absl::Now();
    q.stepped = true;
    q.estimate_s = EstimateSeconds(*q.item, q.item->NextFlops());  // the next step's, not the rest's
    queued_bytes_ += q.item->request_bytes();
    queued_seconds_ += q.estimate_s;
    ++active_[q.item->owner()];
    queue_.push_back(std::move(q));
    ++requeued;
  }
  inflight_ -= static_cast<int>(calls.size()) - requeued;
  if (requeued > 0) SetDepth();
}

void Scheduler::Run(bool compute_thread) {
  // The OpenMP thread count is per calling thread: set it once here, where the queued computations run.
  omp_set_num_threads(options_.compute_threads);
  for (;;) {
    Queued next;
    std::vector<Queued> batch;
    std::list<Running>::iterator running;
    {
      absl::MutexLock lock(&mu_);
      const auto ready = [this, compute_thread]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return (stopping_ && queue_.empty()) || NextFor(compute_thread) != queue_.end();
      };
      mu_.Await(absl::Condition(&ready));
      const auto it = NextFor(compute_thread);
      if (it == queue_.end()) return;  // stopping and drained
      virtual_now_ = std::max(virtual_now_, served_[it->item->owner()]);
      next = std::move(*it);
      queue_.erase(it);
      // Counted as running from here on, through the batching wait below, so that no other thread takes a call
      // of the same backend past its concurrent_calls() and AwaitIdle does not see a gap.
      running = running_.insert(running_.end(), Running{next.item->plan().backend, absl::Now(), next.estimate_s});
      queued_bytes_ -= next.item->request_bytes();
      queued_seconds_ = std::max(0.0, queued_seconds_ - next.estimate_s);
      if (options_.max_batch_rows > 0 && !next.item->plan().batch_key.empty()) {
        int64_t rows = next.item->NextRows();
        TakeBatchable(*next.item, &rows, &batch);
        // Optionally wait a little for more calls to join, as long as the batch has room.
        const absl::Time until = absl::Now() + options_.max_queue_delay;
        size_t seen = queue_.size();
        while (rows < options_.max_batch_rows && !stopping_ && absl::Now() < until) {
          const auto grew = [this, seen]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stopping_ || queue_.size() > seen; };
          if (!mu_.AwaitWithDeadline(absl::Condition(&grew), until)) break;
          TakeBatchable(*next.item, &rows, &batch);
          seen = queue_.size();
        }
      }
      running->since = absl::Now();
      for (const Queued& q : batch) running->estimate_s += q.estimate_s;
      SetDepth();
    }
    Compute(std::move(next), std::move(batch), running);
  }
}

}  // namespace mha
