// The CUDA backend's 8-bit cache code (server/backends/cuda/paged_quant.cuh), compiled for the host through
// tests/cuda_emulation.h, against quantized_cache.cc, which every other backend writes and reads through: the FP8
// and INT8 codes and the bf16 scales value for value, and the append kernel's blocks byte for byte (scales that grow
// and requantize a block's earlier keys, an odd head_dim's padding depth, blocks whose token count is no multiple of
// 4). The conformance suite runs the whole sessions path on them; this is where a code one step off shows.
#define MHA_CUDA_EMULATION
#include "tests/cuda_emulation.h"
// (the emulation must come first)
#include "server/backends/cuda/paged_quant.cuh"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"
#include "server/backends/backend.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"
#include "server/backends/quantized_cache.h"

namespace mha {
namespace {

using cuda::device::DecodeCode;
using cuda::device::EncodeCode;

uint32_t Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// Both decodings of a code are the same float (NaN for NaN).
void ExpectSameFloat(float got, float want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what;
  } else {
    EXPECT_EQ(Bits(got), Bits(want)) << what << ": " << got << " against " << want;
  }
}

TEST(CudaQuantCodes, EveryFp8CodeDecodesAsTheHostDecodesIt) {
  for (int code = 0; code < 256; ++code) {
    const auto c = static_cast<uint8_t>(code);
    ExpectSameFloat(DecodeCode<cuda::kE4M3>(c), quant::DecodeE4m3(c), "e4m3 code " + std::to_string(code));
    ExpectSameFloat(DecodeCode<cuda::kE5M2>(c), quant::DecodeE5m2(c), "e5m2 code " + std::to_string(code));
  }
}

// Values that decide a rounding: every code's value, the midpoints between neighbours (ties go to the even code)
// and the floats either side of them, the largest value and past it, subnormals, zeros, infinities, NaN; then
// random floats across the formats' ranges.
std::vector<float> EncodingProbes(float (*decode)(uint8_t)) {
  std::vector<float> probes = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::denorm_min(), 1e-30f, 1e30f};
  std::vector<float> values;
  for (int code = 0; code < 0x80; ++code) {
    const float v = decode(static_cast<uint8_t>(code));
    if (std::isfinite(v)) values.push_back(v);
  }
  for (size_t i = 0; i < values.size(); ++i) {
    std::vector<float> around = {values[i]};
    if (i + 1 < values.size()) around.push_back((values[i] + values[i + 1]) / 2);
    else around.push_back(values[i] * 1.0625f);  // past the largest value
    for (float x : around) {
      for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, 1e38f)}) {
        probes.push_back(y);
        probes.push_back(-y);
      }
    }
  }
  std::mt19937 random(5);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-24, 18);
  for (int i = 0; i < 200000; ++i) probes.push_back(std::ldexp(mantissa(random), exponent(random)));
  return probes;
}

TEST(CudaQuantCodes, Fp8EncodingsMatchTheHostsAtEveryRoundingBoundary) {
  for (const float x : EncodingProbes(&quant::DecodeE4m3)) {
    ASSERT_EQ(EncodeCode<cuda::kE4M3>(x), quant::EncodeE4m3(x)) << "e4m3 of " << x << " (bits " << Bits(x) << ")";
  }
  for (const float x : EncodingProbes(&quant::DecodeE5m2)) {
    ASSERT_EQ(EncodeCode<cuda::kE5M2>(x), quant::EncodeE5m2(x)) << "e5m2 of " << x << " (bits " << Bits(x) << ")";
  }
}

TEST(CudaQuantCodes, Int8CodesRoundToNearestEvenAndSaturate) {
  const std::vector<std::pair<float, int>> cases = {{0.5f, 0},   {1.5f, 2},    {2.5f, 2},     {-2.5f, -2},
                                                    {126.4f, 126}, {126.5f, 126}, {127.6f, 127}, {-1e9f, -127},
                                                    {std::numeric_limits<float>::quiet_NaN(), 0}};
  for (const auto& [x, code] : cases) {
    EXPECT_EQ(static_cast<int8_t>(EncodeCode<cuda::kI8>(x)), code) << x;
    if (!std::isnan(x)) {
      EXPECT_EQ(DecodeCode<cuda::kI8>(EncodeCode<cuda::kI8>(x)), static_cast<float>(code)) << x;
    }
  }
}

