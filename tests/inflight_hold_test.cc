// InflightHold: bytes added to the ledger when a hold is made, given back when it is destroyed, split off for a
// response that outlives its computation.
#include "server/scheduling/inflight_hold.h"

#include <memory>
#include <utility>

#include "gtest/gtest.h"

namespace mha {
namespace {

TEST(InflightHoldTest, AddsWhenMadeAndGivesBackWhenDestroyed) {
  auto ledger = std::make_shared<InflightLedger>(0);
  {
    InflightHold hold(ledger, 100);
    EXPECT_EQ(ledger->load(), 100);
  }
  EXPECT_EQ(ledger->load(), 0);
}

TEST(InflightHoldTest, ASplitPartStaysCountedUntilItGoes) {
  auto ledger = std::make_shared<InflightLedger>(0);
  InflightHold part;
  {
    InflightHold call(ledger, 100);
    part = call.Split(30);
    EXPECT_EQ(call.bytes(), 70);
    EXPECT_EQ(part.bytes(), 30);
  }
  EXPECT_EQ(ledger->load(), 30);  // the response, not yet sent
  part = InflightHold();
  EXPECT_EQ(ledger->load(), 0);
}

TEST(InflightHoldTest, ASplitTakesAtMostWhatTheHoldHas) {
  auto ledger = std::make_shared<InflightLedger>(0);
  InflightHold call(ledger, 10);
  InflightHold part = call.Split(50);
  EXPECT_EQ(part.bytes(), 10);
  EXPECT_EQ(call.bytes(), 0);
  EXPECT_EQ(InflightHold().Split(5).bytes(), 0);  // an item never admitted holds nothing
}

TEST(InflightHoldTest, AMovedHoldGivesBackOnce) {
  auto ledger = std::make_shared<InflightLedger>(0);
  InflightHold a(ledger, 40);
  InflightHold b(std::move(a));
  EXPECT_EQ(ledger->load(), 40);
  b = InflightHold(ledger, 5);  // the 40 go back, the 5 are added
  EXPECT_EQ(ledger->load(), 5);
}

TEST(InflightHoldTest, AHoldKeepsItsLedgerAliveAfterEveryOtherOwnerIsGone) {
  auto ledger = std::make_shared<InflightLedger>(0);
  const std::weak_ptr<InflightLedger> watch = ledger;
  {
    InflightHold hold(ledger, 7);
    ledger.reset();  // the scheduler is gone; the response is still in gRPC's hands
    ASSERT_FALSE(watch.expired());
    EXPECT_EQ(watch.lock()->load(), 7);
  }
  EXPECT_TRUE(watch.expired());  // the hold was its last owner, and let it go
}

}  // namespace
}  // namespace mha
