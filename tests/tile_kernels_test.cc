// The hand-written tile matmuls against plain loops, for every instruction set this CPU runs (others skip), on
// sizes that cut the register blocks at every edge: rows not a multiple of the panel, columns not a multiple of a
// vector or a block, strides wider than the data. Nothing outside the output rectangle may be written.
#include "server/tile_kernels.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha::kernels {
namespace {

using ::mha::testing::RandomVector;

constexpr float kSentinel = 12345.0f;

// (isa, rows, cols, depth)
class ScoresTest : public ::testing::TestWithParam<std::tuple<std::string, int, int, int>> {};

TEST_P(ScoresTest, MatchesPlainLoopsAndWritesOnlyTheOutput) {
  const auto& [isa, rows, cols, depth] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldq = depth + 3, lds = cols + 5;
  const int ldk = (cols + k->score_columns - 1) / k->score_columns * k->score_columns + 7;
  const std::vector<float> q = RandomVector(rows * ldq, 1), kt = RandomVector(depth * ldk, 2);
  std::vector<float> s(rows * lds, kSentinel);
  const float scale = 0.37f;
  k->scores(rows, cols, depth, scale, q.data(), ldq, kt.data(), ldk, s.data(), lds);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < lds; ++j) {
      if (j >= cols) {
        ASSERT_EQ(s[i * lds + j], kSentinel) << "wrote past the columns at " << i << "," << j;
        continue;
      }
      double want = 0;
      for (int c = 0; c < depth; ++c) want += static_cast<double>(q[i * ldq + c]) * kt[c * ldk + j];
      ASSERT_NEAR(s[i * lds + j], scale * want, 1e-5 * (1 + depth)) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ScoresTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2"), ::testing::Values(1, 6, 7, 13),
                                            ::testing::Values(1, 17, 64, 65, 130), ::testing::Values(1, 67)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_rows" + std::to_string(std::get<1>(info.param)) +
                                  "_cols" + std::to_string(std::get<2>(info.param)) + "_depth" +
                                  std::to_string(std::get<3>(info.param));
                         });

// (isa, rows, n, vectors of width, with o_scale)
class ValuesTest : public ::testing::TestWithParam<std::tuple<std::string, int, int, int, bool>> {};

TEST_P(ValuesTest, MatchesPlainLoopsAndWritesOnlyTheOutput) {
  const auto& [isa, rows, n, vectors, rescale] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int width = vectors * k->lanes, ldp = n + 3, ldv = width + 9, ldo = width + 4;
  const std::vector<float> p = RandomVector(rows * ldp, 3), v = RandomVector(n * ldv, 4);
  const std::vector<float> o_scale = RandomVector(rows, 5);
  std::vector<float> o = RandomVector(rows * ldo, 6);
  for (int i = 0; i < rows; ++i) {
    for (int c = width; c < ldo; ++c) o[i * ldo + c] = kSentinel;
  }
  const std::vector<float> before = o;
  k->values(rows, n, width, p.data(), ldp, v.data(), ldv, rescale ? o_scale.data() : nullptr, o.data(), ldo);
  for (int i = 0; i < rows; ++i) {
    for (int c = 0; c < ldo; ++c) {
      if (c >= width) {
        ASSERT_EQ(o[i * ldo + c], kSentinel) << "wrote past the width at " << i << "," << c;
        continue;
      }
      double want = rescale ? static_cast<double>(o_scale[i]) * before[i * ldo + c] : 0.0;
      for (int j = 0; j < n; ++j) want += static_cast<double>(p[i * ldp + j]) * v[j * ldv + c];
      ASSERT_NEAR(o[i * ldo + c], want, 1e-5 * (1 + n)) << i << "," << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ValuesTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2"), ::testing::Values(1, 6, 7, 13),
                                            ::testing::Values(1, 256), ::testing::Values(1, 3, 4, 5, 9),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_rows" + std::to_string(std::get<1>(info.param)) +
                                  "_n" + std::to_string(std::get<2>(info.param)) + "_vectors" +
                                  std::to_string(std::get<3>(info.param)) +
                                  (std::get<4>(info.param) ? "_rescaled" : "_overwritten");
                         });

TEST(TileKernels, UnknownInstructionSetIsNull) { EXPECT_EQ(TileKernelsFor("sse9"), nullptr); }

TEST(TileKernels, Avx512IsOfferedExactlyWhenTheCpuHasIt) {
  __builtin_cpu_init();
  EXPECT_EQ(TileKernelsFor("avx512") != nullptr, __builtin_cpu_supports("avx512f") != 0);
}

}  // namespace
}  // namespace mha::kernels
