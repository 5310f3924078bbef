// The hand-written tile matmuls against plain loops, for every instruction set this CPU runs (others skip; the
// portable set runs everywhere), on sizes that cut the register blocks at every edge: rows not a multiple of the
// panel (at and between the heights of the shorter register blocks), columns and widths not a multiple of a vector
// or a block, strides wider than the data.
// Nothing outside the output rectangle may be written. The bf16 sets (amx, avx512bf16) round their operands to bf16:
// their plain loops round them the same way, so every set is held to fp32 accumulation error.
#include "server/backends/cpu/tile_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha::kernels {
namespace {

using ::mha::testing::RandomVector;

constexpr float kSentinel = 12345.0f;

// x rounded to bf16 (to nearest, ties to even) and back, as AVX512-BF16's conversions do; x finite.
float RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

// An operand as the kernels of `k` see it: itself, or rounded to bf16 by a set that packs bf16.
float AsOperand(const TileKernels& k, float x) { return k.elements_per_float == 2 ? RoundBf16(x) : x; }

// The shapes of the bf16 sets: depths and widths multiples of 32, rows and keys cutting amx's 32x32 blocks and
// avx512bf16's 12x32 (and shorter) register blocks.
const auto kBf16Sets = ::testing::Values("amx", "avx512bf16");
const auto kBf16Rows = ::testing::Values(1, 7, 16, 31, 32, 33, 70);

// (isa, rows, cols, depth)
class ScoresTest : public ::testing::TestWithParam<std::tuple<std::string, int, int, int>> {};

TEST_P(ScoresTest, MatchesPlainLoopsAndWritesOnlyTheOutput) {
  const auto& [isa, rows, cols, depth] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldq = depth + 3, lds = cols + 5, ldk = depth + 2;
  std::vector<float> q = RandomVector(rows * ldq, 1), keys = RandomVector(cols * ldk, 2);
  // Past each row's depth: NaN, which would poison the scores if a kernel read it.
  for (int i = 0; i < rows; ++i) {
    for (int c = depth; c < ldq; ++c) q[i * ldq + c] = std::numeric_limits<float>::quiet_NaN();
  }
  for (int j = 0; j < cols; ++j) {
    for (int c = depth; c < ldk; ++c) keys[j * ldk + c] = std::numeric_limits<float>::quiet_NaN();
  }
  const int panels = (cols + k->key_panel - 1) / k->key_panel;
  std::vector<float> kt(panels * k->key_panel * depth / k->elements_per_float + 1, kSentinel);
  k->pack_keys(cols, depth, keys.data(), ldk, kt.data());
  EXPECT_EQ(kt.back(), kSentinel) << "packing wrote past its panels";
  std::vector<float> s(rows * lds, kSentinel);
  const float scale = 0.37f;
  k->scores(rows, cols, depth, scale, q.data(), ldq, kt.data(), s.data(), lds);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < lds; ++j) {
      if (j >= cols) {
        ASSERT_EQ(s[i * lds + j], kSentinel) << "wrote past the columns at " << i << "," << j;
        continue;
      }
      double want = 0;
      for (int c = 0; c < depth; ++c) {
        want += static_cast<double>(AsOperand(*k, scale * q[i * ldq + c])) * AsOperand(*k, keys[j * ldk + c]);
      }
      ASSERT_NEAR(s[i * lds + j], want, 1e-5 * (1 + depth)) << i << "," << j;
    }
  }
}

// (isa, cols, depth)
class PackKeysTest : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(PackKeysTest, PackedKeysAreTransposedPanelsZeroPadded) {
  const auto& [isa, cols, depth] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldk = depth + 2, width = k->key_panel;
  const std::vector<float> keys = RandomVector(cols * ldk, 3);
  const int panels = (cols + width - 1) / width;
  std::vector<float> kt(panels * width * depth, kSentinel);
  k->pack_keys(cols, depth, keys.data(), ldk, kt.data());
  for (int p = 0; p < panels; ++p) {
    for (int c = 0; c < depth; ++c) {
      for (int x = 0; x < width; ++x) {
        const int j = p * width + x;
        ASSERT_EQ(kt[(p * depth + c) * width + x], j < cols ? keys[j * ldk + c] : 0.0f) << p << "," << c << "," << x;
      }
    }
  }
}

