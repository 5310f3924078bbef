// Orders the calls on each session: a call starts once no call that arrived before it and has not ended names one of
// its sessions, so that the calls on one session run one at a time in the order they arrived, and calls on other
// sessions go on meanwhile. A started call holds its sessions until it releases them (an Extend through its wait in
// the compute queue and its compute), which is what makes a session's state safe to change without the store's
// lock and lets the store never evict or expire a session in use.
//
// An Extend's trip (server/rpc/session_service.cc):
//   1. gRPC thread: the call is admitted (token, parse) and its request validated by itself (ids, tensors:
//      ValidateExtendRequest); its error answers at once.
//   2. Submit: when its sessions are free it starts at once on that thread; else it waits here, bounded.
//   3. Start (on the submitting thread, or on this sequencer's starter thread when a release made it its turn):
//      validated against its held sessions (ValidateExtendHeld), its blocks reserved (SessionStore::Reserve, which
//      may evict idle sessions), and handed to the scheduler; an error ends it and releases its sessions.
//   4. Scheduler: queued (or run inline when tiny), computed in steps of --max_prefill_chunk rows on the compute
//      thread, alone or batched with other Extends' steps, back in the queue between steps.
//   5. Compute thread, after its last step: commit, answer, release its sessions. Release only marks the next
//      calls' turn: their Start (step 3, and the whole of a Fork, Truncate, Close or List) runs on the starter
//      thread, never on the compute thread, so that a queue of waiting session calls cannot stall compute.
//
// Bounded per principal: at most max_waiting calls of one owner (a token's id; every caller is the one owner ""
// without tokens), holding max_waiting_bytes of requests together, wait for their turn; one more is abandoned with
// RESOURCE_EXHAUSTED. A call whose sessions are free starts whatever waits, so one caller's queue behind its own
// busy session never refuses another's calls. A waiting call whose client is gone (Call::StillWanted) leaves within
// kSweepPeriod, abandoned with its reason, and frees its place. Thread-safe.
#ifndef MHA_SERVER_SESSIONS_SEQUENCER_H_
#define MHA_SERVER_SESSIONS_SEQUENCER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mha {

class SessionSequencer {
 public:
  // A call waiting for its sessions. Owned by the sequencer until its Start or Abandon returns, then destroyed.
  class Call {
   public:
    virtual ~Call() = default;
    // The call's turn: its sessions are held for it until Release(ids). Runs on the thread that submitted the call
    // when its sessions were free, else on the sequencer's starter thread; never under the sequencer's lock.
    virtual void Start() = 0;
    // The call will never start (too many wait, its client is gone, or shutdown): finish it with `status`. Its
    // sessions are not held.
    virtual void Abandon(const absl::Status& status) = 0;
    // OK while the call's client still waits for it; else why not (cancelled, past its deadline). Called on the
    // starter thread while the call waits.
    virtual absl::Status StillWanted() const { return absl::OkStatus(); }
  };

  // How often the starter thread looks for waiting calls whose clients are gone.
  static constexpr absl::Duration kSweepPeriod = absl::Milliseconds(20);

  SessionSequencer(int max_waiting, int64_t max_waiting_bytes);
  // Starts the calls whose turn has come, then ends the starter thread; calls still waiting are abandoned
  // (UNAVAILABLE).
  ~SessionSequencer();
  SessionSequencer(const SessionSequencer&) = delete;
  SessionSequencer& operator=(const SessionSequencer&) = delete;

  // Takes `call` of `owner`, which names the distinct session ids `ids` and holds `bytes` of request while it
  // waits: starts it now on this thread if its sessions are free, else keeps it until its turn (or abandons it
  // when the owner's waiting calls are at their bound).
  void Submit(std::vector<std::string> ids, int64_t bytes, std::unique_ptr<Call> call, const std::string& owner = "");
  // The calls holding `ids` ended: frees them. The waiting calls whose turn it is now start on the starter thread,
  // not on this one.
  void Release(const std::vector<std::string>& ids);
  // Blocks until every call whose turn has come has started (its Start returned), or `timeout` passes; true if
  // so. For tests.
  bool AwaitStarted(absl::Duration timeout) const;
  // Whether a started call holds `id` or a waiting call names it.
  bool InUse(const std::string& id) const;
  // Whether a started call holds `id`.
  bool Held(const std::string& id) const;
  // Abandons every waiting call, and every later one, with UNAVAILABLE. Started calls are left to end.
  void Shutdown();
  int waiting() const;

 private:
  struct Waiting {
    std::vector<std::string> ids;
    int64_t bytes = 0;
    std::unique_ptr<Call> call;
    std::string owner;
  };
  struct Share {  // what one owner's waiting calls hold
    int calls = 0;
    int64_t bytes = 0;
  };
  // Takes `it` out of waiting_, with its share and its wanted_ counts; returns the next.
  std::deque<Waiting>::iterator Remove(std::deque<Waiting>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the waiting calls whose clients are gone to `gone`, then starts what that frees.
  void SweepGone(std::vector<std::pair<std::unique_ptr<Call>, absl::Status>>* gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the waiting calls that may start now, in order, to ready_, holding their sessions.
  void TakeStartable() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The starter thread: starts the calls in ready_, in order, until the sequencer is destroyed.
  void StartReady();

  const int max_waiting_;
  const int64_t max_waiting_bytes_;
  mutable absl::Mutex mu_;
  std::deque<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Share> shares_ ABSL_GUARDED_BY(mu_);  // by owner, of the waiting calls
  std::set<std::string> held_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> wanted_ ABSL_GUARDED_BY(mu_);  // by waiting calls: how many name each id
  std::deque<std::unique_ptr<Call>> ready_ ABSL_GUARDED_BY(mu_);  // their turn came; the starter starts them
  int starting_ ABSL_GUARDED_BY(mu_) = 0;  // taken from ready_, Start not yet returned
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  bool destroying_ ABSL_GUARDED_BY(mu_) = false;
  std::thread starter_;  // last: started once everything above is
};

// The sessions a started call holds, released when this goes (or by Release, once). Movable, not copyable.
class SessionHold {
 public:
  SessionHold() = default;
  SessionHold(SessionSequencer* sequencer, std::vector<std::string> ids)
      : sequencer_(sequencer), ids_(std::move(ids)) {}
  SessionHold(SessionHold&& other) noexcept : sequencer_(other.sequencer_), ids_(std::move(other.ids_)) {
    other.sequencer_ = nullptr;
  }
  SessionHold& operator=(SessionHold&& other) noexcept {
    if (this != &other) {
      Release();
      sequencer_ = other.sequencer_;
      ids_ = std::move(other.ids_);
      other.sequencer_ = nullptr;
    }
    return *this;
  }
  ~SessionHold() { Release(); }

  void Release() {
    if (sequencer_ == nullptr) return;
    SessionSequencer* sequencer = sequencer_;
    sequencer_ = nullptr;
    sequencer->Release(ids_);
  }
  const std::vector<std::string>& ids() const { return ids_; }

 private:
  SessionSequencer* sequencer_ = nullptr;
  std::vector<std::string> ids_;
};

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_SEQUENCER_H_
