// The CUDA backend's attention kernels (server/backends/cuda/attention_kernels.cuh), their own source compiled for
// the host and run on the CPU through tests/cuda_emulation.h, against the reference backend: the tensor-core
// kernel's fragment layouts, tiles, masks and online softmax in each compiled variant (4 or 8 warps, cp.async or
// plain loads), the SIMT kernel with and without the softmax statistics, and the weights pass; and through their
// launchers on the emulated runtime (tests/emulated_cuda), RoPE and the heads' contributions. On a machine without a GPU this is how the kernels' logic is
// tested; the GPU run (tests/gpu/device-check.sh) is still what shows them on the hardware.
#define MHA_CUDA_EMULATION
#include "tests/cuda_emulation.h"
// (the emulation must come first)
#include "server/backends/cuda/attention_kernels.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/reference/reference_backend.h"
#include "tests/test_util.h"

namespace mha {
namespace {

struct Case {
  const char* name;
  v1::DataType dtype;
  int block_m;  // tensor-core variants: 64 or 128 query rows per block; 0 keeps the plan's
  bool async_copies;
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim;
  bool causal = false;
  bool key_lengths = false;  // item 0 sees every key, item 1 63 or half of them (a tile's last key hidden), item 2 none
  bool additive = false;     // a per-item additive mask with -inf entries
  bool head_mask = false;
  bool fp32_out = false;     // the kernel writes fp32 (a 16-bit layer's heads are written in their own dtype)
  bool weights = false;      // row statistics, then the weights pass
  bool stats = false;        // the softmax statistics (lse, entropy, confidence, distance, sink)

  friend std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }
};

// |got - want| <= tol (1 + |want|) per input dtype (the tensor-core kernel rounds P to the input dtype before
// P V): about 3x the largest error seen over these cases, so that one key seen or hidden by mistake shows.
double Tolerance(v1::DataType dtype) { return dtype == v1::FP32 ? 1e-6 : dtype == v1::FP16 ? 6e-4 : 3e-3; }

// `x` in the wire's `dtype` bytes, and back (the codec's conversions).
std::vector<uint8_t> Encode(const std::vector<float>& x, v1::DataType dtype) {
  std::vector<uint8_t> bytes(x.size() * DTypeSize(dtype));
  EncodeFromFloat(dtype, x.data(), x.size(), bytes.data());
  return bytes;
}
std::vector<float> Decode(const std::vector<uint8_t>& bytes, v1::DataType dtype) {
  std::vector<float> x(bytes.size() / DTypeSize(dtype));
  DecodeToFloat(dtype, bytes.data(), x.size(), x.data());
  return x;
}

class EmulatedKernelTest : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedKernelTest, MatchesTheReference) {
  const Case& c = GetParam();
  AttentionShape shape;
  shape.batch = c.batch;
  shape.q_len = c.q_len;
  shape.kv_len = c.kv_len;
  shape.heads.num_heads = c.heads;
  shape.heads.num_kv_heads = c.kv_heads;
  shape.heads.head_dim = c.head_dim;
  shape.heads.causal = c.causal;
  shape.heads.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  const uint32_t seed = static_cast<uint32_t>(c.q_len * 131 + c.kv_len * 7 + c.head_dim);
  const int64_t q_count = c.batch * c.q_len * c.heads * c.head_dim;
  const int64_t kv_count = c.batch * c.kv_len * c.kv_heads * c.head_dim;
  // Queries spread wider than keys, so that the softmax is peaked and a key wrongly seen or hidden shows.
  const std::vector<uint8_t> q = Encode(testing::RandomVector(q_count, seed, 2.0f), c.dtype);
  const std::vector<uint8_t> k = Encode(testing::RandomVector(kv_count, seed + 1), c.dtype);
  const std::vector<uint8_t> v = Encode(testing::RandomVector(kv_count, seed + 2), c.dtype);
  std::vector<int32_t> lengths;
  if (c.key_lengths) {
    for (int64_t b = 0; b < c.batch; ++b) {
      lengths.push_back(static_cast<int32_t>(b == 0 ? c.kv_len : b == 1 ? std::min<int64_t>(63, c.kv_len / 2) : 0));
    }
  }
  std::vector<float> additive;
  if (c.additive) {
    additive = testing::RandomVector(c.batch * c.q_len * c.kv_len, seed + 3);
    for (size_t i = 0; i < additive.size(); i += 5) additive[i] = -std::numeric_limits<float>::infinity();
  }
  std::vector<float> head_mask;
  if (c.head_mask) {
    for (int64_t h = 0; h < c.heads; ++h) head_mask.push_back(h % 3 == 1 ? 0.0f : 0.5f + 0.25f * h);
  }

