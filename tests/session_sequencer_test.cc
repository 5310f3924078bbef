// The order of calls on sessions: one at a time per session, in arrival order; other sessions go on; bounded
// waiting; a call whose turn comes with a release starts on the sequencer's starter thread.
#include "server/sessions/sequencer.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;

// What the calls did, written by the thread that starts them (the test's, or the sequencer's starter) and read by
// the test once the sequencer says every due call has started.
struct Log {
  absl::Mutex mu;
  std::vector<std::string> started ABSL_GUARDED_BY(mu);
  std::vector<std::thread::id> threads ABSL_GUARDED_BY(mu);
  std::vector<absl::Status> abandoned ABSL_GUARDED_BY(mu);
};

// Records when it starts (its name and thread) and how it was abandoned; releases its sessions on start when given
// a sequencer, else leaves them held until the test releases them.
class Recorder final : public SessionSequencer::Call {
 public:
  Recorder(std::string name, Log* log, SessionSequencer* sequencer = nullptr,
           std::vector<std::string> release_at_start = {})
      : name_(std::move(name)), log_(log), sequencer_(sequencer), release_(std::move(release_at_start)) {}
  void Start() override {
    {
      absl::MutexLock lock(&log_->mu);
      log_->started.push_back(name_);
      log_->threads.push_back(std::this_thread::get_id());
    }
    if (sequencer_ != nullptr) sequencer_->Release(release_);
  }
  void Abandon(const absl::Status& status) override {
    absl::MutexLock lock(&log_->mu);
    log_->abandoned.push_back(status);
  }

 private:
  const std::string name_;
  Log* const log_;
  SessionSequencer* const sequencer_;
  const std::vector<std::string> release_;
};

class SequencerTest : public ::testing::Test {
 protected:
  void Submit(const std::string& name, std::vector<std::string> ids, bool release_at_start = false) {
    auto call = std::make_unique<Recorder>(name, &log_, release_at_start ? &sequencer_ : nullptr, ids);
    sequencer_.Submit(std::move(ids), 100, std::move(call));
  }
  // The calls started so far, once every call whose turn has come has started.
  std::vector<std::string> Started() {
    EXPECT_TRUE(sequencer_.AwaitStarted(absl::Seconds(10)));
    absl::MutexLock lock(&log_.mu);
    return log_.started;
  }
  std::vector<absl::Status> Abandoned() {
    absl::MutexLock lock(&log_.mu);
    return log_.abandoned;
  }

  Log log_;
  SessionSequencer sequencer_{4, 1000};
};

TEST_F(SequencerTest, AFreeSessionsCallStartsAtOnceOnTheSubmittingThread) {
  Submit("a", {"s1"});
  {
    absl::MutexLock lock(&log_.mu);
    EXPECT_THAT(log_.started, ElementsAre("a"));
    EXPECT_THAT(log_.threads, ElementsAre(std::this_thread::get_id()));
  }
  EXPECT_TRUE(sequencer_.InUse("s1"));
  sequencer_.Release({"s1"});
  EXPECT_FALSE(sequencer_.InUse("s1"));
}

TEST_F(SequencerTest, CallsOnOneSessionStartOneAtATimeInArrivalOrder) {
  Submit("a", {"s1"});
  Submit("b", {"s1"});
  Submit("c", {"s1"});
  EXPECT_THAT(Started(), ElementsAre("a"));
  EXPECT_EQ(sequencer_.waiting(), 2);
  sequencer_.Release({"s1"});
  EXPECT_THAT(Started(), ElementsAre("a", "b"));
  sequencer_.Release({"s1"});
  EXPECT_THAT(Started(), ElementsAre("a", "b", "c"));
}

TEST_F(SequencerTest, CallsOnOtherSessionsDoNotWait) {
  Submit("a", {"s1"});
  Submit("b", {"s1"});
  Submit("c", {"s2"});
  EXPECT_THAT(Started(), ElementsAre("a", "c"));
}

TEST_F(SequencerTest, ACallOnSeveralSessionsWaitsForAllAndKeepsItsPlace) {
  Submit("a", {"s1"});
  Submit("fork", {"s1", "s2"});  // waits for s1
  Submit("b", {"s2"});           // s2 is free, but the fork arrived first and names it
  EXPECT_THAT(Started(), ElementsAre("a"));
  EXPECT_TRUE(sequencer_.InUse("s2"));
  sequencer_.Release({"s1"});
  EXPECT_THAT(Started(), ElementsAre("a", "fork"));
  sequencer_.Release({"s1", "s2"});
  EXPECT_THAT(Started(), ElementsAre("a", "fork", "b"));
}

