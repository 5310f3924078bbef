// Where the scheduler computes queued calls: a backend that runs one call at a time (Backend::concurrent_calls()
// == 1, the CPU backends) computes on the compute thread alone; a backend whose calls overlap (the CUDA backend's
// lanes) gets up to concurrent_calls() of them at once on the concurrent threads; neither kind waits behind the
// other. A call that computes in steps goes back in the queue between them. The calls here are fakes that hold
// their thread until the test releases them, or log their steps.
#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/scheduling/scheduler.h"
#include "server/scheduling/work_item.h"

namespace mha {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(20);

// A backend that only says how many calls it overlaps; the items below never call it.
class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(int concurrent_calls, double inline_max_flops = 0)
      : concurrent_calls_(concurrent_calls), inline_max_flops_(inline_max_flops) {}
  absl::string_view name() const override { return "fake"; }
  std::string device() const override { return "none"; }
  absl::Status Supports(const AttentionProblem&) const override { return absl::OkStatus(); }
  int64_t WorkspaceBytes(const AttentionProblem&) const override { return 0; }
  int concurrent_calls() const override { return concurrent_calls_; }
  double inline_max_flops() const override { return inline_max_flops_; }
  absl::StatusOr<double> WarmUp() override { return 0.0; }
  absl::Status ScaledDotProductAttention(const SdpaArgs&) override { return absl::UnimplementedError("fake"); }
  absl::Status MultiHeadAttention(const MhaArgs&) override { return absl::UnimplementedError("fake"); }

 private:
  const int concurrent_calls_;
  const double inline_max_flops_;
};

// What the calls of one backend saw: how many computed at once, on which threads, how many ended.
class Probe {
 public:
  void Enter() {
    absl::MutexLock lock(&mu_);
    ++running_;
    most_ = std::max(most_, running_);
    threads_.insert(std::this_thread::get_id());
  }
  void Leave() {
    absl::MutexLock lock(&mu_);
    --running_;
    ++finished_;
  }
  // Blocks until `n` calls compute at once (true), or kPatience passes (false).
  bool AwaitRunning(int n, absl::Duration patience = kPatience) {
    absl::MutexLock lock(&mu_);
    const auto reached = [this, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return running_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), patience);
  }
  int running() const {
    absl::MutexLock lock(&mu_);
    return running_;
  }
  int most() const {
    absl::MutexLock lock(&mu_);
    return most_;
  }
  int finished() const {
    absl::MutexLock lock(&mu_);
    return finished_;
  }
  size_t threads() const {
    absl::MutexLock lock(&mu_);
    return threads_.size();
  }

  absl::Notification release;  // the calls compute until this is notified

 private:
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int most_ ABSL_GUARDED_BY(mu_) = 0;
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
};

// A queued call of `backend` that computes until its probe's release (or for `hold`, when set).
class FakeItem final : public WorkItem {
 public:
  FakeItem(Backend* backend, Probe* probe, absl::Duration hold = absl::InfiniteDuration())
      : WorkItem(0, absl::Now(), absl::InfiniteFuture()), probe_(probe), hold_(hold) {
    plan_.backend = backend;
    plan_.flops = 1e12;  // never inline
  }
  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return false; }
  absl::Status Run(absl::Duration) override {
    probe_->Enter();
    if (hold_ == absl::InfiniteDuration()) {
      probe_->release.WaitForNotificationWithTimeout(kPatience);
    } else {
      absl::SleepFor(hold_);
    }
    probe_->Leave();
    return absl::OkStatus();
  }
  void Reject(const absl::Status& status) override { ADD_FAILURE() << "rejected: " << status; }

 private:
  AttentionPlan plan_;
  Probe* const probe_;
  const absl::Duration hold_;
};

SchedulerOptions Options(int concurrent_threads) {
  SchedulerOptions options;
  options.concurrent_threads = concurrent_threads;
  return options;
}

TEST(Scheduler, ConcurrentBackendComputesUpToItsConcurrentCallsAtOnce) {
  FakeBackend gpu(2);
  Probe probe;
  Scheduler scheduler(Options(3), nullptr);  // more threads than the backend takes
  for (int i = 0; i < 3; ++i) scheduler.Submit(std::make_unique<FakeItem>(&gpu, &probe));
  ASSERT_TRUE(probe.AwaitRunning(2));
  ASSERT_TRUE(scheduler.AwaitQueued(1, kPatience));
  // The idle third thread must leave the third call queued: waited for, it does not start.
  EXPECT_FALSE(probe.AwaitRunning(3, absl::Milliseconds(100)));
  EXPECT_EQ(probe.running(), 2);
  EXPECT_EQ(scheduler.QueueDepth(), 1);
  probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  EXPECT_EQ(probe.most(), 2);
  EXPECT_EQ(probe.finished(), 3);
}

