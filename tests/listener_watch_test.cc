// ListenerWatch: a listener is stalled when connections wait in its queue for the stall time with no accept on it
// meanwhile, and only then.
#include "server/transport/listener_watch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha {
namespace {

constexpr absl::Duration kStall = absl::Seconds(10);

// A non-blocking loopback listener, and connections to it.
class ListenerWatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    listener_ = testing::ListenOnLoopback(SOCK_NONBLOCK, &address_);
    ASSERT_GE(listener_, 0);
    NoteAccept(listener_, false);  // as the connection gate does on its first accept
  }
  void TearDown() override {
    for (int fd : open_) close(fd);
    // The slot stays taken (listeners live as long as the server); its closed fd reads as nothing waiting.
    close(listener_);
  }

  void Connect() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address_), sizeof(address_)), 0);
    open_.push_back(fd);
  }
  void AcceptOne() {
    const int fd = accept(listener_, nullptr, nullptr);
    ASSERT_GE(fd, 0);
    open_.push_back(fd);
    NoteAccept(listener_, true);
  }

  int listener_ = -1;
  sockaddr_in address_{};
  std::vector<int> open_;
  ListenerWatch watch_;
  const absl::Time t0_ = absl::Now();
};

TEST_F(ListenerWatchTest, AnEmptyQueueIsNeverStalled) {
  EXPECT_EQ(watch_.Stalled(t0_, kStall), -1);
  EXPECT_EQ(watch_.Stalled(t0_ + absl::Hours(1), kStall), -1);
}

TEST_F(ListenerWatchTest, ConnectionsWaitingThroughTheStallTimeWithoutAnAcceptAreAStall) {
  Connect();
  EXPECT_EQ(watch_.Stalled(t0_, kStall), -1);
  EXPECT_EQ(watch_.Stalled(t0_ + kStall - absl::Seconds(1), kStall), -1);
  EXPECT_EQ(watch_.Stalled(t0_ + kStall, kStall), listener_);
}

TEST_F(ListenerWatchTest, AnAcceptMeanwhileStartsTheWaitAgain) {
  Connect();
  Connect();
  EXPECT_EQ(watch_.Stalled(t0_, kStall), -1);
  AcceptOne();  // one still waits, but the listener moved on
  const absl::Time later = absl::Now() + absl::Seconds(5);
  EXPECT_EQ(watch_.Stalled(later, kStall), -1);
  EXPECT_EQ(watch_.Stalled(later + kStall, kStall), listener_);
}

TEST_F(ListenerWatchTest, AQueueThatEmptiesIsNoLongerWaiting) {
  Connect();
  EXPECT_EQ(watch_.Stalled(t0_, kStall), -1);
  AcceptOne();
  EXPECT_EQ(watch_.Stalled(t0_ + kStall, kStall), -1);
}

}  // namespace
}  // namespace mha
