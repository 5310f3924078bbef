#include "server/scheduling/work_item.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mha {

absl::Status WorkItem::Check() const {
  if (abort_ != nullptr && abort_->load(std::memory_order_relaxed)) {
    return absl::UnavailableError("the server is shutting down and stopped this call at the end of its grace period");
  }
  if (absl::Now() > deadline_) {
    return absl::DeadlineExceededError(
        absl::StrCat("the call passed its deadline (", absl::FormatDuration(deadline_ - received_),
                     " after it arrived) and was stopped"));
  }
  if (IsCancelled()) return absl::CancelledError("the client cancelled the call");
  return absl::OkStatus();
}

const std::string& WorkItem::owner() const {
  static const std::string* const kNobody = new std::string();
  return *kNobody;
}

absl::Status BatchStop::Check() const {
  for (const WorkItem* item : items_) {
    if (item->Check().ok()) return absl::OkStatus();
  }
  return items_.front()->Check();
}

}  // namespace mha
