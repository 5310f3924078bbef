// One validated call on its way to a backend: what the scheduler queues and what a scheduling policy may look at
// (the plan, the memory it holds, when it arrived, its deadline, whether its client still waits), the signal that
// stops its computation, and the two ways it can end. Each WorkItem ends exactly once: Run, or Reject.
#ifndef MHA_SERVER_SCHEDULING_WORK_ITEM_H_
#define MHA_SERVER_SCHEDULING_WORK_ITEM_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/calls/plan.h"
#include "server/scheduling/inflight_hold.h"

namespace mha {

class WorkItem : public StopSignal {
 public:
  // `deadline` is the client's, or the server's default for a client that set none.
  WorkItem(int64_t request_bytes, absl::Time received, absl::Time deadline)
      : request_bytes_(request_bytes), received_(received), deadline_(deadline) {}
  WorkItem(const WorkItem&) = delete;
  WorkItem& operator=(const WorkItem&) = delete;

  // The validated plan: backend, problem (shape, dtypes, weights), FLOPs, response and working-memory bytes.
  virtual const AttentionPlan& plan() const = 0;
  int64_t request_bytes() const { return request_bytes_; }  // what the item holds while it waits
  // What the item holds while it runs: its request, its response and its backend's working memory.
  int64_t memory_bytes() const { return request_bytes_ + plan().response_bytes + plan().workspace_bytes; }
  absl::Time received() const { return received_; }  // when the call reached the handler
  absl::Time deadline() const { return deadline_; }
  // Whose call it is (a token's identity; empty without tokens, or for the server's own work): the unit the
  // scheduler shares its compute thread between.
  virtual const std::string& owner() const;

  // True once the client cancelled (or gRPC cancelled the call). Thread-safe.
  virtual bool IsCancelled() const = 0;
  // StopSignal: CANCELLED once the client cancelled, DEADLINE_EXCEEDED past the deadline, UNAVAILABLE once the
  // scheduler aborts its work (shutdown). Thread-safe.
  absl::Status Check() const final;

  // Computes and finishes the call (response, log line, metrics) after `waited` in the queue (zero for an item run
  // inline); returns the status the call ended with. Runs on the thread that computes.
  virtual absl::Status Run(absl::Duration waited) = 0;
  // Computes this item and `others` (all with this item's non-empty plan().batch_key, and of its type) as one
  // backend call and finishes every one of them; waited[0] is this item's wait, waited[i + 1] that of others[i].
  // Returns the backend call's status. Items whose plans have a batch key implement it.
  virtual absl::Status RunBatch(absl::Span<WorkItem* const> others, absl::Span<const absl::Duration> waited) {
    return absl::UnimplementedError("this work item is not batched");
  }
  // Finishes the call with `status` (not OK) without computing: refused, cancelled before it started, or shutdown.
  virtual void Reject(const absl::Status& status) = 0;

  // A call may compute in steps (an Extend's prefill in chunks of bounded rows): Run or RunBatch then computes the
  // next step and, while Unfinished() says so afterwards, has not finished the call; the scheduler queues it again,
  // behind what waits (so that other calls run between its steps), keeping its admission.
  virtual bool Unfinished() const { return false; }
  // The rows (B Tq) and FLOPs of the item's next computation: what it adds to a batch (max_batch_rows) and what
  // teaches the scheduler its backend's rate.
  virtual int64_t NextRows() const { return plan().problem.shape.batch * plan().problem.shape.q_len; }
  virtual double NextFlops() const { return plan().flops; }

 protected:
  // The response's share of the item's in-flight memory (plan().response_bytes, at most what it holds), for the
  // response to keep until it has been sent; empty for an item the scheduler did not admit (run inline).
  InflightHold TakeResponseHold() { return hold_.Split(plan().response_bytes); }

 private:
  friend class Scheduler;

  InflightHold hold_;  // set by the scheduler at admission; the rest is given back when the item is destroyed
  const int64_t request_bytes_;
  const absl::Time received_;
  const absl::Time deadline_;
  const std::atomic<bool>* abort_ = nullptr;  // the scheduler's, once submitted
};

// The stop signal of items computed as one backend call: stops once none of them is wanted any more (each item's
// own Check then decides how it ends). Borrows the items.
class BatchStop final : public StopSignal {
 public:
  explicit BatchStop(absl::Span<WorkItem* const> items) : items_(items) {}
  absl::Status Check() const override;

 private:
  const absl::Span<WorkItem* const> items_;
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULING_WORK_ITEM_H_
