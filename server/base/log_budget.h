// A bound on log lines per second, so that a client cannot turn its calls into log volume: a flood of calls that
// end at once (HTTP/2 rapid reset: streams opened and cancelled as fast as a connection carries them) wrote 1.4-2.4
// MB of log a second and kept a core busy formatting it. Lines past the budget are counted, not written, and the next
// line written says how many were left out; metrics still count every call.
#ifndef MHA_SERVER_BASE_LOG_BUDGET_H_
#define MHA_SERVER_BASE_LOG_BUDGET_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mha {

// Thread-safe.
class LogBudget {
 public:
  // At most `per_second` lines in each second; 0 = no bound.
  explicit LogBudget(int per_second) : per_second_(per_second) {}

  // Whether a line may be written at `now`; when it may, *left_out is the number of lines refused since the last
  // one written.
  bool Take(absl::Time now, int64_t* left_out) {
    *left_out = 0;
    if (per_second_ <= 0) return true;
    absl::MutexLock lock(&mu_);
    if (now - window_start_ >= absl::Seconds(1)) {
      window_start_ = now;
      taken_ = 0;
    }
    if (taken_ >= per_second_) {
      ++left_out_;
      return false;
    }
    ++taken_;
    *left_out = left_out_;
    left_out_ = 0;
    return true;
  }

 private:
  const int per_second_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int taken_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t left_out_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_BASE_LOG_BUDGET_H_