  // The ground truth: the reference backend on the same wire bytes, fp32 outputs.
  SdpaArgs args;
  args.shape = shape;
  args.mask.key_lengths = lengths;
  args.mask.additive = c.additive ? additive.data() : nullptr;
  args.mask.additive_per_batch = true;
  args.q = {q.data(), c.dtype};
  args.k = {k.data(), c.dtype};
  args.v = {v.data(), c.dtype};
  std::vector<float> want(q_count), want_weights(c.weights ? c.batch * c.heads * c.q_len * c.kv_len : 0);
  args.out = {want.data(), v1::FP32};
  if (c.weights) args.weights = {want_weights.data(), v1::FP32};
  // lse, entropy, confidence, distance, sink: [B, H, Tq] each.
  const int64_t stat_count = c.batch * c.heads * c.q_len;
  std::vector<std::vector<float>> want_stats(c.stats ? 5 : 0, std::vector<float>(stat_count));
  constexpr int64_t kSinkTokens = 3;
  if (c.stats) {
    args.stats = {want_stats[0].data(), want_stats[1].data(), want_stats[2].data(), want_stats[3].data(),
                  want_stats[4].data()};
    args.stats.sink_tokens = kSinkTokens;
  }
  ReferenceBackend reference;
  ASSERT_TRUE(reference.ScaledDotProductAttention(args).ok());
  if (c.head_mask) {
    for (int64_t row = 0; row < c.batch * c.q_len; ++row) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t d = 0; d < c.head_dim; ++d) want[(row * c.heads + h) * c.head_dim + d] *= head_mask[h];
      }
    }
  }

  // The kernel, as the backend would launch it, with the case's variant of the plan.
  absl::StatusOr<cuda::FlashPlan> planned = cuda::PlanFlash(shape, c.dtype);
  ASSERT_TRUE(planned.ok()) << planned.status();
  cuda::FlashPlan plan = *planned;
  if (c.block_m != 0) {
    ASSERT_EQ(plan.kernel, cuda::FlashKernel::kTensorCore);
    plan = cuda::TensorCoreVariant(plan, c.q_len, c.block_m, c.async_copies);
  }
  const v1::DataType out_dtype = c.fp32_out ? v1::FP32 : c.dtype;
  std::vector<uint8_t> out(q_count * DTypeSize(out_dtype), 0xff);  // NaN-ish until written
  std::vector<float> row_stats(c.weights ? 2 * c.batch * c.heads * c.q_len : 0);
  cuda::AttentionParams p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.q_row_stride = c.heads * c.head_dim;
  p.kv_row_stride = c.kv_heads * c.head_dim;
  p.dtype = c.dtype;
  p.out = out.data();
  p.out_dtype = out_dtype;
  p.row_stats = c.weights ? row_stats.data() : nullptr;
  p.key_lengths = c.key_lengths ? lengths.data() : nullptr;
  p.additive = c.additive ? additive.data() : nullptr;
  p.additive_per_batch = true;
  p.head_mask = c.head_mask ? head_mask.data() : nullptr;
  p.batch = c.batch;
  p.q_len = c.q_len;
  p.kv_len = c.kv_len;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.causal = c.causal;
  p.scale = shape.heads.scale;
  std::vector<std::vector<float>> stats(want_stats.size(), std::vector<float>(stat_count, -1234.0f));
  if (c.stats) {
    p.lse = stats[0].data();
    p.entropy = stats[1].data();
    p.confidence = stats[2].data();
    p.distance = stats[3].data();
    p.sink = stats[4].data();
    p.sink_tokens = kSinkTokens;
  }
  const cuda::device::AttentionLaunch launch = cuda::device::ChooseAttentionKernel(p, plan);
  ASSERT_NE(launch.kernel, nullptr);
  ASSERT_EQ(emulation::Launch(launch.kernel, launch.grid, launch.threads, p), "");

  // |got - want| <= tol (1 + |want|): atol = rtol = tol.
  const double tolerance = Tolerance(c.dtype) + (out_dtype == v1::BF16 ? 2e-3 : 0.0);  // the output's rounding
  EXPECT_TRUE(testing::AllClose(Decode(out, out_dtype), want, tolerance, tolerance)) << "outputs";
  // The statistics from the same wire values: fp32 sums against the reference's doubles.
  const char* stat_names[] = {"lse", "entropy", "confidence", "distance", "sink"};
  for (size_t k = 0; k < want_stats.size(); ++k) {
    EXPECT_TRUE(testing::AllClose(stats[k], want_stats[k], 1e-4, 1e-4)) << stat_names[k];
  }

  if (c.weights) {
    std::vector<uint8_t> weights(want_weights.size() * DTypeSize(out_dtype), 0xff);
    const cuda::device::WeightsLaunch pass = cuda::device::ChooseWeightsKernel(p, out_dtype);
    ASSERT_NE(pass.kernel, nullptr);
    ASSERT_EQ(emulation::Launch(pass.kernel, pass.grid, pass.threads, p, static_cast<void*>(weights.data())), "");
    const double weight_tolerance = out_dtype == v1::FP32 ? 1e-5 : out_dtype == v1::FP16 ? 1e-3 : 8e-3;
    EXPECT_TRUE(testing::AllClose(Decode(weights, out_dtype), want_weights, 1e-3 * weight_tolerance,
                                  weight_tolerance))
        << "weights";
  }
}

