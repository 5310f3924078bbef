// The 8-bit KV caches (server/backends/quantized_cache.h): the FP8 codecs, the scales, the requantization of a
// block's keys, and the accuracy a decode token keeps through each 8-bit cache on every CPU kernel set (and the
// reference backend), against float64 attention over the values before quantization.
#include "server/backends/quantized_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"
#include "server/backends/registry.h"

namespace mha {
namespace {

using quant::DecodeE4m3;
using quant::DecodeE5m2;
using quant::EncodeE4m3;
using quant::EncodeE5m2;

TEST(Fp8, EveryFiniteCodeDecodesAndEncodesBackToItself) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t c = static_cast<uint8_t>(code);
    if ((c & 0x7f) != 0x7f) {
      EXPECT_EQ(EncodeE4m3(DecodeE4m3(c)), c == 0x80 ? 0x80 : c) << code;
    }
    if ((c & 0x7f) < 0x7c) {
      EXPECT_EQ(EncodeE5m2(DecodeE5m2(c)), c) << code;
    }
  }
}

TEST(Fp8, KnownValues) {
  EXPECT_EQ(DecodeE4m3(0x7e), 448.0f);
  EXPECT_EQ(DecodeE4m3(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(DecodeE4m3(0x38), 1.0f);
  EXPECT_EQ(DecodeE5m2(0x7b), 57344.0f);
  EXPECT_EQ(DecodeE5m2(0x3c), 1.0f);
  EXPECT_EQ(DecodeE5m2(0x01), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(DecodeE5m2(0x7c)));
  EXPECT_TRUE(std::isnan(DecodeE4m3(0x7f)));
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  // 1 + 1/16 lies halfway between E4M3's 1 (mantissa 0, even) and 1.125 (mantissa 1): to 1.
  EXPECT_EQ(DecodeE4m3(EncodeE4m3(1.0625f)), 1.0f);
  // 1.125 + 1/16 lies halfway between 1.125 (odd) and 1.25 (even): to 1.25.
  EXPECT_EQ(DecodeE4m3(EncodeE4m3(1.1875f)), 1.25f);
  EXPECT_EQ(DecodeE4m3(EncodeE4m3(1e9f)), 448.0f);
  EXPECT_EQ(DecodeE4m3(EncodeE4m3(-1e9f)), -448.0f);
  EXPECT_EQ(DecodeE5m2(EncodeE5m2(1e9f)), 57344.0f);
  EXPECT_EQ(DecodeE4m3(EncodeE4m3(1e-30f)), 0.0f);
}

// The code a search over every finite code picks for x: the nearest value, ties to the even code, saturating.
uint8_t NearestCode(float x, float (*decode)(uint8_t), int max_code) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= decode(static_cast<uint8_t>(max_code))) return sign | static_cast<uint8_t>(max_code);
  int best = 0;
  for (int code = 1; code <= max_code; ++code) {
    const double d = std::fabs(decode(static_cast<uint8_t>(code)) - a), best_d = std::fabs(decode(best) - a);
    if (d < best_d || (d == best_d && code % 2 == 0)) best = code;
  }
  return sign | static_cast<uint8_t>(best);
}

struct Fp8Format {
  const char* name;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
  int max_code;
};

class Fp8EncodeTest : public ::testing::TestWithParam<Fp8Format> {};