TEST(CudaQuantCodes, ScalesRoundUpToBf16AsTheHostRoundsThem) {
  std::vector<float> probes = {0.0f, 1.0f, 1.00390625f, 3e38f, std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()};
  std::mt19937 random(9);
  std::uniform_real_distribution<float> mantissa(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  for (int i = 0; i < 100000; ++i) probes.push_back(std::ldexp(mantissa(random), exponent(random)));
  for (const float x : probes) {
    ASSERT_EQ(cuda::device::ScaleBitsOf(x), quant::ScaleBits(x)) << x;
    ExpectSameFloat(cuda::device::ScaleOf(quant::ScaleBits(x)), quant::ScaleValue(quant::ScaleBits(x)), "scale");
  }
}

struct AppendCase {
  const char* name;
  v1::DataType dtype;
  int64_t head_dim, block_tokens;

  friend std::ostream& operator<<(std::ostream& os, const AppendCase& c) { return os << c.name; }
};

class CudaQuantAppendTest : public ::testing::TestWithParam<AppendCase> {};

// Two appends to one sequence through LaunchPagedAppend (no RoPE): 5 tokens, then 23 more whose keys are 4 times
// larger on some channels (their block's scales grow and its first keys are requantized) and that cross into two
// more blocks. The blocks must hold what quant::WriteTokens writes for the same tokens, block by block.
TEST_P(CudaQuantAppendTest, BlocksHoldTheHostsBytes) {
  const AppendCase& c = GetParam();
  KvCacheLayout cache;
  cache.num_kv_heads = 2;
  cache.head_dim = c.head_dim;
  cache.block_tokens = c.block_tokens;
  cache.dtype = c.dtype;
  const int64_t dk = c.head_dim, hkv = cache.num_kv_heads, width = hkv * dk, total = 28;
  std::mt19937 random(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(total * width), v(total * width);
  for (int64_t i = 0; i < total * width; ++i) {
    k[i] = normal(random) * (i / width >= 5 && i % 3 == 0 ? 4.0f : 1.0f);
    v[i] = normal(random);
  }
  const int64_t blocks = (total + c.block_tokens - 1) / c.block_tokens;
  std::vector<std::vector<char>> device(blocks, std::vector<char>(cache.BlockBytes())), host = device;
  std::vector<char*> table;
  for (auto& block : device) table.push_back(block.data());
  int64_t length = 0;
  for (const int64_t n : {int64_t{5}, total - 5}) {
    cuda::PagedSequenceDesc seq;
    seq.length = length;
    seq.new_tokens = n;
    cuda::PagedParams p;
    p.sequences = &seq;
    p.blocks = table.data();
    p.num_sequences = 1;
    p.rows = n;
    p.k = k.data() + length * width;
    p.v = v.data() + length * width;
    p.q_stride = p.kv_stride = width;
    p.kv_heads = hkv;
    p.head_dim = dk;
    p.block_tokens = c.block_tokens;
    p.cache_dtype = c.dtype;
    p.key_part_bytes = cache.KeyBytes();
    p.head_part_bytes = cache.HeadBytes();
    ASSERT_EQ(cuda::LaunchPagedAppend(p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
    for (int64_t t0 = length; t0 < length + n;) {
      const int64_t t1 = std::min(length + n, (t0 / c.block_tokens + 1) * c.block_tokens);
      for (int64_t g = 0; g < hkv; ++g) {
        quant::WriteTokens(cache, host[t0 / c.block_tokens].data(), g, t0 % c.block_tokens, t1 - t0,
                           k.data() + t0 * width + g * dk, width, v.data() + t0 * width + g * dk, width);
      }
      t0 = t1;
    }
    length += n;
    for (int64_t b = 0; b < blocks; ++b) EXPECT_EQ(device[b], host[b]) << "block " << b << " after " << length;
  }
}

const AppendCase kAppendCases[] = {
    {"int8_dk33_block6", v1::INT8, 33, 6},
    {"int8_dk16_block16", v1::INT8, 16, 16},
    {"e4m3_dk33_block6", v1::FP8_E4M3, 33, 6},
    {"e5m2_dk16_block16", v1::FP8_E5M2, 16, 16},
};

INSTANTIATE_TEST_SUITE_P(Caches, CudaQuantAppendTest, ::testing::ValuesIn(kAppendCases),
                         [](const ::testing::TestParamInfo<AppendCase>& info) { return std::string(info.param.name); });

TEST(CudaQuantAppend, RefusesAn8BitCacheWithoutItsPartSizes) {
  cuda::PagedSequenceDesc seq;
  seq.new_tokens = 1;
  cuda::PagedParams p;
  p.sequences = &seq;
  p.num_sequences = 1;
  p.rows = 1;
  p.kv_heads = 1;
  p.head_dim = 8;
  p.block_tokens = 4;
  p.cache_dtype = cuda::kI8;
  EXPECT_EQ(cuda::LaunchPagedAppend(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace mha
