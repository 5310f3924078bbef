// The order of calls on sessions: one at a time per session, in arrival order; other sessions go on; bounded waiting.
#include "server/sessions/sequencer.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;

// Records when it starts (its name into *started) and how it was abandoned; releases its sessions on start when
// `release_at_start`, else leaves them held until the test releases them.
class Recorder final : public SessionSequencer::Call {
 public:
  Recorder(std::string name, std::vector<std::string>* started, std::vector<absl::Status>* abandoned,
           SessionSequencer* sequencer = nullptr, std::vector<std::string> release_at_start = {})
      : name_(std::move(name)), started_(started), abandoned_(abandoned), sequencer_(sequencer),
        release_(std::move(release_at_start)) {}
  void Start() override {
    started_->push_back(name_);
    if (sequencer_ != nullptr) sequencer_->Release(release_);
  }
  void Abandon(const absl::Status& status) override { abandoned_->push_back(status); }

 private:
  const std::string name_;
  std::vector<std::string>* const started_;
  std::vector<absl::Status>* const abandoned_;
  SessionSequencer* const sequencer_;
  const std::vector<std::string> release_;
};

class SequencerTest : public ::testing::Test {
 protected:
  void Submit(const std::string& name, std::vector<std::string> ids, bool release_at_start = false) {
    auto call = std::make_unique<Recorder>(name, &started_, &abandoned_, release_at_start ? &sequencer_ : nullptr,
                                           ids);
    sequencer_.Submit(std::move(ids), 100, std::move(call));
  }

  SessionSequencer sequencer_{4, 1000};
  std::vector<std::string> started_;
  std::vector<absl::Status> abandoned_;
};

TEST_F(SequencerTest, AFreeSessionsCallStartsAtOnce) {
  Submit("a", {"s1"});
  EXPECT_THAT(started_, ElementsAre("a"));
  EXPECT_TRUE(sequencer_.InUse("s1"));
  sequencer_.Release({"s1"});
  EXPECT_FALSE(sequencer_.InUse("s1"));
}

TEST_F(SequencerTest, CallsOnOneSessionStartOneAtATimeInArrivalOrder) {
  Submit("a", {"s1"});
  Submit("b", {"s1"});
  Submit("c", {"s1"});
  EXPECT_THAT(started_, ElementsAre("a"));
  EXPECT_EQ(sequencer_.waiting(), 2);
  sequencer_.Release({"s1"});
  EXPECT_THAT(started_, ElementsAre("a", "b"));
  sequencer_.Release({"s1"});
  EXPECT_THAT(started_, ElementsAre("a", "b", "c"));
}

TEST_F(SequencerTest, CallsOnOtherSessionsDoNotWait) {
  Submit("a", {"s1"});
  Submit("b", {"s1"});
  Submit("c", {"s2"});
  EXPECT_THAT(started_, ElementsAre("a", "c"));
}

TEST_F(SequencerTest, ACallOnSeveralSessionsWaitsForAllAndKeepsItsPlace) {
  Submit("a", {"s1"});
  Submit("fork", {"s1", "s2"});  // waits for s1
  Submit("b", {"s2"});           // s2 is free, but the fork arrived first and names it
  EXPECT_THAT(started_, ElementsAre("a"));
  EXPECT_TRUE(sequencer_.InUse("s2"));
  sequencer_.Release({"s1"});
  EXPECT_THAT(started_, ElementsAre("a", "fork"));
  sequencer_.Release({"s1", "s2"});
  EXPECT_THAT(started_, ElementsAre("a", "fork", "b"));
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
  SessionSequencer sequencer(1000, int64_t{1} << 40);
  std::vector<std::string> started;
  std::vector<absl::Status> abandoned;
  int active = 0;
  std::vector<int> nesting;
  sequencer.Submit({"s"}, 1, std::make_unique<Recorder>("hold", &started, &abandoned));
  for (int i = 0; i < 1000; ++i) {
    sequencer.Submit({"s"}, 1, std::make_unique<NestingProbe>(&sequencer, &active, &nesting));
  }
  sequencer.Release({"s"});
  // Each started from the same loop, not from inside the one before (which would nest them 1000 deep).
  EXPECT_EQ(nesting, std::vector<int>(1000, 1));
  EXPECT_FALSE(sequencer.InUse("s"));
}

TEST_F(SequencerTest, TooManyWaitingCallsAreRefused) {
  Submit("hold", {"s"});
  for (int i = 0; i < 4; ++i) Submit("w", {"s"});
  EXPECT_TRUE(abandoned_.empty());
  Submit("one too many", {"s"});
  ASSERT_EQ(abandoned_.size(), 1u);
  EXPECT_EQ(abandoned_[0].code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(SequencerTest, WaitingBytesAreBounded) {
  SessionSequencer sequencer(100, 250);
  std::vector<std::string> started;
  std::vector<absl::Status> abandoned;
  sequencer.Submit({"s"}, 100, std::make_unique<Recorder>("hold", &started, &abandoned));
  sequencer.Submit({"s"}, 200, std::make_unique<Recorder>("w1", &started, &abandoned));
  sequencer.Submit({"s"}, 100, std::make_unique<Recorder>("w2", &started, &abandoned));
  ASSERT_EQ(abandoned.size(), 1u);
  EXPECT_EQ(abandoned[0].code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(SequencerTest, ShutdownAbandonsTheWaitingAndLaterCalls) {
  Submit("hold", {"s"});
  Submit("waiting", {"s"});
  sequencer_.Shutdown();
  Submit("later", {"t"});
  ASSERT_EQ(abandoned_.size(), 2u);
  for (const absl::Status& status : abandoned_) EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(started_, ElementsAre("hold"));
}

TEST(SessionHold, ReleasesOnceWhenItGoes) {
  SessionSequencer sequencer(4, 1000);
  std::vector<std::string> started;
  std::vector<absl::Status> abandoned;
  sequencer.Submit({"s"}, 1, std::make_unique<Recorder>("a", &started, &abandoned));
  {
    SessionHold hold(&sequencer, {"s"});
    SessionHold moved = std::move(hold);
    EXPECT_TRUE(sequencer.InUse("s"));
  }
  EXPECT_FALSE(sequencer.InUse("s"));
}

}  // namespace
}  // namespace mha