std::string ScoresName(const ::testing::TestParamInfo<ScoresTest::ParamType>& info) {
  const auto& [isa, rows, cols, depth] = info.param;
  return isa + "_rows" + std::to_string(rows) + "_cols" + std::to_string(cols) + "_depth" + std::to_string(depth);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ScoresTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"), ::testing::Values(1, 7, 8, 11, 13),
                                            ::testing::Values(1, 17, 64, 65, 130), ::testing::Values(1, 8, 67)),
                         ScoresName);

INSTANTIATE_TEST_SUITE_P(Bf16, ScoresTest,
                         ::testing::Combine(kBf16Sets, kBf16Rows,
                                            ::testing::Values(1, 17, 32, 64, 65, 130, 600),
                                            ::testing::Values(32, 64, 128)),
                         ScoresName);

INSTANTIATE_TEST_SUITE_P(Shapes, PackKeysTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"), ::testing::Values(1, 17, 64, 130),
                                            ::testing::Values(1, 8, 67)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_cols" + std::to_string(std::get<1>(info.param)) +
                                  "_depth" + std::to_string(std::get<2>(info.param));
                         });

// (isa, rows, n, width, with o_scale)
class ValuesTest : public ::testing::TestWithParam<std::tuple<std::string, int, int, int, bool>> {};

TEST_P(ValuesTest, MatchesPlainLoopsAndWritesOnlyTheOutput) {
  const auto& [isa, rows, n, width, rescale] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldp = n + 3, ldv = width + 9, ldo = width + 4;
  std::vector<float> p = RandomVector(rows * ldp, 3);
  const std::vector<float> v = RandomVector(n * ldv, 4);
  // Past each row's n probabilities: NaN, which would poison the output if a kernel read it.
  for (int i = 0; i < rows; ++i) {
    for (int j = n; j < ldp; ++j) p[i * ldp + j] = std::numeric_limits<float>::quiet_NaN();
  }
  const int panels = (width + k->value_panel - 1) / k->value_panel;
  const int padded_keys = (n + k->key_multiple - 1) / k->key_multiple * k->key_multiple;
  const int panel_floats = padded_keys * k->value_panel / k->elements_per_float, panel_stride = panel_floats + 5;
  std::vector<float> vp(panels * panel_stride, kSentinel);
  k->pack_values(n, width, v.data(), ldv, vp.data(), panel_stride);
  for (int q = 0; q < panels; ++q) {
    for (int x = panel_floats; x < panel_stride; ++x) {
      ASSERT_EQ(vp[q * panel_stride + x], kSentinel) << "packing wrote past panel " << q;
    }
  }
  for (int q = 0; q < panels && k->elements_per_float == 1; ++q) {  // the fp32 layout; the bf16 sets' is their own
    for (int j = 0; j < n; ++j) {
      for (int x = 0; x < k->value_panel; ++x) {
        const int c = q * k->value_panel + x;
        ASSERT_EQ(vp[q * panel_stride + j * k->value_panel + x], c < width ? v[j * ldv + c] : 0.0f) << q << "," << j;
      }
    }
  }
  const std::vector<float> o_scale = RandomVector(rows, 5);
  std::vector<float> o = RandomVector(rows * ldo, 6);
  for (int i = 0; i < rows; ++i) {
    for (int c = width; c < ldo; ++c) o[i * ldo + c] = kSentinel;
  }
  const std::vector<float> before = o;
  k->values(rows, n, width, p.data(), ldp, vp.data(), panel_stride, rescale ? o_scale.data() : nullptr, o.data(),
            ldo);
  for (int i = 0; i < rows; ++i) {
    for (int c = 0; c < ldo; ++c) {
      if (c >= width) {
        ASSERT_EQ(o[i * ldo + c], kSentinel) << "wrote past the width at " << i << "," << c;
        continue;
      }
      double want = rescale ? static_cast<double>(o_scale[i]) * before[i * ldo + c] : 0.0;
      for (int j = 0; j < n; ++j) {
        want += static_cast<double>(AsOperand(*k, p[i * ldp + j])) * AsOperand(*k, v[j * ldv + c]);
      }
      ASSERT_NEAR(o[i * ldo + c], want, 1e-5 * (1 + n)) << i << "," << c;
    }
  }
}