// Every code's value, the midpoints between neighbours and the floats next to them, and random floats of every
// scale from far below the smallest subnormal to past the largest value, of both signs.
TEST_P(Fp8EncodeTest, EveryFloatTakesTheNearestCodeTiesToEven) {
  const Fp8Format& f = GetParam();
  std::vector<float> xs = {0.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min()};
  for (int code = 0; code <= f.max_code; ++code) {
    const float value = f.decode(static_cast<uint8_t>(code));
    const float next = code < f.max_code ? f.decode(static_cast<uint8_t>(code + 1)) : 2 * value;
    const float middle = (value + next) / 2;  // exact: neighbours differ in a few low bits
    xs.insert(xs.end(), {value, middle, std::nextafter(middle, 0.0f), std::nextafter(middle, next)});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::ldexp(mantissa(rng), exponent(rng)));
  for (const float x : xs) {
    for (const float signed_x : {x, -x}) {
      ASSERT_EQ(f.encode(signed_x), NearestCode(signed_x, f.decode, f.max_code)) << f.name << " " << signed_x;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8EncodeTest,
                         ::testing::Values(Fp8Format{"e4m3", &EncodeE4m3, &DecodeE4m3, 0x7e},
                                           Fp8Format{"e5m2", &EncodeE5m2, &DecodeE5m2, 0x7b}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Scales, RoundUpToBf16SoThatTheLargestValueFits) {
  for (float x : {1.0f, 0.3f, 1.0f / 127, 3e-20f, 7777.7f}) {
    const float scale = quant::ScaleValue(quant::ScaleBits(x));
    EXPECT_GE(scale, x);
    EXPECT_LE(scale, x * (1 + 1.0f / 128)) << x;
  }
  EXPECT_EQ(quant::ScaleValue(quant::ScaleBits(0.0f)), 0.0f);
}

KvCacheLayout Layout(v1::DataType dtype, int64_t head_dim = 16, int64_t block_tokens = 16) {
  return {2, head_dim, block_tokens, dtype};
}

class QuantizedBlockTest : public ::testing::TestWithParam<v1::DataType> {};

// Keys and values read back within half a code of their scale, the scale of each channel (keys) or token (values).
TEST_P(QuantizedBlockTest, ReadsBackWithinHalfACode) {
  const KvCacheLayout c = Layout(GetParam(), 17);
  std::vector<char> block(c.BlockBytes());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(16 * 17), v(16 * 17);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  quant::WriteTokens(c, block.data(), 1, 0, 16, k.data(), 17, v.data(), 17);
  const double relative = GetParam() == v1::INT8 ? 0.5 / 127 : GetParam() == v1::FP8_E4M3 ? 1.0 / 16 : 1.0 / 8;
  for (int64_t j = 0; j < 16; ++j) {
    float kmax = 0, vmax = 0;
    for (int64_t t = 0; t < 16; ++t) kmax = std::max(kmax, std::fabs(k[t * 17 + j % 17]));
    for (int64_t c2 = 0; c2 < 17; ++c2) vmax = std::max(vmax, std::fabs(v[j * 17 + c2]));
    for (int64_t d = 0; d < 17; ++d) {
      float channel_max = 0;
      for (int64_t t = 0; t < 16; ++t) channel_max = std::max(channel_max, std::fabs(k[t * 17 + d]));
      const double key_bound = GetParam() == v1::INT8 ? relative * channel_max * 1.01
                                                      : relative * std::fabs(k[j * 17 + d]) + 1e-6 * channel_max;
      EXPECT_NEAR(quant::KeyAt(c, block.data(), 1, j, d), k[j * 17 + d], key_bound) << j << "," << d;
      const double value_bound =
          GetParam() == v1::INT8 ? relative * vmax * 1.01 : relative * std::fabs(v[j * 17 + d]) + 1e-6 * vmax;
      EXPECT_NEAR(quant::ValueAt(c, block.data(), 1, j, d), v[j * 17 + d], value_bound) << j << "," << d;
    }
  }
}

// A key larger than its channel's scale allows grows the scale and requantizes the block's earlier keys of that
// channel: they stay within a code of the grown scale (two roundings), and a channel that did not grow is untouched.
TEST_P(QuantizedBlockTest, AGrowingChannelRequantizesItsEarlierKeys) {
  const KvCacheLayout c = Layout(GetParam());
  std::vector<char> block(c.BlockBytes());
  std::vector<float> first(16, 0.5f), second(16, 0.25f), v(16, 1.0f);
  first[3] = 0.3f;
  second[3] = 6.0f;  // channel 3 grows twentyfold
  quant::WriteTokens(c, block.data(), 0, 0, 1, first.data(), 16, v.data(), 16);
  const float before = quant::KeyAt(c, block.data(), 0, 0, 5);
  quant::WriteTokens(c, block.data(), 0, 1, 1, second.data(), 16, v.data(), 16);
  EXPECT_EQ(quant::KeyAt(c, block.data(), 0, 0, 5), before) << "a channel whose scale held";
  EXPECT_NEAR(quant::KeyAt(c, block.data(), 0, 1, 3), 6.0f, 6.0 / 16);
  const double code = 6.0 / quant::MaxCode(GetParam());
  EXPECT_NEAR(quant::KeyAt(c, block.data(), 0, 0, 3), 0.3f, GetParam() == v1::INT8 ? code : 0.3 / 8 + code);
}

// A block written again from slot 0 (a truncation back to its start) takes its scales from the new tokens alone.
TEST_P(QuantizedBlockTest, SlotZeroForgetsTheBlocksOldScales) {
  const KvCacheLayout c = Layout(GetParam());
  std::vector<char> block(c.BlockBytes());
  std::vector<float> big(16, 100.0f), small(16, 0.01f);
  quant::WriteTokens(c, block.data(), 0, 0, 1, big.data(), 16, big.data(), 16);
  quant::WriteTokens(c, block.data(), 0, 0, 1, small.data(), 16, small.data(), 16);
  EXPECT_NEAR(quant::KeyAt(c, block.data(), 0, 0, 7), 0.01f, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizedBlockTest, ::testing::Values(v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2),
                         [](const auto& info) { return DTypeName(info.param); });

// ---------------------------------------------------------------------------------------------------------------
// The INT8 decode kernels of every instruction set this CPU runs sum the same integers: equal scores, and values
// equal but for the last rounding (a fused multiply-add or not). The AVX-512 set's kernels without VNNI are reached
// here directly, since where VNNI exists the server takes VNNI's.

}  // namespace
namespace kernels {
namespace avx512 {
extern const PagedKernels kPagedKernels[kPagedDtypes];
}
namespace avx2 {
extern const PagedKernels kPagedKernels[kPagedDtypes];
}
namespace portable {
extern const PagedKernels kPagedKernels[kPagedDtypes];
}
namespace avx512vnni {
extern const PagedKernels kInt8PagedKernels;
}
namespace avx512bf16 {
extern const PagedKernels kFp8PagedKernels[2];  // E4M3, E5M2
}
}  // namespace kernels
namespace {

struct Int8Set {
  const char* name;
  const kernels::PagedKernels* kernels;
  bool runs;
};

std::vector<Int8Set> Int8Sets() {
  __builtin_cpu_init();
  const bool avx512 = kernels::TileKernelsFor("avx512") != nullptr;
  return {{"portable", &kernels::portable::kPagedKernels[v1::INT8 - 1], true},
          {"avx2", &kernels::avx2::kPagedKernels[v1::INT8 - 1], kernels::TileKernelsFor("avx2") != nullptr},
          {"avx512", &kernels::avx512::kPagedKernels[v1::INT8 - 1], avx512},
          {"avx512vnni", &kernels::avx512vnni::kInt8PagedKernels,
           avx512 && __builtin_cpu_supports("avx512vnni")}};
}

// One INT8 block's scores and values on every set that runs here, at a depth of the parameter.
struct Int8Outputs {
  std::vector<float> s, o;
};

class Int8KernelsTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    depth_ = GetParam();
    std::vector<float> k(32 * depth_), v(32 * depth_);
    q_.resize(5 * depth_);
    for (auto* x : {&k, &v, &q_}) {
      for (float& e : *x) e = normal_(rng_);
    }
    for (float& e : p_) e = std::fabs(normal_(rng_));
    block_.resize(cache_.BlockBytes());
    quant::WriteTokens(cache_, block_.data(), 0, 0, 32, k.data(), depth_, v.data(), depth_);
  }
  // value_keys: 29 rounds the weights row by row; 32 (whole vectors), four rows at once on the AVX-512 sets.
  Int8Outputs Run(const kernels::PagedKernels& set, int64_t value_keys = 29) const {
    const char* key_part = block_.data() + cache_.KeyPart(0);
    const char* value_part = block_.data() + cache_.ValuePart(0);
    const auto* value_scales = reinterpret_cast<const uint16_t*>(value_part + quant::ValueScalesOffset(cache_));
    const std::vector<float> o_scale = {0.5f, 1.0f, 2.0f, 0.0f, 1.5f};
    Int8Outputs out{std::vector<float>(5 * 32), std::vector<float>(5 * depth_, 1.0f)};
    set.scores(5, 32, depth_, q_.data(), depth_, key_part, 32, KeyScales(), out.s.data(), 32, nullptr, 0);
    set.values(5, value_keys, depth_, p_.data(), 32, value_part, value_scales, o_scale.data(), out.o.data(), depth_,
               nullptr, 0);
    return out;
  }
  const uint16_t* KeyScales() const {
    return reinterpret_cast<const uint16_t*>(block_.data() + cache_.KeyPart(0) + quant::KeyScalesOffset(cache_));
  }
  // Score (r, j) as the VNNI set defines it, over rows' groups of four (the 5 rows: 0-3 and 4): row r of q times the
  // key scales; the depths whose largest |value| over the group reaches half the group's largest (when at most 16
  // do) kept in fp32, the others rounded to int8 codes at 127 over the smaller of the row's largest magnitude and
  // theirs over the group (fp32 operations in the kernel's order), times key j's codes, summed exactly.
  double QuadScore(int64_t r, int64_t j) const {
    const int64_t first = r / 4 * 4, last = std::min<int64_t>(first + 4, 5);
    std::vector<float> x(depth_), column(depth_, 0.0f);
    for (int64_t row = first; row < last; ++row) {
      for (int64_t c = 0; c < depth_; ++c) {
        const float e = q_[row * depth_ + c] * quant::ScaleValue(KeyScales()[c]);
        column[c] = std::max(column[c], std::fabs(e));
        if (row == r) x[c] = e;
      }
    }
    const float half = 0.5f * *std::max_element(column.begin(), column.end());
    std::vector<bool> apart(depth_);
    float rest = 0;
    int64_t count = 0;
    for (int64_t c = 0; c < depth_; ++c) {
      apart[c] = column[c] >= half;
      count += apart[c] ? 1 : 0;
      if (!apart[c]) rest = std::max(rest, column[c]);
    }
    float amax = 0;
    for (int64_t c = 0; c < depth_; ++c) amax = std::max(amax, std::fabs(x[c]));
    const bool split = count <= 16 && half > 0;
    if (split) amax = std::min(amax, rest);
    const float mul = 127.0f / amax;
    int64_t sum = 0;
    double kept = 0;
    for (int64_t c = 0; c < depth_; ++c) {
      const auto code = static_cast<int8_t>(block_[cache_.KeyPart(0) + quant::KeyCodeOffset(cache_, c, j)]);
      if (split && apart[c]) {
        kept += static_cast<double>(x[c]) * code;
      } else {
        sum += static_cast<int64_t>(std::nearbyint(x[c] * mul)) * code;
      }
    }
    return static_cast<double>(sum) * (amax / 127.0f) + kept;
  }

  // How far score (r, j) may move when row r's q (times the key scales) is rounded to int8 instead of int16: half
  // of each step times the sum of key j's |codes|.
  double QRoundingBound(int64_t r, int64_t j) const {
    double amax = 0, codes = 0;
    for (int64_t c = 0; c < depth_; ++c) {
      amax = std::max(amax, std::fabs(static_cast<double>(q_[r * depth_ + c]) * quant::ScaleValue(KeyScales()[c])));
      codes += std::abs(static_cast<int8_t>(block_[cache_.KeyPart(0) + quant::KeyCodeOffset(cache_, c, j)]));
    }
    return 0.5 * (amax / 127 + amax / 32767) * codes * (1 + 1e-5);
  }

  int64_t depth_ = 0;
  KvCacheLayout cache_{1, GetParam(), 32, v1::INT8};
  std::mt19937 rng_{5};
  std::normal_distribution<float> normal_;
  std::vector<float> q_, p_ = std::vector<float>(5 * 32);
  std::vector<char> block_;
};

// The sets that multiply q's int16 codes in pairs of depths (portable, AVX2, AVX-512) agree exactly, and every
// set's values agree (the same byte codes of the weights).
TEST_P(Int8KernelsTest, EverySetComputesTheSameSums) {
  for (const int64_t value_keys : {29, 32}) {
    std::vector<float> want_s, want_o;
    for (const Int8Set& set : Int8Sets()) {
      if (!set.runs) continue;
      const Int8Outputs out = Run(*set.kernels, value_keys);
      if (want_s.empty()) {
        want_s = out.s;
        want_o = out.o;
        continue;
      }
      if (std::string(set.name) != "avx512vnni") {
        EXPECT_EQ(out.s, want_s) << set.name;
      }
      for (size_t i = 0; i < out.o.size(); ++i) {
        EXPECT_NEAR(out.o[i], want_o[i], 1e-5 * (1 + std::fabs(want_o[i]))) << set.name << " keys " << value_keys;
      }
    }
  }
}

// AVX512-VNNI multiplies four depths at once in bytes (vpdpbusd): its scores are q's int8 codes times the keys',
// key by key in order, plus its largest depths in fp32, and differ from the int16 sets' by that rounding only.
TEST_P(Int8KernelsTest, VnniScoresAreQsInt8CodesTimesTheKeys) {
  const std::vector<Int8Set> sets = Int8Sets();
  if (!sets.back().runs) GTEST_SKIP() << "this CPU has no AVX512-VNNI";
  const Int8Outputs pairs = Run(*sets.front().kernels), quads = Run(*sets.back().kernels);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t j = 0; j < 32; ++j) {
      const double want = QuadScore(r, j);
      EXPECT_NEAR(quads.s[r * 32 + j], want, 1e-5 * (1 + std::fabs(want))) << "row " << r << " key " << j;
      EXPECT_NEAR(quads.s[r * 32 + j], pairs.s[r * 32 + j], QRoundingBound(r, j)) << "row " << r << " key " << j;
    }
  }
}