// Tensor-core cases: head_dim 64 and 128, partial query and key tiles, GQA and MQA, bottom-right causal with
// Tq < Tk and Tq > Tk (rows that see no key), key lengths down to 0, additive and head masks, every variant.
const Case kCases[] = {
    {"tc_bf16_dk64_gqa", v1::BF16, 0, true, 2, 150, 150, 4, 2, 64},
    {"tc_bf16_dk128_mqa_causal", v1::BF16, 0, true, 1, 200, 200, 2, 1, 128, true},
    {"tc_fp16_dk64_causal_tq_lt_tk_lengths_fp32_out", v1::FP16, 0, true, 2, 70, 200, 2, 2, 64, true, true, false,
     false, true},
    {"tc_bf16_dk128_masks_zero_length", v1::BF16, 0, true, 3, 40, 90, 3, 3, 128, false, true, true, true},
    {"tc_fp16_dk128_causal_tq_gt_tk", v1::FP16, 0, true, 1, 140, 60, 2, 1, 128, true},
    {"tc_bf16_dk64_4warps_async", v1::BF16, 64, true, 2, 130, 130, 4, 2, 64, true, true},
    {"tc_bf16_dk64_8warps_plain", v1::BF16, 128, false, 2, 130, 130, 4, 2, 64, true, true},
    {"tc_bf16_dk64_4warps_plain", v1::BF16, 64, false, 2, 130, 130, 4, 2, 64, true, true},
    {"tc_fp16_dk128_4warps_async_masks", v1::FP16, 64, true, 2, 100, 70, 2, 2, 128, false, false, true, true},
    {"tc_bf16_dk64_weights", v1::BF16, 0, true, 2, 80, 100, 2, 1, 64, true, true, false, false, false, true},
    {"tc_fp16_dk128_weights_fp32", v1::FP16, 0, true, 1, 50, 70, 2, 2, 128, false, false, true, false, true, true},
    {"tc_bf16_dk64_one_key", v1::BF16, 0, true, 1, 20, 1, 2, 2, 64},
    // SIMT kernel: fp32, other head dims, 16-bit at head_dims the tensor cores do not take.
    {"simt_fp32_dk8_causal_lengths", v1::FP32, 0, true, 3, 13, 13, 4, 2, 8, true, true},
    {"simt_fp32_dk20_masks_weights", v1::FP32, 0, true, 2, 9, 40, 3, 3, 20, false, true, true, true, false, true},
    {"simt_fp32_dk64_causal_tq_gt_tk", v1::FP32, 0, true, 1, 30, 10, 2, 1, 64, true},
    {"simt_bf16_dk80_gqa", v1::BF16, 0, true, 2, 17, 33, 4, 2, 80, true, false, false, false, true},
    {"simt_fp16_dk256", v1::FP16, 0, true, 1, 6, 45, 2, 2, 256, false, true},
    // The softmax statistics (SIMT kernel for fp32, the tensor cores' for 16-bit at head_dim 64 and 128): several
    // tiles of keys (the running max moves), rows that see no key (key length 0, causal with Tq > Tk), -inf mask
    // entries, with the weights pass and the head mask beside them; both tensor-core block sizes.
    {"stats_fp32_dk8_causal_lengths", v1::FP32, 0, true, 3, 13, 100, 4, 2, 8, true, true, false, false, false, false,
     true},
    {"stats_fp32_dk20_masks_weights", v1::FP32, 0, true, 2, 9, 70, 3, 3, 20, false, true, true, true, false, true,
     true},
    {"stats_fp32_dk16_causal_tq_gt_tk", v1::FP32, 0, true, 1, 30, 10, 2, 1, 16, true, false, false, false, false,
     false, true},
    {"stats_bf16_dk64_gqa_masks", v1::BF16, 0, true, 2, 17, 90, 4, 2, 64, true, true, true, false, false, false,
     true},
    {"stats_fp16_dk128_fp32_out", v1::FP16, 0, true, 1, 6, 45, 2, 2, 128, false, false, false, false, true, false,
     true},
    {"stats_tc_bf16_dk64_4warps_causal_tq_gt_tk_lengths", v1::BF16, 64, true, 3, 150, 130, 4, 2, 64, true, true,
     false, false, false, false, true},
    {"stats_tc_fp16_dk128_8warps_weights_head_mask", v1::FP16, 128, true, 1, 140, 300, 2, 1, 128, true, false,
     false, true, true, true, true},
    {"stats_tc_bf16_dk128_additive", v1::BF16, 0, true, 2, 40, 200, 2, 2, 128, false, false, true, false, false,
     false, true},
};

