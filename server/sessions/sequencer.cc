#include "server/sessions/sequencer.h"

#include "absl/strings/str_cat.h"

namespace mha {

SessionSequencer::SessionSequencer(int max_waiting, int64_t max_waiting_bytes)
    : max_waiting_(max_waiting), max_waiting_bytes_(max_waiting_bytes), starter_([this] { StartReady(); }) {}

SessionSequencer::~SessionSequencer() {
  Shutdown();
  {
    absl::MutexLock lock(&mu_);
    destroying_ = true;
  }
  starter_.join();
}

void SessionSequencer::Submit(std::vector<std::string> ids, int64_t bytes, std::unique_ptr<Call> call) {
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) {
      refused = absl::UnavailableError("server is shutting down");
    } else if (static_cast<int>(waiting_.size()) >= max_waiting_ ||
               (!waiting_.empty() && waiting_bytes_ + bytes > max_waiting_bytes_)) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "too many session calls wait for sessions that other calls hold (", waiting_.size(), " calls, ",
          waiting_bytes_, " bytes; --max_queue_size, --max_queued_mb); retry later"));
    } else {
      bool free = true;
      for (const std::string& id : ids) free = free && held_.count(id) == 0 && wanted_.count(id) == 0;
      if (free) {
        // Its turn already: it starts here, below, holding its sessions.
        held_.insert(ids.begin(), ids.end());
      } else {
        for (const std::string& id : ids) ++wanted_[id];
        waiting_bytes_ += bytes;
        waiting_.push_back({std::move(ids), bytes, std::move(call)});
      }
    }
  }
  if (!refused.ok()) {
    call->Abandon(refused);
    return;
  }
  if (call != nullptr) call->Start();
}

void SessionSequencer::Release(const std::vector<std::string>& ids) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : ids) held_.erase(id);
  TakeStartable();
}

bool SessionSequencer::AwaitStarted(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  const auto started = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_.empty() && starting_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&started), timeout);
}

bool SessionSequencer::InUse(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return held_.count(id) > 0 || wanted_.count(id) > 0;
}

void SessionSequencer::Shutdown() {
  std::deque<Waiting> abandoned;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    abandoned.swap(waiting_);
    wanted_.clear();
    waiting_bytes_ = 0;
  }
  for (Waiting& w : abandoned) w.call->Abandon(absl::UnavailableError("server is shutting down"));
}

int SessionSequencer::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiting_.size());
}

void SessionSequencer::TakeStartable() {
  std::set<std::string> blocked;  // named by an earlier call that still waits
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    bool free = true;
    for (const std::string& id : it->ids) free = free && held_.count(id) == 0 && blocked.count(id) == 0;
    if (!free) {
      blocked.insert(it->ids.begin(), it->ids.end());
      ++it;
      continue;
    }
    for (const std::string& id : it->ids) {
      held_.insert(id);
      if (--wanted_[id] == 0) wanted_.erase(id);
    }
    waiting_bytes_ -= it->bytes;
    ready_.push_back(std::move(it->call));
    it = waiting_.erase(it);
  }
}

void SessionSequencer::StartReady() {
  for (;;) {
    std::unique_ptr<Call> call;
    {
      absl::MutexLock lock(&mu_);
      const auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.empty() || destroying_; };
      mu_.Await(absl::Condition(&has_work));
      if (ready_.empty()) return;  // destroying, and nothing left to start
      call = std::move(ready_.front());
      ready_.pop_front();
      ++starting_;
    }
    call->Start();
    call.reset();
    absl::MutexLock lock(&mu_);
    --starting_;
  }
}

}  // namespace mha