// Where two depths of q times the key scales are about 20 times the rest (a real model's large key channels), the
// VNNI set keeps them out of the int8 rounding: its scores are within half a step of the other depths' largest value
// of the exact sums, where rounding every depth at the large ones' step would move them up to 20 times as far.
TEST_P(Int8KernelsTest, VnniKeepsTheLargestDepthsOutOfItsInt8Rounding) {
  const std::vector<Int8Set> sets = Int8Sets();
  if (!sets.back().runs) GTEST_SKIP() << "this CPU has no AVX512-VNNI";
  for (int64_t r = 0; r < 5; ++r) {  // q times the scale: +-1, the others' largest about 0.05
    for (const int64_t c : {int64_t{3}, depth_ - 2}) {
      q_[r * depth_ + c] = (r % 2 == 0 ? 1.0f : -1.0f) / quant::ScaleValue(KeyScales()[c]);
    }
  }
  const Int8Outputs quads = Run(*sets.back().kernels);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t j = 0; j < 32; ++j) {
      double exact = 0, rest = 0, codes = 0;  // rest: the other depths' largest over the row's group of four
      for (int64_t c = 0; c < depth_; ++c) {
        const double x = static_cast<double>(q_[r * depth_ + c]) * quant::ScaleValue(KeyScales()[c]);
        const auto code = static_cast<int8_t>(block_[cache_.KeyPart(0) + quant::KeyCodeOffset(cache_, c, j)]);
        exact += x * code;
        codes += std::abs(code);
        const bool large = c == 3 || c == depth_ - 2;
        for (int64_t row = r / 4 * 4; !large && row < std::min<int64_t>(r / 4 * 4 + 4, 5); ++row) {
          rest = std::max(rest, std::fabs(static_cast<double>(q_[row * depth_ + c]) *
                                          quant::ScaleValue(KeyScales()[c])));
        }
      }
      EXPECT_NEAR(quads.s[r * 32 + j], exact, 0.5 * rest / 127 * codes * (1 + 1e-4) + 1e-4 * std::fabs(exact))
          << "row " << r << " key " << j;
    }
  }
}