std::string ValuesName(const ::testing::TestParamInfo<ValuesTest::ParamType>& info) {
  const auto& [isa, rows, n, width, rescaled] = info.param;
  return isa + "_rows" + std::to_string(rows) + "_n" + std::to_string(n) + "_width" + std::to_string(width) +
         (rescaled ? "_rescaled" : "");
}

INSTANTIATE_TEST_SUITE_P(Shapes, ValuesTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"),
                                            ::testing::Values(1, 7, 8, 13), ::testing::Values(1, 256),
                                            ::testing::Values(1, 5, 12, 16, 33, 48, 80),
                                            ::testing::Bool()),
                         ValuesName);

INSTANTIATE_TEST_SUITE_P(Bf16, ValuesTest,
                         ::testing::Combine(kBf16Sets, kBf16Rows,
                                            ::testing::Values(1, 33, 256, 600), ::testing::Values(32, 64, 128),
                                            ::testing::Bool()),
                         ValuesName);

constexpr float kInf = std::numeric_limits<float>::infinity();

// Row r of a [rows, n] score tile: random values in [-20, 20], every seventh -inf (an additive mask).
std::vector<float> MaskedScores(int rows, int n, uint32_t seed) {
  std::vector<float> s = RandomVector(rows * n, seed, 20.0f);
  for (size_t i = 0; i < s.size(); i += 7) s[i] = -kInf;
  return s;
}

// (isa, scores in log2 units): each weight is then 2^(s - max), else e^(s - max) (tile_kernels.h).
class SoftmaxTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  // The weight of x = s - max, in double precision.
  double Weight(double x) const { return std::get<1>(GetParam()) ? std::exp2(x) : std::exp(x); }
  // How far (relative) the online softmax's weights may be from Weight: the bf16 sets' exps keep bf16's precision
  // only (degree-3 fits, 7.5e-5), the fp32 sets' fp32's (degree 5, 2e-7), each plus float rounding.
  double OnlineBound() const {
    const std::string& isa = std::get<0>(GetParam());
    return isa == "amx" || isa == "avx512bf16" ? 8e-5 : 3e-7;
  }
  // Runs the exact softmax on `visible.size()` rows of MaskedScores (row stride lds) and checks every element:
  // weights within 1e-6 of double precision's, exactly 0 where masked, untouched at and past n.
  void CheckExactSoftmax(int n, int lds, const std::vector<int64_t>& visible) const {
    const auto& [isa, log2] = GetParam();
    const TileKernels* k = TileKernelsFor(isa.c_str());
    if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
    const int rows = static_cast<int>(visible.size());
    std::vector<float> s = MaskedScores(rows, lds, 7);
    s[1 * lds] = -kInf;  // row 1 sees one key, and it is masked: all zeros, not NaN
    const std::vector<float> in = s;
    k->softmax(rows, n, visible.data(), s.data(), lds, log2);
    for (int r = 0; r < rows; ++r) {
      double max = -kInf, sum = 0;
      for (int j = 0; j < visible[r]; ++j) max = std::max<double>(max, in[r * lds + j]);
      for (int j = 0; j < visible[r] && max != -kInf; ++j) sum += Weight(in[r * lds + j] - max);
      for (int j = 0; j < lds; ++j) {
        const float got = s[r * lds + j];
        if (j >= n) {
          EXPECT_EQ(got, in[r * lds + j]) << "wrote past n at " << r << "," << j;
        } else if (j >= visible[r] || max == -kInf || in[r * lds + j] == -kInf) {
          EXPECT_EQ(got, 0.0f) << r << "," << j;  // masked: exactly zero
        } else {
          EXPECT_NEAR(got, Weight(in[r * lds + j] - max) / sum, 1e-6) << r << "," << j;
        }
      }
    }
  }
};