INSTANTIATE_TEST_SUITE_P(Kernels, EmulatedKernelTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

struct RopeCase {
  const char* name;
  v1::DataType dtype;
  int64_t batch, rows, heads, head_dim, extra_columns;  // row_stride = heads * head_dim + extra_columns
  int64_t first;                                         // position of each item's row 0
  double theta;
  int64_t rope_dim;
  bool interleaved;
  // A scaled table's two effects (rope_frequencies.h computes the real ones): every frequency divided by `stretch`,
  // cos and sin multiplied by `attention_factor`.
  double stretch = 1.0;
  double attention_factor = 1.0;

  double InvFreq(int64_t pair) const {
    return std::pow(theta, -2.0 * static_cast<double>(pair) / static_cast<double>(rope_dim)) / stretch;
  }

  friend std::ostream& operator<<(std::ostream& os, const RopeCase& c) { return os << c.name; }
};

// RoPE as the reference backend rotates (HeadSpec's definition, in double): rows of `row_stride` values, `heads`
// heads of head_dim from each row's start, row r of each batch item at position first + r.
std::vector<float> RotatedInDouble(const std::vector<float>& x, const RopeCase& c, int64_t row_stride) {
  std::vector<float> y = x;
  const int64_t half = c.rope_dim / 2;
  for (int64_t row = 0; row < c.batch * c.rows; ++row) {
    const double position = static_cast<double>(c.first + row % c.rows);
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t base = row * row_stride + h * c.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = position * c.InvFreq(i);
        const double cosine = std::cos(angle) * c.attention_factor, sine = std::sin(angle) * c.attention_factor;
        const int64_t a = base + (c.interleaved ? 2 * i : i), b = base + (c.interleaved ? 2 * i + 1 : i + half);
        y[a] = static_cast<float>(x[a] * cosine - x[b] * sine);
        y[b] = static_cast<float>(x[b] * cosine + x[a] * sine);
      }
    }
  }
  return y;
}

class EmulatedRopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(EmulatedRopeTest, MatchesTheDefinition) {
  const RopeCase& c = GetParam();
  const int64_t row_stride = c.heads * c.head_dim + c.extra_columns;
  // The wire's values (rounded to the dtype), so that the only rounding left is the rotated values' own.
  const std::vector<uint8_t> input = Encode(testing::RandomVector(c.batch * c.rows * row_stride, 17), c.dtype);
  const std::vector<float> want = RotatedInDouble(Decode(input, c.dtype), c, row_stride);
  cuda::RopeTable table;
  for (int64_t i = 0; i < c.rope_dim / 2; ++i) table.inv_freq[i] = c.InvFreq(i);
  table.attention_factor = c.attention_factor;
  table.rope_dim = c.rope_dim;
  table.interleaved = c.interleaved;
  std::vector<uint8_t> x = input;
  ASSERT_EQ(
      cuda::LaunchRope(x.data(), c.dtype, c.batch, c.rows, row_stride, c.heads, c.head_dim, c.first, table, nullptr),
      cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  // fp32: the angle in double shows (fp32 angles are off by 1e-3 rad at position 8192); 16-bit: one rounding.
  const double tolerance = c.dtype == v1::FP32 ? 2e-6 : c.dtype == v1::FP16 ? 1e-3 : 8e-3;
  EXPECT_TRUE(testing::AllClose(Decode(x, c.dtype), want, tolerance, tolerance));
}

// Both conventions, partial rotary dims, columns beyond the heads left alone (a fused Q|K|V row), negative and
// large positions.
const RopeCase kRopeCases[] = {
    {"fp32_half_full", v1::FP32, 2, 9, 3, 16, 0, 0, 10000.0, 16, false},
    {"fp32_interleaved_partial_strided", v1::FP32, 2, 5, 4, 12, 40, 3, 500000.0, 8, true},
    {"fp32_half_partial_negative_positions", v1::FP32, 1, 7, 2, 10, 5, -4, 100.0, 6, false},
    {"fp32_interleaved_long_positions", v1::FP32, 1, 4, 2, 32, 0, 8190, 10000.0, 32, true},
    {"fp16_half_strided", v1::FP16, 2, 6, 4, 64, 128, 10, 10000.0, 64, false},
    {"bf16_interleaved_partial", v1::BF16, 3, 5, 2, 32, 0, 0, 10000.0, 24, true},
    {"fp32_scaled_table", v1::FP32, 2, 6, 3, 16, 4, 1000, 10000.0, 12, false, 4.0, 1.3},
    {"bf16_interleaved_scaled_table", v1::BF16, 1, 5, 2, 32, 0, 300, 500000.0, 32, true, 8.0, 0.9},
    {"fp32_head_dim_256", v1::FP32, 1, 3, 2, 256, 0, 7, 10000.0, 256, false},
};

// A table holds kMaxRopePairs frequencies: a wider rotation, an odd or a negative rope_dim, or one past head_dim is
// refused before anything runs.
TEST(EmulatedRope, RefusesARopeDimTheTableCannotHold) {
  std::vector<float> x(2 * 2 * cuda::kMaxHeadDim * 2, 1.0f);
  for (int64_t rope_dim : {int64_t{2} * cuda::kMaxRopePairs + 2, int64_t{7}, int64_t{-2}, int64_t{34}}) {
    cuda::RopeTable table;
    table.rope_dim = rope_dim;
    const int64_t head_dim = rope_dim == 34 ? 32 : 2 * cuda::kMaxHeadDim;
    EXPECT_EQ(cuda::LaunchRope(x.data(), cuda::kF32, 1, 2, 2 * head_dim, 2, head_dim, 0, table, nullptr),
              cudaErrorInvalidValue)
        << rope_dim;
  }
  EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](float v) { return v == 1.0f; }));
}

INSTANTIATE_TEST_SUITE_P(Rope, EmulatedRopeTest, ::testing::ValuesIn(kRopeCases),
                         [](const ::testing::TestParamInfo<RopeCase>& info) { return std::string(info.param.name); });

// contribution[r, h] = ||heads[r, h] W_O[h]|| / ||out[r]|| in double, as the reference backend computes it.
std::vector<float> ContributionsInDouble(const std::vector<float>& heads, const std::vector<float>& w_o,
                                         const std::vector<float>& out, int64_t rows, int64_t num_heads,
                                         int64_t head_dim, int64_t d_model) {
  std::vector<float> result(rows * num_heads);
  for (int64_t r = 0; r < rows; ++r) {
    double out_norm = 0;
    for (int64_t o = 0; o < d_model; ++o) out_norm += double{out[r * d_model + o]} * out[r * d_model + o];
    for (int64_t h = 0; h < num_heads; ++h) {
      double norm = 0;
      for (int64_t o = 0; o < d_model; ++o) {
        double term = 0;
        for (int64_t c = 0; c < head_dim; ++c) {
          term += double{heads[(r * num_heads + h) * head_dim + c]} * w_o[(h * head_dim + c) * d_model + o];
        }
        norm += term * term;
      }
      result[r * num_heads + h] = out_norm > 0 ? static_cast<float>(std::sqrt(norm / out_norm)) : 0.0f;
    }
  }
  return result;
}