// 80: a partial vector of columns on every set; 128 and 64: the VNNI set's rows in registers; 78: an odd number
// of depth pairs (the last quad half padding); 36: a partial vector of q's codes.
INSTANTIATE_TEST_SUITE_P(Depths, Int8KernelsTest, ::testing::Values(80, 128, 64, 78, 36));

// ---------------------------------------------------------------------------------------------------------------
// The FP8 kernels on AVX512-BF16 against the AVX-512 set's, which widen every code to fp32: one block of `tokens`
// keys and values ([tokens, depth] each), the scores of `rows` rows of q over all of them, and the outputs of `rows`
// rows of weights p ([rows, tokens]) over the first `value_keys`, added to outputs of 1 rescaled by 0.5, 1, 1.5 ...
struct Fp8SetsRun {
  std::vector<float> s[2], o[2];  // [0]: widening, [1]: AVX512-BF16
};

// One block of `tokens` keys and values ([tokens, depth] each) written to an FP8 cache: its key and value parts and
// their scales, as the kernels take them.
struct Fp8Block {
  Fp8Block(v1::DataType dtype, int64_t depth, int64_t tokens, const std::vector<float>& k, const std::vector<float>& v)
      : cache{1, depth, tokens, dtype}, bytes(cache.BlockBytes()) {
    quant::WriteTokens(cache, bytes.data(), 0, 0, tokens, k.data(), depth, v.data(), depth);
    key_part = bytes.data() + cache.KeyPart(0);
    value_part = bytes.data() + cache.ValuePart(0);
    key_scales = reinterpret_cast<const uint16_t*>(key_part + quant::KeyScalesOffset(cache));
    value_scales = reinterpret_cast<const uint16_t*>(value_part + quant::ValueScalesOffset(cache));
  }
  Fp8Block(const Fp8Block&) = delete;  // the pointers below point into `bytes`
  Fp8Block& operator=(const Fp8Block&) = delete;
  KvCacheLayout cache;
  std::vector<char> bytes;
  const char* key_part = nullptr;
  const char* value_part = nullptr;
  const uint16_t* key_scales = nullptr;
  const uint16_t* value_scales = nullptr;
};