TEST(Scheduler, OneCallBackendComputesOneCallAtATimeOnOneThread) {
  FakeBackend cpu(1);
  Probe probe;
  Scheduler scheduler(Options(2), nullptr);
  for (int i = 0; i < 4; ++i) scheduler.Submit(std::make_unique<FakeItem>(&cpu, &probe, absl::Milliseconds(20)));
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  EXPECT_EQ(probe.finished(), 4);
  EXPECT_EQ(probe.most(), 1);
  EXPECT_EQ(probe.threads(), 1u);  // the compute thread, where the backend's thread pools live
}

TEST(Scheduler, OneCallBackendDoesNotWaitBehindAConcurrentBackendsCalls) {
  FakeBackend gpu(2), cpu(1);
  Probe gpu_probe, cpu_probe;
  Scheduler scheduler(Options(2), nullptr);
  for (int i = 0; i < 3; ++i) scheduler.Submit(std::make_unique<FakeItem>(&gpu, &gpu_probe));
  ASSERT_TRUE(gpu_probe.AwaitRunning(2));
  // Both concurrent threads are taken and a GPU call waits ahead of it in the queue: the CPU call still starts.
  scheduler.Submit(std::make_unique<FakeItem>(&cpu, &cpu_probe));
  EXPECT_TRUE(cpu_probe.AwaitRunning(1));
  EXPECT_EQ(scheduler.QueueDepth(), 1);
  cpu_probe.release.Notify();
  gpu_probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  EXPECT_EQ(gpu_probe.finished(), 3);
  EXPECT_EQ(cpu_probe.finished(), 1);
}

TEST(Scheduler, ConcurrentBackendDoesNotWaitBehindTheComputeThreadsCall) {
  FakeBackend gpu(2), cpu(1);
  Probe gpu_probe, cpu_probe;
  Scheduler scheduler(Options(2), nullptr);
  for (int i = 0; i < 2; ++i) scheduler.Submit(std::make_unique<FakeItem>(&cpu, &cpu_probe));
  ASSERT_TRUE(cpu_probe.AwaitRunning(1));
  scheduler.Submit(std::make_unique<FakeItem>(&gpu, &gpu_probe));
  EXPECT_TRUE(gpu_probe.AwaitRunning(1));
  gpu_probe.release.Notify();
  cpu_probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  EXPECT_EQ(cpu_probe.most(), 1);
  EXPECT_EQ(cpu_probe.finished(), 2);
}

TEST(Scheduler, WithoutConcurrentThreadsEveryCallRunsOnTheComputeThread) {
  FakeBackend gpu(2);
  Probe probe;
  Scheduler scheduler(Options(0), nullptr);
  for (int i = 0; i < 3; ++i) scheduler.Submit(std::make_unique<FakeItem>(&gpu, &probe, absl::Milliseconds(20)));
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  EXPECT_EQ(probe.finished(), 3);
  EXPECT_EQ(probe.most(), 1);
  EXPECT_EQ(probe.threads(), 1u);
}

TEST(Scheduler, ShutdownRunsWhatIsQueuedOnEveryThread) {
  FakeBackend gpu(2), cpu(1);
  Probe gpu_probe, cpu_probe;
  {
    Scheduler scheduler(Options(2), nullptr);
    for (int i = 0; i < 3; ++i) {
      scheduler.Submit(std::make_unique<FakeItem>(&gpu, &gpu_probe, absl::Milliseconds(10)));
      scheduler.Submit(std::make_unique<FakeItem>(&cpu, &cpu_probe, absl::Milliseconds(10)));
    }
    scheduler.Shutdown();
  }  // the destructor joins the threads once the queue is drained
  EXPECT_EQ(gpu_probe.finished(), 3);
  EXPECT_EQ(cpu_probe.finished(), 3);
}

// A call of `steps` steps that logs "name:step" for each, in the order computed. Given `rejected`, its client
// cancels it after its first step, and *rejected receives the status it was rejected with.
class SteppedItem final : public WorkItem {
 public:
  SteppedItem(Backend* backend, std::string name, int steps, std::vector<std::string>* log, absl::Mutex* mu,
              absl::Status* rejected = nullptr, std::string owner = "")
      : WorkItem(0, absl::Now(), absl::InfiniteFuture()), name_(std::move(name)), steps_(steps), log_(log), mu_(mu),
        rejected_(rejected), owner_(std::move(owner)) {
    plan_.backend = backend;
    plan_.flops = 1e12;
  }
  const AttentionPlan& plan() const override { return plan_; }
  const std::string& owner() const override { return owner_; }
  bool IsCancelled() const override {
    absl::MutexLock lock(mu_);
    return rejected_ != nullptr && done_ >= 1;
  }
  bool Unfinished() const override {
    absl::MutexLock lock(mu_);
    return done_ < steps_;
  }
  absl::Status Run(absl::Duration) override {
    absl::MutexLock lock(mu_);
    log_->push_back(absl::StrCat(name_, ":", ++done_));
    return absl::OkStatus();
  }
  void Reject(const absl::Status& status) override {
    absl::MutexLock lock(mu_);
    if (rejected_ == nullptr) ADD_FAILURE() << "rejected: " << status;
    if (rejected_ != nullptr) *rejected_ = status;
  }