TEST_P(SoftmaxTest, ExactSoftmaxOverVisibleKeysZeroesTheRest) {
  const int n = 45;
  CheckExactSoftmax(n, /*lds=*/50, {0, 1, 15, 16, 17, 33, n});
}

// Masked runs of 256 keys and more are zeroed with non-temporal stores from their first whole cache line: runs of
// 256 and more that start at many offsets within a line (lds = 709 moves each row's start), and end off a vector.
TEST_P(SoftmaxTest, LongMaskedRunsAreZeroedUpToNAndNoFurther) {
  const int n = 700;
  CheckExactSoftmax(n, /*lds=*/709, {0, 1, 100, 255, 256, 300, 437, 444, n - 256, n});
}

TEST_P(SoftmaxTest, OnlineBlocksGiveTheExactWeightedSum) {
  // FlashAttention's recurrence over blocks of 40 and 37 keys, on a value of j for key j: the carried max, sum
  // and factors must reproduce softmax(s) . v, also for rows that see nothing in the first block (all -inf) or
  // nothing at all.
  const auto& [isa, log2] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int n = 77, rows = 4;
  std::vector<float> s = MaskedScores(rows, n, 9);
  for (int j = 0; j < 40; ++j) s[2 * n + j] = -kInf;  // row 2: first block fully masked
  const std::vector<int64_t> visible = {n, 50, n, 0};
  const std::vector<float> in = s;
  std::vector<float> row_max(rows, -kInf), row_sum(rows, 0.0f), factor(rows), out(rows, 0.0f);
  for (int j0 = 0; j0 < n; j0 += 40) {
    const int len = std::min(40, n - j0);
    std::vector<float> block(rows * len);
    std::vector<int64_t> block_visible(rows);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < len; ++j) block[r * len + j] = in[r * n + j0 + j];
      block_visible[r] = std::clamp<int64_t>(visible[r] - j0, 0, len);
    }
    k->online_softmax(rows, len, block_visible.data(), block.data(), len, row_max.data(), row_sum.data(),
                      factor.data(), log2);
    for (int r = 0; r < rows; ++r) {
      double add = 0;
      for (int j = 0; j < len; ++j) add += block[r * len + j] * static_cast<double>(j0 + j);
      out[r] = static_cast<float>(out[r] * factor[r] + add);
    }
  }
  for (int r = 0; r < rows; ++r) {
    double max = -kInf, sum = 0, weighted = 0;
    for (int j = 0; j < visible[r]; ++j) max = std::max<double>(max, in[r * n + j]);
    for (int j = 0; j < visible[r] && max != -kInf; ++j) {
      sum += Weight(in[r * n + j] - max);
      weighted += Weight(in[r * n + j] - max) * j;
    }
    if (sum == 0) {
      EXPECT_EQ(row_sum[r], 0.0f) << r;
      EXPECT_EQ(out[r], 0.0f) << r;
      continue;
    }
    EXPECT_FLOAT_EQ(row_max[r], static_cast<float>(max)) << r;
    EXPECT_NEAR(row_sum[r], sum, std::max(1e-5, OnlineBound()) * sum) << r;
    // A mean of key indices below n: weights off by OnlineBound move it by at most 2 * OnlineBound * n.
    EXPECT_NEAR(out[r] / row_sum[r], weighted / sum, std::max(1e-4, 2 * OnlineBound() * n)) << r;
  }
}