Fp8SetsRun RunFp8Sets(v1::DataType dtype, int64_t depth, int64_t tokens, int64_t rows, int64_t value_keys,
                      const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& q,
                      const std::vector<float>& p) {
  const Fp8Block b(dtype, depth, tokens, k, v);
  const kernels::PagedKernels* sets[2] = {&kernels::avx512::kPagedKernels[dtype - 1],
                                          &kernels::avx512bf16::kFp8PagedKernels[dtype == v1::FP8_E4M3 ? 0 : 1]};
  std::vector<float> o_scale(rows);
  for (int64_t r = 0; r < rows; ++r) o_scale[r] = 0.5f * static_cast<float>(r + 1);
  Fp8SetsRun run;
  for (int i = 0; i < 2; ++i) {
    run.s[i].assign(rows * tokens, 0.0f);
    run.o[i].assign(rows * depth, 1.0f);
    sets[i]->scores(rows, tokens, depth, q.data(), depth, b.key_part, tokens, b.key_scales, run.s[i].data(), tokens,
                    nullptr, 0);
    sets[i]->values(rows, value_keys, depth, p.data(), tokens, b.value_part, b.value_scales, o_scale.data(),
                    run.o[i].data(), depth, nullptr, 0);
  }
  return run;
}

// The bf16 set rounds q times the scales, and the weights times theirs, to bf16 (2^-9 of each product).
void ExpectTheSetsAgree(const Fp8SetsRun& run) {
  double s_norm = 0, o_norm = 0;
  for (float x : run.s[0]) s_norm = std::max<double>(s_norm, std::fabs(x));
  for (float x : run.o[0]) o_norm = std::max<double>(o_norm, std::fabs(x));
  for (size_t i = 0; i < run.s[0].size(); ++i) ASSERT_NEAR(run.s[1][i], run.s[0][i], 4e-3 * s_norm) << "score " << i;
  for (size_t i = 0; i < run.o[0].size(); ++i) ASSERT_NEAR(run.o[1][i], run.o[0][i], 4e-3 * o_norm) << "output " << i;
}