// Releases its session as it starts, and notes how many calls were starting at once (nested in each other's
// Release) when it did.
class NestingProbe final : public SessionSequencer::Call {
 public:
  NestingProbe(SessionSequencer* sequencer, int* active, std::vector<int>* nesting)
      : sequencer_(sequencer), active_(active), nesting_(nesting) {}
  void Start() override {
    nesting_->push_back(++*active_);
    sequencer_->Release({"s"});
    --*active_;
  }
  void Abandon(const absl::Status&) override {}

 private:
  SessionSequencer* const sequencer_;
  int* const active_;
  std::vector<int>* const nesting_;
};

TEST_F(SequencerTest, CallsThatReleaseAsTheyStartRunOneAfterAnotherWithoutRecursing) {
  Log log;  // outlives the sequencer, whose destructor abandons what still waits
  SessionSequencer sequencer(1000, int64_t{1} << 40);
  int active = 0;  // the starter thread's alone until AwaitStarted
  std::vector<int> nesting;
  sequencer.Submit({"s"}, 1, std::make_unique<Recorder>("hold", &log));
  for (int i = 0; i < 1000; ++i) {
    sequencer.Submit({"s"}, 1, std::make_unique<NestingProbe>(&sequencer, &active, &nesting));
  }
  sequencer.Release({"s"});
  ASSERT_TRUE(sequencer.AwaitStarted(absl::Seconds(10)));
  // Each started from the starter's loop, not from inside the one before (which would nest them 1000 deep).
  EXPECT_EQ(nesting, std::vector<int>(1000, 1));
  EXPECT_FALSE(sequencer.InUse("s"));
}

// Blocks in Start until the test lets it go (at most 10 s), and records on which thread it started.
class Blocker final : public SessionSequencer::Call {
 public:
  Blocker(absl::Notification* go, std::thread::id* thread, bool* released) : go_(go), thread_(thread),
                                                                             released_(released) {}
  void Start() override {
    *thread_ = std::this_thread::get_id();
    *released_ = go_->WaitForNotificationWithTimeout(absl::Seconds(10));
  }
  void Abandon(const absl::Status&) override {}

 private:
  absl::Notification* const go_;
  std::thread::id* const thread_;
  bool* const released_;
};

TEST_F(SequencerTest, ATurnThatComesWithAReleaseStartsOnTheStarterNotOnTheReleasingThread) {
  absl::Notification go;
  std::thread::id thread;
  bool released = false;
  Submit("hold", {"s"});
  sequencer_.Submit({"s"}, 1, std::make_unique<Blocker>(&go, &thread, &released));
  // The compute thread releases an Extend's sessions: it must go back to computing, not run the next call's Start.
  sequencer_.Release({"s"});
  go.Notify();
  ASSERT_TRUE(sequencer_.AwaitStarted(absl::Seconds(20)));
  EXPECT_TRUE(released) << "Start ran inside Release, on the releasing thread";
  EXPECT_NE(thread, std::this_thread::get_id());
}

TEST_F(SequencerTest, TooManyWaitingCallsAreRefused) {
  Submit("hold", {"s"});
  for (int i = 0; i < 4; ++i) Submit("w", {"s"});
  EXPECT_TRUE(Abandoned().empty());
  Submit("one too many", {"s"});
  ASSERT_EQ(Abandoned().size(), 1u);
  EXPECT_EQ(Abandoned()[0].code(), absl::StatusCode::kResourceExhausted);
}

// The waiting room bounds calls that wait: one whose sessions are free starts, however many wait (F1 of #54: a
// caller's queue behind its own busy session refused every other caller's calls, ListSessions included).
TEST_F(SequencerTest, ACallWhoseSessionsAreFreeStartsWhenTheRoomIsFull) {
  Submit("hold", {"s"});
  for (int i = 0; i < 4; ++i) Submit("w", {"s"});
  Submit("other session", {"t"});
  Submit("no session", {});
  EXPECT_TRUE(Abandoned().empty());
  EXPECT_THAT(Started(), ElementsAre("hold", "other session", "no session"));
}