struct ContributionCase {
  const char* name;
  v1::DataType compute, out;  // heads and W_O in `compute`, the output in `out`
  int64_t rows, num_heads, head_dim, d_model;

  friend std::ostream& operator<<(std::ostream& os, const ContributionCase& c) { return os << c.name; }
};

class EmulatedContributionTest : public ::testing::TestWithParam<ContributionCase> {};

TEST_P(EmulatedContributionTest, MatchesTheDefinition) {
  const ContributionCase& c = GetParam();
  const int64_t width = c.num_heads * c.head_dim;
  const std::vector<uint8_t> heads = Encode(testing::RandomVector(c.rows * width, 5), c.compute);
  const std::vector<uint8_t> w_o = Encode(testing::RandomVector(width * c.d_model, 6), c.compute);
  std::vector<float> out_values = testing::RandomVector(c.rows * c.d_model, 7);
  for (int64_t o = 0; o < c.d_model; ++o) out_values[2 * c.d_model + o] = 0.0f;  // a zero output row: 0
  const std::vector<uint8_t> out = Encode(out_values, c.out);
  const std::vector<float> want = ContributionsInDouble(Decode(heads, c.compute), Decode(w_o, c.compute),
                                                       Decode(out, c.out), c.rows, c.num_heads, c.head_dim, c.d_model);
  std::vector<float> got(c.rows * c.num_heads, -1.0f);
  ASSERT_EQ(cuda::LaunchHeadContributions(heads.data(), c.compute, c.rows, c.num_heads, c.head_dim, w_o.data(),
                                          c.compute, out.data(), c.out, c.d_model, got.data(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_TRUE(testing::AllClose(got, want, 1e-5, 1e-5));
  for (int64_t h = 0; h < c.num_heads; ++h) EXPECT_EQ(got[2 * c.num_heads + h], 0.0f);
}

// Rows beyond a block's 8 (the last block partial), output columns beyond the block's 256 threads, 16-bit inputs.
const ContributionCase kContributionCases[] = {
    {"fp32_partial_block", v1::FP32, v1::FP32, 19, 3, 20, 300},
    {"bf16_heads_fp32_out", v1::BF16, v1::FP32, 10, 4, 32, 64},
    {"fp16_heads_fp16_out", v1::FP16, v1::FP16, 9, 2, 64, 257},
};

INSTANTIATE_TEST_SUITE_P(HeadContributions, EmulatedContributionTest, ::testing::ValuesIn(kContributionCases),
                         [](const ::testing::TestParamInfo<ContributionCase>& info) {
                           return std::string(info.param.name);
                         });

// The emulation itself: what the kernel tests above rely on.
TEST(CudaEmulation, ThreadsThatWaitAtDifferentBarriersAreReported) {
  void (*kernel)(int) = [](int) {
    if (threadIdx.x == 0) {
      __syncthreads();
    } else {
      __syncwarp();
    }
  };
  EXPECT_EQ(emulation::Launch(kernel, dim3(1), 32u, 0),
            "deadlock: every live thread waits at a barrier that cannot complete");
}

TEST(CudaEmulation, AsynchronousCopiesLandAtTheWait) {
  alignas(16) static float destination[4], source[4] = {42, 1, 2, 3};
  static float before = -1, after = -1;
  void (*kernel)(int) = [](int) {
    if (threadIdx.x != 0) return;
    destination[0] = 0;
    cuda::device::CopyAsync16(destination, source);
    cuda::device::CommitCopies();
    before = destination[0];
    cuda::device::WaitCopies();
    after = destination[0];
  };
  ASSERT_EQ(emulation::Launch(kernel, dim3(1), 32u, 0), "");
  EXPECT_EQ(before, 0);
  EXPECT_EQ(after, 42);
}

TEST(CudaEmulation, AThreadRunsAheadToItsBarrier) {
  // Thread 1 reads what thread 0 writes: without the barrier it reads the old value, with it the new one.
  static int value = 0, without = -1, with = -1;
  void (*kernel)(int) = [](int) {
    if (threadIdx.x == 1) without = value;
    if (threadIdx.x == 40) value = 7;
    __syncthreads();
    if (threadIdx.x == 1) with = value;
  };
  ASSERT_EQ(emulation::Launch(kernel, dim3(1), 64u, 0), "");
  EXPECT_EQ(without, 0);
  EXPECT_EQ(with, 7);
}

}  // namespace
}  // namespace mha
