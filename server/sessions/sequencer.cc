#include "server/sessions/sequencer.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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

void SessionSequencer::Submit(std::vector<std::string> ids, int64_t bytes, std::unique_ptr<Call> call,
                              const std::string& owner) {
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    bool free = true;
    for (const std::string& id : ids) free = free && held_.count(id) == 0 && wanted_.count(id) == 0;
    const auto share = shares_.find(owner);
    const Share mine = share != shares_.end() ? share->second : Share();
    if (shut_down_) {
      refused = absl::UnavailableError("server is shutting down");
    } else if (free) {
      // Its turn already: it starts here, below, holding its sessions.
      held_.insert(ids.begin(), ids.end());
    } else if (mine.calls >= max_waiting_ || (mine.calls > 0 && mine.bytes + bytes > max_waiting_bytes_)) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "too many of this caller's session calls wait for sessions that its other calls hold (", mine.calls,
          " calls, ", mine.bytes, " bytes; --max_queue_size, --max_queued_mb); retry later"));
    } else {
      for (const std::string& id : ids) ++wanted_[id];
      Share& grown = shares_[owner];
      grown.calls += 1;
      grown.bytes += bytes;
      waiting_.push_back({std::move(ids), bytes, std::move(call), owner});
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

bool SessionSequencer::Held(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return held_.count(id) > 0;
}

void SessionSequencer::Shutdown() {
  std::deque<Waiting> abandoned;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    abandoned.swap(waiting_);
    wanted_.clear();
    shares_.clear();
  }
  for (Waiting& w : abandoned) w.call->Abandon(absl::UnavailableError("server is shutting down"));
}

std::deque<SessionSequencer::Waiting>::iterator SessionSequencer::Remove(std::deque<Waiting>::iterator it) {
  for (const std::string& id : it->ids) {
    if (--wanted_[id] == 0) wanted_.erase(id);
  }
  const auto share = shares_.find(it->owner);
  share->second.calls -= 1;
  share->second.bytes -= it->bytes;
  if (share->second.calls == 0) shares_.erase(share);
  return waiting_.erase(it);
}

void SessionSequencer::SweepGone(std::vector<std::pair<std::unique_ptr<Call>, absl::Status>>* gone) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    absl::Status wanted = it->call->StillWanted();
    if (wanted.ok()) {
      ++it;
      continue;
    }
    gone->emplace_back(std::move(it->call), std::move(wanted));
    it = Remove(it);
  }
  if (!gone->empty()) TakeStartable();  // a call behind a gone one may start now
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
    held_.insert(it->ids.begin(), it->ids.end());
    ready_.push_back(std::move(it->call));
    it = Remove(it);
  }
}

void SessionSequencer::StartReady() {
  for (;;) {
    std::unique_ptr<Call> call;
    std::vector<std::pair<std::unique_ptr<Call>, absl::Status>> gone;
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      const auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.empty() || destroying_; };
      // Waiting calls are swept while nothing is ready (and between starts when calls keep coming).
      if (!mu_.AwaitWithTimeout(absl::Condition(&has_work), kSweepPeriod) || absl::Now() >= next_sweep_) {
        next_sweep_ = absl::Now() + kSweepPeriod;
        SweepGone(&gone);
      }
      if (!ready_.empty()) {
        call = std::move(ready_.front());
        ready_.pop_front();
        ++starting_;
      }
      done = call == nullptr && destroying_;  // nothing left to start
    }
    for (auto& [waiter, status] : gone) waiter->Abandon(status);
    if (done) return;
    if (call == nullptr) continue;
    call->Start();
    call.reset();
    absl::MutexLock lock(&mu_);
    --starting_;
  }
}

}  // namespace mha
