// Decides where and when each validated call computes. Policies, in order:
//  - inline: a call the backend runs single-threaded in tens of microseconds (Backend::inline_max_flops, capped by
//    SchedulerOptions::inline_max_flops) runs on the gRPC thread that received it, where the hand-off would cost
//    as much as the work;
//  - admission: a call that cannot meet its deadline (the compute queued ahead of it plus its own, at the rate its
//    backend has shown) is refused at arrival with DEADLINE_EXCEEDED and the estimate; one whose memory (request,
//    response, working memory) would take the admitted calls past max_inflight_bytes is RESOURCE_EXHAUSTED;
//  - batching: when the compute thread takes a call, it takes along the waiting calls with the same batch key
//    (AttentionPlan::batch_key) up to max_batch_rows rows (B Tq), optionally waiting max_queue_delay for more, and
//    computes them as one backend call (Triton's dynamic batcher): small calls fill the cores together. Extend
//    calls of sessions that share a layer (or head configuration) and cache dtype batch the same way, so that
//    decode steps from many clients run as one ragged paged call (continuous batching);
//  - steps: a call that computes in steps (a prefill in chunks, WorkItem::Unfinished) goes back in the queue after
//    each, behind what waits, so that decode steps run (or join its batch) between its chunks;
//  - shares: the waiting items of several owners (tokens, WorkItem::owner) take turns by the compute time each
//    owner has had (start-time fair queueing: an owner whose work arrives after an idle spell starts level with
//    the owners being served, never ahead by its idle time), in arrival order within an owner; so that one owner's
//    queued prefills and large calls delay another's decode step by the one computation under way, not by all of
//    them. With one owner this is the arrival order;
//  - queue: everything else waits in a bounded FIFO for one dedicated compute thread, so that gRPC's threads stay
//    responsive (health checks answer while a long request computes) and concurrent calls do not each start
//    OpenMP teams on the same cores. A full queue refuses new work instead of buffering requests without limit;
//    an item whose client gave up while it waited is rejected when its turn comes, not computed; a running one
//    stops at its next check (WorkItem is its StopSignal);
//  - side by side: a backend whose calls overlap usefully (Backend::concurrent_calls() > 1: a GPU's streams, where
//    one call's copies run during another's kernels) has its calls taken from the same queue by the concurrent
//    threads, up to that many at once; they never wait behind the compute thread's call, nor it behind them.
#ifndef MHA_SERVER_SCHEDULING_SCHEDULER_H_
#define MHA_SERVER_SCHEDULING_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"
#include "server/scheduling/work_item.h"

namespace mha {

struct SchedulerOptions {
  int compute_threads = 1;          // OpenMP threads of the compute thread's computations
  // Threads for the backends whose calls run side by side (Backend::concurrent_calls() > 1), each backend up to
  // its count at once; 0: those calls, too, run one at a time on the compute thread.
  int concurrent_threads = 0;
  int max_queue = 64;               // items waiting (not running) at most
  int64_t max_queued_bytes = 0;     // request bytes the waiting items may hold together
  int64_t max_inflight_bytes = 0;   // memory_bytes the admitted (waiting and running) items may hold together
  double inline_max_flops = 0;      // the inline policy's limit; 0 = never inline
  int64_t max_batch_rows = 0;       // rows (B Tq) one batch of calls may hold; 0 = no batching
  absl::Duration max_queue_delay;   // how long a batch waits for more calls; zero: takes only what waits already
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
  // DEADLINE_EXCEEDED (admission), RESOURCE_EXHAUSTED (max_queue items waiting, their bytes past max_queued_bytes,
  // or in-flight memory past max_inflight_bytes; an item alone past a limit still runs when nothing else holds
  // any) or UNAVAILABLE (after Shutdown). Thread-safe.
  void Submit(std::unique_ptr<WorkItem> item);
  // Stops accepting work; items already queued still run (or are rejected, once their calls are cancelled).
  // Thread-safe, idempotent.
  void Shutdown();
  // Stops the running computation at its next check and rejects everything still queued with UNAVAILABLE: the end
  // of a shutdown's grace period. Thread-safe.
  void Abort();
  // Blocks until an item is computing or gathering its batch (on any of the scheduler's threads), or `timeout`
  // passes; true if one is.
  // For tests that must know a long call has started.
  bool AwaitRunning(absl::Duration timeout) const;
  // Blocks until nothing waits or computes, or `timeout` passes; true if idle.
  bool AwaitIdle(absl::Duration timeout) const;
  // Blocks until `n` items wait in the queue, or `timeout` passes; true if they do. For tests.
  bool AwaitQueued(int n, absl::Duration timeout) const;
  // How long the longest-running item has computed while others waited; zero when nothing waits.
  absl::Duration StuckFor() const;
  // Items waiting in the queue now. Thread-safe.
  int QueueDepth() const;
  // How long ago the last item was submitted (a call in steps going back in the queue does not count); infinite
  // before the first. Thread-safe.
  absl::Duration SinceLastSubmit() const;
  // Learns that `backend` did `flops` in `seconds` (the compute thread does this after every call of 50 MFLOP or
  // more; warm-up seeds it).
  void ObserveRate(const Backend* backend, double flops, double seconds);
  // What ObserveRate has learned of `backend`, FLOP/s; 0 before anything. Thread-safe.
  double Rate(const Backend* backend) const;