 private:
  AttentionPlan plan_;
  const std::string name_;
  const int steps_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string>* const log_;
  absl::Mutex* const mu_;
  absl::Status* const rejected_;
  const std::string owner_;
};

TEST(Scheduler, ASmallCallInStepsTakesThemAllInline) {
  FakeBackend cpu(1, /*inline_max_flops=*/1e13);
  absl::Mutex mu;
  std::vector<std::string> log;
  SchedulerOptions options = Options(0);
  options.inline_max_flops = 1e13;
  Scheduler scheduler(options, nullptr);
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "small", 3, &log, &mu));
  absl::MutexLock lock(&mu);  // Submit returned: the steps ran on this thread
  EXPECT_EQ(log, (std::vector<std::string>{"small:1", "small:2", "small:3"}));
}

TEST(Scheduler, ACallInStepsLetsTheCallsQueuedMeanwhileRunBetweenItsSteps) {
  FakeBackend cpu(1);
  Probe probe;
  absl::Mutex mu;
  std::vector<std::string> log;
  Scheduler scheduler(Options(0), nullptr);
  scheduler.Submit(std::make_unique<FakeItem>(&cpu, &probe));
  ASSERT_TRUE(probe.AwaitRunning(1));
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "prefill", 3, &log, &mu));
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "decode", 1, &log, &mu));
  probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(log, (std::vector<std::string>{"prefill:1", "decode:1", "prefill:2", "prefill:3"}));
}

// Owners take turns by the compute each has had: one owner's queue of calls delays another's call by the one
// computation under way, not by all of them (#54: a victim's decode step behind an attacker's prefills).
TEST(Scheduler, AnOwnersCallsWaitBehindOneComputationOfAnotherOwnersNotAllOfThem) {
  FakeBackend cpu(1);
  Probe probe;
  absl::Mutex mu;
  std::vector<std::string> log;
  Scheduler scheduler(Options(0), nullptr);
  scheduler.Submit(std::make_unique<FakeItem>(&cpu, &probe));
  ASSERT_TRUE(probe.AwaitRunning(1));
  for (const char* name : {"a1", "a2", "a3"}) {
    scheduler.Submit(std::make_unique<SteppedItem>(&cpu, name, 1, &log, &mu, nullptr, "alice"));
  }
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "prefill", 3, &log, &mu, nullptr, "alice"));
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "b1", 1, &log, &mu, nullptr, "bob"));
  probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(log, (std::vector<std::string>{"a1:1", "b1:1", "a2:1", "a3:1", "prefill:1", "prefill:2", "prefill:3"}));
}

TEST(Scheduler, WithOneOwnerCallsRunInArrivalOrder) {
  FakeBackend cpu(1);
  Probe probe;
  absl::Mutex mu;
  std::vector<std::string> log;
  Scheduler scheduler(Options(0), nullptr);
  scheduler.Submit(std::make_unique<FakeItem>(&cpu, &probe));
  ASSERT_TRUE(probe.AwaitRunning(1));
  for (const char* name : {"c1", "c2", "c3", "c4"}) {
    scheduler.Submit(std::make_unique<SteppedItem>(&cpu, name, 1, &log, &mu, nullptr, "carol"));
  }
  probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(log, (std::vector<std::string>{"c1:1", "c2:1", "c3:1", "c4:1"}));
}

// A call cancelled between its steps says so (not "before compute started").
TEST(Scheduler, ACallCancelledBetweenItsStepsSaysSo) {
  FakeBackend cpu(1);
  Probe probe;
  absl::Mutex mu;
  std::vector<std::string> log;
  absl::Status rejected;
  Scheduler scheduler(Options(0), nullptr);
  scheduler.Submit(std::make_unique<FakeItem>(&cpu, &probe));
  ASSERT_TRUE(probe.AwaitRunning(1));
  scheduler.Submit(std::make_unique<SteppedItem>(&cpu, "prefill", 3, &log, &mu, &rejected));
  probe.release.Notify();
  ASSERT_TRUE(scheduler.AwaitIdle(kPatience));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(log, (std::vector<std::string>{"prefill:1"}));
  EXPECT_EQ(rejected.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(rejected.message(), "the client cancelled the call between its compute steps");
}

}  // namespace
}  // namespace mha