std::vector<float> Normal(int64_t n, std::mt19937& rng, bool magnitude = false) {
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& e : x) e = magnitude ? std::min(1.0f, std::fabs(normal(rng))) : normal(rng);
  return x;
}

// Shapes: depth (80 and 36: a partial vector; 78: an odd pair), 12 rows (a scores group of 8 and one of 4; values
// groups of 4), the values over 7, 20 and 32 keys (a block the decode has partly seen).
class Fp8KernelsTest : public ::testing::TestWithParam<std::tuple<v1::DataType, int64_t, int64_t>> {};

TEST_P(Fp8KernelsTest, TheBf16SetMatchesTheWideningKernels) {
  if (kernels::TileKernelsFor("avx512bf16") == nullptr) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  const auto [dtype, depth, value_keys] = GetParam();
  constexpr int64_t tokens = 32, rows = 12;
  std::mt19937 rng(7);
  const std::vector<float> k = Normal(tokens * depth, rng), v = Normal(tokens * depth, rng);
  const std::vector<float> q = Normal(rows * depth, rng), p = Normal(rows * tokens, rng, true);
  ExpectTheSetsAgree(RunFp8Sets(dtype, depth, tokens, rows, value_keys, k, v, q, p));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8KernelsTest,
                         ::testing::Combine(::testing::Values(v1::FP8_E4M3, v1::FP8_E5M2),
                                            ::testing::Values(128, 80, 78, 36), ::testing::Values(7, 20, 32)));

// The FP8 kernels on AVX512-BF16 read a code as bf16 2^-120 (E4M3) or 2^-112 (E5M2) short of its value and fold that
// factor into q times the key scales and into the weights times the value scales: a channel's keys or a token's
// values near the codes' range (20000 and 200000 here: E4M3 scales of 45 and 446, so q 20 times its scale and a
// weight 1 times its scale pass 2^8) must not overflow that fold to inf.
class Fp8LargeValuesTest : public ::testing::TestWithParam<v1::DataType> {};

TEST_P(Fp8LargeValuesTest, ScoresAndValuesMatchTheWideningKernels) {
  if (kernels::TileKernelsFor("avx512bf16") == nullptr) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  constexpr int64_t depth = 128, tokens = 32, rows = 4;
  std::mt19937 rng(3);
  std::vector<float> k = Normal(tokens * depth, rng), v = Normal(tokens * depth, rng), q = Normal(rows * depth, rng);
  std::vector<float> p = Normal(rows * tokens, rng, true);
  k[5 * depth + 7] = 20000.0f;   // token 5, channel 7
  v[9 * depth + 3] = 200000.0f;  // token 9, column 3
  for (int64_t r = 0; r < rows; ++r) {
    q[r * depth + 7] = 20.0f;
    p[r * tokens + 9] = 1.0f;
  }
  ExpectTheSetsAgree(RunFp8Sets(GetParam(), depth, tokens, rows, tokens, k, v, q, p));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8LargeValuesTest, ::testing::Values(v1::FP8_E4M3, v1::FP8_E5M2),
                         [](const auto& info) { return DTypeName(info.param); });

