// The CUDA backend's attention kernels (server/backends/cuda/attention_kernels.cuh), their own source compiled for
// the host and run on the CPU through tests/cuda_emulation.h, against the reference backend: the tensor-core
// kernel's fragment layouts, tiles, masks and online softmax in each compiled variant (4 or 8 warps, cp.async or
// plain loads), the SIMT kernel, and the weights pass. On a machine without a GPU this is how the kernels' logic is
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

#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/flash_plan.h"
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
  const cuda::device::AttentionLaunch launch = cuda::device::ChooseAttentionKernel(p, plan);
  ASSERT_NE(launch.kernel, nullptr);
  ASSERT_EQ(emulation::Launch(launch.kernel, launch.grid, launch.threads, p), "");

  // |got - want| <= tol (1 + |want|): atol = rtol = tol.
  const double tolerance = Tolerance(c.dtype) + (out_dtype == v1::BF16 ? 2e-3 : 0.0);  // the output's rounding
  EXPECT_TRUE(testing::AllClose(Decode(out, out_dtype), want, tolerance, tolerance)) << "outputs";

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
};

INSTANTIATE_TEST_SUITE_P(Kernels, EmulatedKernelTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

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