// Each owner waits in a room of its own.
TEST_F(SequencerTest, EachOwnerHasItsOwnWaitingBound) {
  sequencer_.Submit({"m"}, 1, std::make_unique<Recorder>("mallory holds", &log_), "mallory");
  for (int i = 0; i < 4; ++i) sequencer_.Submit({"m"}, 1, std::make_unique<Recorder>("m", &log_), "mallory");
  sequencer_.Submit({"m"}, 1, std::make_unique<Recorder>("m too many", &log_), "mallory");
  ASSERT_EQ(Abandoned().size(), 1u);
  EXPECT_THAT(Abandoned()[0].message(), testing::HasSubstr("this caller's session calls"));
  sequencer_.Submit({"a"}, 1, std::make_unique<Recorder>("alice holds", &log_), "alice");
  sequencer_.Submit({"a"}, 1, std::make_unique<Recorder>("alice waits", &log_), "alice");
  EXPECT_EQ(Abandoned().size(), 1u);
  EXPECT_EQ(sequencer_.waiting(), 5);
}

// Stands for a call whose client may go away while it waits.
class Leaver final : public SessionSequencer::Call {
 public:
  Leaver(Log* log, const std::atomic<bool>* gone) : log_(log), gone_(gone) {}
  void Start() override {
    absl::MutexLock lock(&log_->mu);
    log_->started.push_back("leaver");
  }
  void Abandon(const absl::Status& status) override {
    absl::MutexLock lock(&log_->mu);
    log_->abandoned.push_back(status);
  }
  absl::Status StillWanted() const override {
    return gone_->load() ? absl::CancelledError("the client cancelled the call") : absl::OkStatus();
  }

 private:
  Log* const log_;
  const std::atomic<bool>* gone_;
};

// A waiting call whose client is gone leaves at once (within the sweep), with its reason, and frees its place.
TEST_F(SequencerTest, AWaitingCallWhoseClientIsGoneLeavesAndFreesItsPlace) {
  std::atomic<bool> gone{false};
  Submit("hold", {"s"});
  for (int i = 0; i < 4; ++i) sequencer_.Submit({"s"}, 1, std::make_unique<Leaver>(&log_, &gone));
  gone = true;
  // The starter thread takes them off the waiting list, then abandons them outside its lock: wait for both.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((sequencer_.waiting() > 0 || Abandoned().size() < 4) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(sequencer_.waiting(), 0);
  ASSERT_TRUE(sequencer_.AwaitStarted(absl::Seconds(10)));
  std::vector<absl::Status> abandoned = Abandoned();
  ASSERT_EQ(abandoned.size(), 4u);
  for (const absl::Status& status : abandoned) EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  for (int i = 0; i < 4; ++i) Submit("w", {"s"});  // the places are free again
  EXPECT_EQ(Abandoned().size(), 4u);
  EXPECT_THAT(Started(), ElementsAre("hold"));
}

TEST_F(SequencerTest, WaitingBytesAreBounded) {
  Log log;
  SessionSequencer sequencer(100, 250);
  sequencer.Submit({"s"}, 100, std::make_unique<Recorder>("hold", &log));
  sequencer.Submit({"s"}, 200, std::make_unique<Recorder>("w1", &log));
  sequencer.Submit({"s"}, 100, std::make_unique<Recorder>("w2", &log));
  absl::MutexLock lock(&log.mu);
  ASSERT_EQ(log.abandoned.size(), 1u);
  EXPECT_EQ(log.abandoned[0].code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(SequencerTest, ShutdownAbandonsTheWaitingAndLaterCalls) {
  Submit("hold", {"s"});
  Submit("waiting", {"s"});
  sequencer_.Shutdown();
  Submit("later", {"t"});
  ASSERT_EQ(Abandoned().size(), 2u);
  for (const absl::Status& status : Abandoned()) EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(Started(), ElementsAre("hold"));
}

TEST(SessionHold, ReleasesOnceWhenItGoes) {
  Log log;
  SessionSequencer sequencer(4, 1000);
  sequencer.Submit({"s"}, 1, std::make_unique<Recorder>("a", &log));
  {
    SessionHold hold(&sequencer, {"s"});
    SessionHold moved = std::move(hold);
    EXPECT_TRUE(sequencer.InUse("s"));
  }
  EXPECT_FALSE(sequencer.InUse("s"));
}

}  // namespace
}  // namespace mha