// Every set whose FP8 kernels widen the codes (portable through fp16's bits; AVX2 and AVX-512 through fp32's, their
// factor folded into q times the key scales and the weights times the value scales) computes the block's scores and
// values from the cache's decoded keys and values, to fp32's rounding: with ordinary values, and with a key channel
// and a token's values near the codes' range, whose fold passes fp32's range and takes the fp16 route (E4M3; E5M2's
// factor is 2^112, and its range 57344 keeps the fold finite).
class Fp8WideningTest : public ::testing::TestWithParam<std::tuple<v1::DataType, bool>> {};

TEST_P(Fp8WideningTest, EverySetComputesFromTheDecodedCache) {
  const auto [dtype, large] = GetParam();
  constexpr int64_t depth = 78, tokens = 32, rows = 4;  // a partial last vector of columns on every set
  std::mt19937 rng(11);
  std::vector<float> k = Normal(tokens * depth, rng), v = Normal(tokens * depth, rng), q = Normal(rows * depth, rng);
  std::vector<float> p = Normal(rows * tokens, rng, true);
  if (large) {
    k[5 * depth + 7] = 200000.0f;  // E4M3's key scale 446, and q of 1 or more times it past 2^8
    v[9 * depth + 3] = 200000.0f;
    for (int64_t r = 0; r < rows; ++r) {
      q[r * depth + 7] = 2.0f;
      p[r * tokens + 9] = 1.0f;
    }
  }
  const Fp8Block b(dtype, depth, tokens, k, v);
  std::vector<double> want_s(rows * tokens), want_o(rows * depth);
  double s_norm = 0, o_norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < tokens; ++j) {
      for (int64_t c = 0; c < depth; ++c) {
        want_s[r * tokens + j] += q[r * depth + c] * quant::KeyAt(b.cache, b.bytes.data(), 0, j, c);
      }
      s_norm = std::max(s_norm, std::fabs(want_s[r * tokens + j]));
    }
    for (int64_t c = 0; c < depth; ++c) {
      want_o[r * depth + c] = 1.0;
      for (int64_t j = 0; j < tokens; ++j) {
        want_o[r * depth + c] += p[r * tokens + j] * quant::ValueAt(b.cache, b.bytes.data(), 0, j, c);
      }
      o_norm = std::max(o_norm, std::fabs(want_o[r * depth + c]));
    }
  }
  __builtin_cpu_init();
  const struct {
    const char* name;
    const kernels::PagedKernels* set;
    bool runs;
  } sets[] = {{"portable", &kernels::portable::kPagedKernels[dtype - 1], true},
              {"avx2", &kernels::avx2::kPagedKernels[dtype - 1], kernels::TileKernelsFor("avx2") != nullptr},
              {"avx512", &kernels::avx512::kPagedKernels[dtype - 1], kernels::TileKernelsFor("avx512") != nullptr}};
  for (const auto& [name, set, runs] : sets) {
    if (!runs) continue;
    std::vector<float> s(rows * tokens), o(rows * depth, 1.0f);
    const std::vector<float> o_scale(rows, 1.0f);
    set->scores(rows, tokens, depth, q.data(), depth, b.key_part, tokens, b.key_scales, s.data(), tokens, nullptr, 0);
    set->values(rows, tokens, depth, p.data(), tokens, b.value_part, b.value_scales, o_scale.data(), o.data(), depth,
                nullptr, 0);
    for (size_t i = 0; i < s.size(); ++i) ASSERT_NEAR(s[i], want_s[i], 1e-5 * s_norm) << name << " score " << i;
    for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], want_o[i], 1e-5 * o_norm) << name << " output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp8WideningTest,
                         ::testing::Combine(::testing::Values(v1::FP8_E4M3, v1::FP8_E5M2), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(DTypeName(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_large" : "");
                         });

// ---------------------------------------------------------------------------------------------------------------
// Accuracy of a decode token (GQA groups of 4, d_k 128, 2048 cached tokens written one at a time as a decode writes
// them): ||out - exact|| / ||exact|| over all its heads, exact = float64 attention over the keys and values before
// quantization. Random data, and keys with 4 of 128 channels 20 times larger than the rest (and offset), as real
// models' keys have (their queries correspondingly smaller there).

struct AccuracyCase {
  v1::DataType dtype;
  bool outliers;
  double bound;  // the targets: INT8 0.03, FP8 E4M3 0.06; E5M2 (two mantissa bits) measured here
};

double DecodeTokenError(const AccuracyCase& a, Backend& backend) {
  constexpr int64_t H = 16, Hkv = 4, dk = 128, T = 2048, tb = 32;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(H * dk), k(T * Hkv * dk), v(T * Hkv * dk);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  if (a.outliers) {
    for (int64_t channel : {5, 40, 77, 120}) {
      for (int64_t t = 0; t < T * Hkv; ++t) k[t * dk + channel] = k[t * dk + channel] * 20 + 20;
      for (int64_t h = 0; h < H; ++h) q[h * dk + channel] /= 20;
    }
  }
  PagedProblem p;
  p.heads = {H, Hkv, dk, true, static_cast<float>(1.0 / std::sqrt(dk))};
  p.cache = {Hkv, dk, tb, a.dtype};
  std::vector<std::vector<char>> storage(T / tb, std::vector<char>(p.cache.BlockBytes()));
  std::vector<char*> blocks;
  for (auto& b : storage) blocks.push_back(b.data());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g = 0; g < Hkv; ++g) {
      quant::WriteTokens(p.cache, blocks[t / tb], g, t % tb, 1, &k[(t * Hkv + g) * dk], dk, &v[(t * Hkv + g) * dk], dk);
    }
  }
  std::vector<float> out(H * dk);
  PagedSequence seq;
  seq.blocks = blocks;
  seq.length = T;
  seq.new_tokens = 1;
  seq.append = false;
  seq.q = {q.data(), v1::FP32};
  seq.out = {out.data(), v1::FP32};
  PagedArgs args;
  args.problem = p;
  args.problem.sequences = args.problem.new_tokens = args.problem.max_new_tokens = 1;
  args.problem.max_length = T;
  args.sequences = absl::MakeConstSpan(&seq, 1);
  const absl::Status status = backend.PagedAttention(args);
  EXPECT_TRUE(status.ok()) << status;
  double err = 0, norm = 0;
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / (H / Hkv);
    std::vector<double> s(T);
    double max = -1e300, sum = 0;
    for (int64_t t = 0; t < T; ++t) {
      double dot = 0;
      for (int64_t d = 0; d < dk; ++d) dot += static_cast<double>(q[h * dk + d]) * k[(t * Hkv + g) * dk + d];
      s[t] = dot / std::sqrt(static_cast<double>(dk));
      max = std::max(max, s[t]);
    }
    for (double& x : s) sum += (x = std::exp(x - max));
    for (int64_t d = 0; d < dk; ++d) {
      double exact = 0;
      for (int64_t t = 0; t < T; ++t) exact += s[t] / sum * v[(t * Hkv + g) * dk + d];
      err += (out[h * dk + d] - exact) * (out[h * dk + d] - exact);
      norm += exact * exact;
    }
  }
  return std::sqrt(err / norm);
}

