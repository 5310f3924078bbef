// In-flight memory: what admitted calls hold (request, response, working memory), counted in one ledger that the
// scheduler checks at admission (--max_inflight_mb). A hold gives its bytes back when it is destroyed; a response
// that outlives its computation takes its share of the call's hold along (Split) and keeps it until gRPC has sent
// it, so that a client that never reads its responses keeps them counted (16 such calls of 1.1 MiB once pinned
// 3.1 GB, three times the limit, with the allowance given back when compute ended).
#ifndef MHA_SERVER_SCHEDULING_INFLIGHT_HOLD_H_
#define MHA_SERVER_SCHEDULING_INFLIGHT_HOLD_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace mha {

// Bytes held by admitted calls and unsent responses. Shared by the scheduler and every hold, so that a hold may
// outlive the scheduler (a response still in gRPC's hands at shutdown).
using InflightLedger = std::atomic<int64_t>;

// A share of the ledger: added when made, given back when destroyed. Move-only; not thread-safe itself (one owner
// at a time), the ledger is.
class InflightHold {
 public:
  InflightHold() = default;
  InflightHold(std::shared_ptr<InflightLedger> ledger, int64_t bytes) : ledger_(std::move(ledger)), bytes_(bytes) {
    ledger_->fetch_add(bytes_, std::memory_order_relaxed);
  }
  InflightHold(InflightHold&& other) noexcept
      : ledger_(std::move(other.ledger_)), bytes_(std::exchange(other.bytes_, 0)) {}
  InflightHold& operator=(InflightHold&& other) noexcept {
    if (this != &other) {
      Release();
      ledger_ = std::move(other.ledger_);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~InflightHold() { Release(); }

  int64_t bytes() const { return bytes_; }

  // Moves up to `bytes` of this hold into a hold of its own; the rest stays here.
  InflightHold Split(int64_t bytes) {
    InflightHold part;
    part.ledger_ = ledger_;
    part.bytes_ = std::clamp<int64_t>(bytes, 0, bytes_);
    bytes_ -= part.bytes_;
    return part;
  }

 private:
  void Release() {
    if (ledger_ != nullptr && bytes_ != 0) ledger_->fetch_sub(bytes_, std::memory_order_relaxed);
    bytes_ = 0;
  }

  std::shared_ptr<InflightLedger> ledger_;
  int64_t bytes_ = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_SCHEDULING_INFLIGHT_HOLD_H_
