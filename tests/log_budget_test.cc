// LogBudget: at most N lines a second, and the line after a refusal says how many were refused.
#include "server/base/log_budget.h"

#include "gtest/gtest.h"

namespace mha {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(LogBudgetTest, TakesAtMostTheBudgetInASecondAndCountsTheRest) {
  LogBudget budget(3);
  int64_t left_out = -1;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(budget.Take(kT0 + absl::Milliseconds(i), &left_out));
    EXPECT_EQ(left_out, 0);
  }
  EXPECT_FALSE(budget.Take(kT0 + absl::Milliseconds(500), &left_out));
  EXPECT_FALSE(budget.Take(kT0 + absl::Milliseconds(999), &left_out));
  EXPECT_TRUE(budget.Take(kT0 + absl::Seconds(1), &left_out));
  EXPECT_EQ(left_out, 2);
  EXPECT_TRUE(budget.Take(kT0 + absl::Seconds(1), &left_out));
  EXPECT_EQ(left_out, 0);  // said once
}

TEST(LogBudgetTest, ZeroMeansEveryLine) {
  LogBudget budget(0);
  int64_t left_out = -1;
  for (int i = 0; i < 10000; ++i) ASSERT_TRUE(budget.Take(kT0, &left_out));
  EXPECT_EQ(left_out, 0);
}

}  // namespace
}  // namespace mha