 private:
  bool RunsInline(const WorkItem& item) const;
  // Seconds `flops` of `item` should compute for at its backend's rate; 0 when the rate is unknown.
  double EstimateSeconds(const WorkItem& item, double flops) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK, or why `item` cannot be queued now.
  absl::Status Admit(const WorkItem& item) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `item` as its owner's work waiting or running; an owner idle until now starts level (shares).
  void Activate(const WorkItem& item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges `seconds` of compute to the owners in `flops_of` (owner, FLOPs of its item in the computation), in
  // proportion to their FLOPs (equally without any).
  void Charge(const std::vector<std::pair<std::string, double>>& flops_of, double seconds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes the queue's length; under mu_, so that the gauge follows the queue's order of events.
  void SetDepth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Queued;
  // Whether `item` computes on the compute thread (its backend runs one call at a time) rather than on a
  // concurrent thread.
  bool OnComputeThread(const WorkItem& item) const;
  // The first waiting item the compute thread (or a concurrent thread) may take now: for a concurrent thread, one
  // whose backend has fewer computations in running_ than its concurrent_calls(). queue_.end() if none.
  std::deque<Queued>::iterator NextFor(bool compute_thread) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the waiting items that can join `first`'s batch into *batch (in queue order) while the batch's rows
  // (B Tq of each call) stay within max_batch_rows; *rows counts them.
  void TakeBatchable(const WorkItem& first, int64_t* rows, std::vector<Queued>* batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Running {
    const Backend* backend;
    absl::Time since;
    double estimate_s;  // the sum of the computation's items' EstimateSeconds
  };
  // Computes `first` and `batch` (may be empty), records what the scheduler learns from it, and ends `running`.
  void Compute(Queued first, std::vector<Queued> batch, std::list<Running>::iterator running);
  // The loop of the compute thread (compute_thread) or of a concurrent thread.
  void Run(bool compute_thread);

  const SchedulerOptions options_;
  ServerMetrics* const metrics_;
  std::atomic<bool> abort_{false};
  std::atomic<int64_t> last_submit_ns_{0};  // absl::GetCurrentTimeNanos() at the last Submit; 0 before any
  mutable absl::Mutex mu_;
  struct Queued {
    std::unique_ptr<WorkItem> item;
    absl::Time queued_at;
    double estimate_s;  // EstimateSeconds when queued
    bool stepped = false;  // back in the queue after a step of its compute
  };
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Admitted calls' memory and their unsent responses' (InflightHold); read under mu_ at admission, added to there,
  // given back from any thread.
  const std::shared_ptr<InflightLedger> ledger_ = std::make_shared<InflightLedger>(0);
  int inflight_ ABSL_GUARDED_BY(mu_) = 0;       // queued + running
  double queued_seconds_ ABSL_GUARDED_BY(mu_) = 0;  // sum of the queued items' estimates
  std::list<Running> running_ ABSL_GUARDED_BY(mu_);  // the computations under way
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<const Backend*, double> rates_ ABSL_GUARDED_BY(mu_);  // FLOP/s
  // Shares: the compute seconds each owner has been charged (its virtual time), the items each has waiting or
  // running, and the virtual time of the item last started (where an owner becoming active starts).
  std::map<std::string, double> served_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> active_ ABSL_GUARDED_BY(mu_);
  double virtual_now_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;  // the compute thread first, then the concurrent threads
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULING_SCHEDULER_H_