TEST_P(SoftmaxTest, OnlineBlockWeightIsWithinItsBoundOfLibm) {
  // The first block of a row leaves weight(s - max) in place: s - max from 0 down to near the smallest normal
  // result (-87 for e^x, -125 for 2^x), against double-precision exp or exp2, within OnlineBound; -inf and a value
  // below the normal range must give exactly 0.
  const auto& [isa, log2] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int n = 20001;
  const float range = log2 ? 125.0f : 87.0f;
  std::vector<float> s(n);
  for (int j = 0; j < n; ++j) s[j] = 1.5f - range * static_cast<float>(j) / (n - 1);  // 1.5 (the max) .. 1.5 - range
  s[n / 2] = -kInf;
  s[n / 3] = -1.13f * range;
  const std::vector<float> in = s;
  const int64_t visible = n;
  float row_max = -kInf, row_sum = 0.0f, factor = -1.0f;
  k->online_softmax(1, n, &visible, s.data(), n, &row_max, &row_sum, &factor, log2);
  EXPECT_EQ(row_max, 1.5f);
  EXPECT_EQ(factor, 0.0f);  // the row's first visible block
  EXPECT_EQ(s[n / 2], 0.0f);
  EXPECT_EQ(s[n / 3], 0.0f);
  double sum = 0;
  for (int j = 0; j < n; ++j) {
    if (j == n / 2 || j == n / 3) continue;
    const double want = Weight(static_cast<double>(in[j]) - 1.5);
    sum += want;
    EXPECT_NEAR(s[j], want, OnlineBound() * want) << "weight(" << in[j] - 1.5f << ")";
  }
  EXPECT_NEAR(row_sum, sum, std::max(1e-6, OnlineBound()) * sum);
}

INSTANTIATE_TEST_SUITE_P(Isas, SoftmaxTest,
                         ::testing::Combine(::testing::Values("amx", "avx512bf16", "avx512", "avx2", "portable"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_log2" : "_natural");
                         });

// (isa, rows, cols)
class CopyScaledTest : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(CopyScaledTest, ScalesEveryElementAndWritesNothingElse) {
  const auto& [isa, rows, cols] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int lds = cols + 3, ldc = cols + 2;
  const std::vector<float> src = RandomVector(rows * lds, 11);
  std::vector<float> copied(rows * ldc, kSentinel);
  k->copy_scaled(rows, cols, 0.5f, src.data(), lds, copied.data(), ldc);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ldc; ++c) {
      ASSERT_EQ(copied[r * ldc + c], c < cols ? 0.5f * src[r * lds + c] : kSentinel) << r << "," << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CopyScaledTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"), ::testing::Values(1, 13),
                                            ::testing::Values(1, 16, 21, 64)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_rows" + std::to_string(std::get<1>(info.param)) +
                                  "_cols" + std::to_string(std::get<2>(info.param));
                         });

// (isa, n)
class AddTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(AddTest, AddsExactlyNElements) {
  const auto& [isa, n] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const std::vector<float> y = RandomVector(n + 1, 7);
  std::vector<float> x = RandomVector(n + 1, 8);
  const std::vector<float> before = x;
  k->add(n, y.data(), x.data());
  for (int j = 0; j < n; ++j) ASSERT_EQ(x[j], before[j] + y[j]) << j;
  EXPECT_EQ(x[n], before[n]) << "wrote past n";
}

INSTANTIATE_TEST_SUITE_P(Lengths, AddTest,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"),
                                            ::testing::Values(0, 1, 15, 16, 17, 100)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param));
                         });

