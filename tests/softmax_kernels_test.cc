// The vectorised softmax row kernels against plain libm, on lengths that exercise the 16-lane body and the tail.
#include "server/softmax_kernels.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace mha::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

class RowKernelTest : public ::testing::TestWithParam<int> {};

TEST_P(RowKernelTest, ExpShiftSumMatchesLibmWithin2e7) {
  const int n = GetParam();
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = -90.0f + 178.0f * i / std::max(1, n - 1);  // spans underflow to near overflow
  std::vector<float> want(n);
  double want_sum = 0;
  for (int i = 0; i < n; ++i) {
    want[i] = std::exp(x[i] - 1.5f);
    want_sum += want[i];
  }
  const float sum = ExpShiftSum(x.data(), n, 1.5f);
  for (int i = 0; i < n; ++i) {
    if (want[i] < 1.2e-38f) {
      EXPECT_LE(x[i], 1.2e-38f) << i;  // below the normal range: flushed to 0 or the smallest normal
    } else {
      EXPECT_NEAR(x[i], want[i], 2e-7 * want[i]) << i;
    }
  }
  EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum + 1.2e-38);
}

TEST_P(RowKernelTest, RowMaxFindsTheMaximumAnywhere) {
  const int n = GetParam();
  for (int at = 0; at < n; at += std::max(1, n / 7)) {
    std::vector<float> x(n, -3.0f);
    x[at] = 2.5f;
    EXPECT_EQ(RowMax(x.data(), n), 2.5f) << "maximum at " << at;
  }
}

TEST_P(RowKernelTest, ScaleAndAddTouchExactlyNElements) {
  const int n = GetParam();
  std::vector<float> x(n + 1, 2.0f), add(n + 1, 1.0f);
  Scale(x.data(), n, 3.0f);
  Add(x.data(), add.data(), n);
  for (int i = 0; i < n; ++i) EXPECT_EQ(x[i], 7.0f);
  EXPECT_EQ(x[n], 2.0f);
}

INSTANTIATE_TEST_SUITE_P(Lengths, RowKernelTest, ::testing::Values(1, 15, 16, 17, 64, 100, 512, 1000));

TEST(RowKernels, MinusInfinityGivesExactlyZero) {
  std::vector<float> x = {-kInf, 0.0f, -kInf, -200.0f};
  EXPECT_EQ(ExpShiftSum(x.data(), 4, 0.0f), 1.0f);
  EXPECT_EQ(x[0], 0.0f);
  EXPECT_EQ(x[1], 1.0f);
  EXPECT_EQ(x[2], 0.0f);
  EXPECT_EQ(x[3], 0.0f);
}

TEST(RowKernels, EmptyRows) {
  EXPECT_EQ(RowMax(nullptr, 0), -kInf);
  EXPECT_EQ(ExpShiftSum(nullptr, 0, 0.0f), 0.0f);
}

}  // namespace
}  // namespace mha::kernels