absl::StatusOr<std::unique_ptr<Backend>> Create(const std::string& label) {
  for (const BackendFactory& f : BackendRegistry::Factories()) {
    if (f.label() == label) return f.create();
  }
  return absl::NotFoundError(label);
}

class QuantizedAccuracyTest : public ::testing::TestWithParam<std::tuple<AccuracyCase, std::string>> {};

TEST_P(QuantizedAccuracyTest, ADecodeTokensRelativeErrorIsWithinItsBound) {
  const AccuracyCase& a = std::get<0>(GetParam());
  absl::StatusOr<std::unique_ptr<Backend>> backend = Create(std::get<1>(GetParam()));
  if (absl::IsUnavailable(backend.status())) GTEST_SKIP() << backend.status();  // an instruction set this CPU lacks
  ASSERT_TRUE(backend.ok()) << backend.status();
  const double error = DecodeTokenError(a, **backend);
  EXPECT_LE(error, a.bound);
  std::printf("[ accuracy ] %s%s on %s: relative error %.4f\n", DTypeName(a.dtype).c_str(),
              a.outliers ? " outlier keys" : "", std::get<1>(GetParam()).c_str(), error);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, QuantizedAccuracyTest,
    ::testing::Combine(::testing::Values(AccuracyCase{v1::INT8, false, 0.03}, AccuracyCase{v1::INT8, true, 0.03},
                                         AccuracyCase{v1::FP8_E4M3, false, 0.06},
                                         AccuracyCase{v1::FP8_E4M3, true, 0.06},
                                         AccuracyCase{v1::FP8_E5M2, false, 0.12},
                                         AccuracyCase{v1::FP8_E5M2, true, 0.12}),
                       ::testing::Values("reference", "cpu", "cpu/avx512", "cpu/avx2", "cpu/portable")),
    [](const auto& info) {
      const AccuracyCase& a = std::get<0>(info.param);
      std::string label = std::get<1>(info.param);
      for (char& ch : label) ch = ch == '/' ? '_' : ch;
      return DTypeName(a.dtype) + (a.outliers ? "_outliers_" : "_random_") + label;
    });

}  // namespace
}  // namespace mha