// (isa, length): whole vectors of 32 and every kind of tail.
class ToBf16Test : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ToBf16Test, RoundsToNearestEvenAndWritesExactlyN) {
  const auto& [isa, n] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU (or its kernel) does not run " << isa;
  std::vector<float> src = RandomVector(n, 9, 100.0f);
  // Ties (an odd and an even bf16 neighbour), NaN and infinities where they fit.
  const float special[] = {1.00390625f, 1.01171875f, std::numeric_limits<float>::quiet_NaN(), -kInf, kInf};
  for (int j = 0; j < n && j < 5; ++j) src[j] = special[j];
  std::vector<uint16_t> dst(n + 1, 0xabcd);
  k->to_bf16(n, src.data(), dst.data());
  for (int j = 0; j < n; ++j) {
    if (std::isnan(src[j])) {
      EXPECT_EQ(dst[j] & 0x7f80, 0x7f80) << j;
      EXPECT_NE(dst[j] & 0x7f, 0) << "NaN must stay NaN at " << j;
      continue;
    }
    float back;
    const uint32_t bits = uint32_t{dst[j]} << 16;
    std::memcpy(&back, &bits, sizeof(back));
    EXPECT_EQ(back, RoundBf16(src[j])) << j << ": " << src[j];
  }
  EXPECT_EQ(dst[n], 0xabcd) << "wrote past n";
}

INSTANTIATE_TEST_SUITE_P(Lengths, ToBf16Test,
                         ::testing::Combine(kBf16Sets, ::testing::Values(0, 1, 5, 16, 17, 31, 32, 33, 100)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param));
                         });

// bf16 bits of x (x already a bf16 value).
uint16_t Bf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

float FromBf16Bits(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// (isa, keys, depth or width): bf16 sources, with row strides wider than the data.
class Bf16SourceTest : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {
 protected:
  // n rows of `width` bf16 values (stride ld) as fp32 and as bf16 bits.
  static void Rows(int n, int width, int ld, uint32_t seed, std::vector<float>* fp32, std::vector<uint16_t>* bf16) {
    *fp32 = RandomVector(n * ld, seed);
    bf16->assign(n * ld, 0);
    for (int i = 0; i < n * ld; ++i) {
      (*fp32)[i] = RoundBf16((*fp32)[i]);
      (*bf16)[i] = Bf16Bits((*fp32)[i]);
    }
  }
};

TEST_P(Bf16SourceTest, PackingKeysFromBf16GivesThePackingOfTheSameValuesInFp32) {
  const auto& [isa, n, depth] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldk = depth + 2;
  std::vector<float> keys;
  std::vector<uint16_t> keys16;
  Rows(n, depth, ldk, 21, &keys, &keys16);
  const int floats = (n + k->key_panel - 1) / k->key_panel * k->key_panel * depth / k->elements_per_float;
  std::vector<float> want(floats + 16, kSentinel), got(floats + 16, kSentinel);
  k->pack_keys(n, depth, keys.data(), ldk, want.data());
  k->pack_keys_bf16(n, depth, keys16.data(), ldk, got.data());
  ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
  for (int i = floats; i < floats + 16; ++i) ASSERT_EQ(got[i], kSentinel) << "wrote past the panels at " << i;
}

TEST_P(Bf16SourceTest, PackingValuesFromBf16GivesThePackingOfTheSameValuesInFp32) {
  const auto& [isa, n, width] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int ldv = width + 9;
  std::vector<float> values;
  std::vector<uint16_t> values16;
  Rows(n, width, ldv, 22, &values, &values16);
  const int panels = width / k->value_panel;
  const int padded_keys = (n + k->key_multiple - 1) / k->key_multiple * k->key_multiple;
  const int panel_stride = padded_keys * k->value_panel / k->elements_per_float + 5;
  std::vector<float> want(panels * panel_stride, kSentinel), got(panels * panel_stride, kSentinel);
  k->pack_values(n, width, values.data(), ldv, want.data(), panel_stride);
  k->pack_values_bf16(n, width, values16.data(), ldv, got.data(), panel_stride);
  ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));  // the gaps' sentinels too
}

