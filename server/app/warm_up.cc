#include "server/app/warm_up.h"

#include <limits>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "server/scheduling/work_item.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

class WarmUpItem final : public WorkItem {
 public:
  WarmUpItem(Backend* backend, Scheduler* scheduler, absl::Notification* done)
      : WorkItem(0, absl::Now(), absl::InfiniteFuture()), scheduler_(scheduler), done_(done) {
    plan_.backend = backend;
    plan_.flops = std::numeric_limits<double>::infinity();  // never inline
    plan_.shapes = "warm-up";
  }
  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return false; }
  // Warms the backend up, then times the same computation again to seed the scheduler's rate for it.
  absl::Status Run(absl::Duration) override {
    const std::string name(plan_.backend->name());  // fmt cannot print abseil's own string_view
    const absl::Time start = absl::Now();
    absl::StatusOr<double> flops = plan_.backend->WarmUp();
    const absl::Time warm = absl::Now();
    if (flops.ok()) flops = plan_.backend->WarmUp();
    if (flops.ok()) {
      const double seconds = absl::ToDoubleSeconds(absl::Now() - warm);
      scheduler_->ObserveRate(plan_.backend, *flops, seconds);
      spdlog::info("{} backend warmed up in {} ms; {:.1f} GFLOP/s on a {:.3g} GFLOP call", name,
                   absl::ToInt64Milliseconds(warm - start), *flops / seconds / 1e9, *flops / 1e9);
    } else {
      spdlog::warn("{} backend warm-up failed: {}", name, flops.status().ToString());
    }
    done_->Notify();
    return flops.status();
  }
  void Reject(const absl::Status&) override { done_->Notify(); }

 private:
  AttentionPlan plan_;
  Scheduler* const scheduler_;
  absl::Notification* const done_;
};

}  // namespace

void WarmUpBackends(const BackendRegistry& backends, Scheduler* scheduler) {
  for (const BackendEntry& entry : backends.entries()) {
    if (!entry.available()) continue;
    absl::Notification done;
    scheduler->Submit(std::make_unique<WarmUpItem>(entry.backend.get(), scheduler, &done));
    done.WaitForNotification();
  }
  scheduler->AwaitIdle(absl::InfiniteDuration());
}

}  // namespace mha