TEST_P(Bf16SourceTest, CopyScaledFromBf16ScalesEveryElementAndWritesNothingElse) {
  const auto& [isa, rows, cols] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int lds = cols + 3, ldc = cols + 2;
  std::vector<float> src;
  std::vector<uint16_t> src16;
  Rows(rows, cols, lds, 23, &src, &src16);
  std::vector<float> copied(rows * ldc, kSentinel);
  k->copy_scaled_bf16(rows, cols, 0.375f, src16.data(), lds, copied.data(), ldc);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ldc; ++c) {
      ASSERT_EQ(copied[r * ldc + c], c < cols ? 0.375f * src[r * lds + c] : kSentinel) << r << "," << c;
    }
  }
}

TEST_P(Bf16SourceTest, CopyScaledToBf16RoundsEveryScaledElementAndWritesNothingElse) {
  const auto& [isa, rows, cols] = GetParam();
  const TileKernels* k = TileKernelsFor(isa.c_str());
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run " << isa;
  const int lds = cols + 3, ldc = cols + 2;
  const std::vector<float> src = RandomVector(rows * lds, 24, 10.0f);
  std::vector<uint16_t> copied(rows * ldc, 0xabcd);
  k->copy_scaled_to_bf16(rows, cols, 0.3f, src.data(), lds, copied.data(), ldc);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < ldc; ++c) {
      if (c >= cols) {
        ASSERT_EQ(copied[r * ldc + c], 0xabcd) << "wrote past the columns at " << r << "," << c;
      } else {
        ASSERT_EQ(FromBf16Bits(copied[r * ldc + c]), RoundBf16(0.3f * src[r * lds + c])) << r << "," << c;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16SourceTest,
                         ::testing::Combine(kBf16Sets, ::testing::Values(1, 17, 32, 33, 130),
                                            ::testing::Values(32, 64, 128)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param)) + "_" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(TileKernels, Fp32SetsHaveNoBf16Conversions) {
  for (const char* isa : {"avx512", "avx2", "portable"}) {
    if (const TileKernels* k = TileKernelsFor(isa); k != nullptr) {
      EXPECT_EQ(k->to_bf16, nullptr) << isa;
      EXPECT_EQ(k->pack_keys_bf16, nullptr) << isa;
      EXPECT_EQ(k->pack_values_bf16, nullptr) << isa;
      EXPECT_EQ(k->copy_scaled_bf16, nullptr) << isa;
      EXPECT_EQ(k->copy_scaled_to_bf16, nullptr) << isa;
    }
  }
}

TEST(TileKernels, UnknownInstructionSetIsNull) { EXPECT_EQ(TileKernelsFor("sse9"), nullptr); }

TEST(TileKernels, PortableIsOfferedEverywhere) { EXPECT_NE(TileKernelsFor("portable"), nullptr); }

TEST(TileKernels, AmxIsOfferedOnlyWhereTheCpuHasAmxBf16) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-bf16")) {
    EXPECT_EQ(TileKernelsFor("amx"), nullptr);
  }
  if (TileKernelsFor("amx") == nullptr) GTEST_SKIP() << "this CPU (or its kernel) does not run amx";
  EXPECT_EQ(TileKernelsFor("amx")->elements_per_float, 2);
}

TEST(TileKernels, Avx512Bf16IsOfferedExactlyWhenTheCpuHasIt) {
  __builtin_cpu_init();
  const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512bf16");
  const TileKernels* k = TileKernelsFor("avx512bf16");
  ASSERT_EQ(k != nullptr, has);
  if (k == nullptr) GTEST_SKIP() << "this CPU does not run avx512bf16";
  EXPECT_EQ(k->elements_per_float, 2);
  EXPECT_EQ(k->lanes, 32);
}

TEST(TileKernels, Avx512IsOfferedExactlyWhenTheCpuHasIt) {
  __builtin_cpu_init();
  EXPECT_EQ(TileKernelsFor("avx512") != nullptr,
            __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0);
}

}  // namespace
}  // namespace mha::kernels
