// The oneDNN CPU backend against the reference backend, over a table of cases that each name what they cover.
#include "server/cpu_backend.h"

#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "server/reference_backend.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
using ::mha::testing::RandomVector;

// kExtremes: finite extremes a client may send (PyTorch masks with torch.finfo(torch.float32).min), shared by the
// batch: the lowest float on every key of query row 0, which gives it uniform weights, as in PyTorch; the largest
// float on key 1 of row 1 and on keys 0 and 2 of row 2, which take all their row's weight; -inf on every fifth
// key of the other rows.
enum class Mask { kNone, kShared, kPerBatch, kExtremes };

struct ParityCase {
  std::string name;
  int64_t batch, q_len, kv_len, d_model;
  int64_t d_kv_in;  // 0: self-attention (key = value = query)
  int64_t heads, kv_heads, head_dim;
  bool causal = false;
  bool key_lengths = false;  // lengths cycle through Tk, 0, Tk/2, 1
  Mask mask = Mask::kNone;   // shared, per batch: random finite values with some -inf
  bool bias = false;
  bool head_mask = false;
  bool weights = false;
  double atol = 2e-5, rtol = 1e-4;
};

std::ostream& operator<<(std::ostream& os, const ParityCase& c) {
  return os << c.name << " B=" << c.batch << " Tq=" << c.q_len << " Tk=" << c.kv_len << " d=" << c.d_model
            << " H=" << c.heads << " Hkv=" << c.kv_heads << " dk=" << c.head_dim;
}

// Inputs for one case, and the outputs of one backend on them.
struct Problem {
  AttentionDims dims;
  std::vector<float> query, key, value, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, additive, head_mask;
  std::vector<int32_t> key_lengths;
  bool self_attention;
  int64_t d_model, d_kv;

  explicit Problem(const ParityCase& c) {
    dims.batch = c.batch;
    dims.q_len = c.q_len;
    dims.kv_len = c.d_kv_in == 0 ? c.q_len : c.kv_len;
    dims.num_heads = c.heads;
    dims.num_kv_heads = c.kv_heads;
    dims.head_dim = c.head_dim;
    dims.causal = c.causal;
    dims.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    self_attention = c.d_kv_in == 0;
    d_model = c.d_model;
    d_kv = self_attention ? c.d_model : c.d_kv_in;
    const int64_t qw = c.heads * c.head_dim, kvw = c.kv_heads * c.head_dim;
    query = RandomVector(c.batch * c.q_len * d_model, 1);
    if (!self_attention) {
      key = RandomVector(c.batch * dims.kv_len * d_kv, 2);
      value = RandomVector(c.batch * dims.kv_len * d_kv, 3);
    }
    w_q = RandomVector(d_model * qw, 4, 1.0f / std::sqrt(d_model));
    w_k = RandomVector(d_kv * kvw, 5, 1.0f / std::sqrt(d_kv));
    w_v = RandomVector(d_kv * kvw, 6, 1.0f / std::sqrt(d_kv));
    w_o = RandomVector(qw * d_model, 7, 1.0f / std::sqrt(qw));
    if (c.bias) {
      b_q = RandomVector(qw, 8);
      b_k = RandomVector(kvw, 9);
      b_v = RandomVector(kvw, 10);
      b_o = RandomVector(d_model, 11);
    }
    if (c.key_lengths) {
      const int64_t cycle[] = {dims.kv_len, 0, dims.kv_len / 2, 1};
      for (int64_t b = 0; b < c.batch; ++b) key_lengths.push_back(static_cast<int32_t>(cycle[b % 4]));
    }
    if (c.mask == Mask::kExtremes) {
      const float lowest = std::numeric_limits<float>::lowest(), largest = std::numeric_limits<float>::max();
      const int64_t tk = dims.kv_len;
      additive = RandomVector(c.q_len * tk, 12, 2.0f);
      for (int64_t i = 3 * tk; i < c.q_len * tk; i += 5) additive[i] = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < tk; ++j) additive[j] = lowest;
      additive[tk + 1] = additive[2 * tk] = additive[2 * tk + 2] = largest;
    } else if (c.mask != Mask::kNone) {
      const int64_t n = (c.mask == Mask::kPerBatch ? c.batch : 1) * c.q_len * dims.kv_len;
      additive = RandomVector(n, 12, 2.0f);
      for (int64_t i = 0; i < n; i += 7) additive[i] = -std::numeric_limits<float>::infinity();
      // One fully masked query row.
      for (int64_t j = 0; j < dims.kv_len; ++j) additive[j] = -std::numeric_limits<float>::infinity();
    }
    if (c.head_mask) {
      for (int64_t h = 0; h < c.heads; ++h) head_mask.push_back(h % 3 == 0 ? 0.0f : 0.5f * (h + 1));
    }
  }

  // Runs MultiHeadAttention on `backend`; returns output and, when `weights`, the attention weights after it.
  std::vector<float> Run(Backend& backend, bool weights, std::vector<float>* weights_out) const {
    auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    MhaArgs a;
    a.dims = dims;
    a.mask.key_lengths = key_lengths;
    a.mask.additive = ptr(additive);
    a.mask.additive_per_batch = !additive.empty() && static_cast<int64_t>(additive.size()) !=
                                                         dims.q_len * dims.kv_len;
    a.weights.d_model = d_model;
    a.weights.d_kv_in = a.weights.d_v_in = d_kv;
    a.weights.w_q = w_q.data();
    a.weights.w_k = w_k.data();
    a.weights.w_v = w_v.data();
    a.weights.w_o = w_o.data();
    a.weights.b_q = ptr(b_q);
    a.weights.b_k = ptr(b_k);
    a.weights.b_v = ptr(b_v);
    a.weights.b_o = ptr(b_o);
    a.query = query.data();
    a.key = self_attention ? query.data() : key.data();
    a.value = self_attention ? query.data() : value.data();
    a.self_attention = self_attention;
    a.head_mask = head_mask;
    std::vector<float> out(dims.batch * dims.q_len * d_model, std::nanf(""));
    a.out = out.data();
    if (weights) {
      weights_out->assign(dims.batch * dims.num_heads * dims.q_len * dims.kv_len, std::nanf(""));
      a.attention_weights = weights_out->data();
    }
    const absl::Status status = backend.MultiHeadAttention(a);
    EXPECT_TRUE(status.ok()) << status;
    return out;
  }
};

// Each case runs with every kernel choice of the attention core; choices this CPU lacks are skipped.
class CpuParityTest : public ::testing::TestWithParam<std::tuple<ParityCase, std::string>> {};

TEST_P(CpuParityTest, MatchesReference) {
  const auto& [c, kernels] = GetParam();
  const Problem p(c);
  ReferenceBackend reference;
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(kernels);
  if (absl::IsUnavailable(cpu.status())) GTEST_SKIP() << cpu.status();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> want_weights, got_weights;
  const std::vector<float> want = p.Run(reference, c.weights, &want_weights);
  const std::vector<float> got = p.Run(**cpu, c.weights, &got_weights);
  EXPECT_TRUE(AllClose(got, want, c.atol, c.rtol)) << "output";
  if (c.weights) {
    EXPECT_TRUE(AllClose(got_weights, want_weights, c.atol, c.rtol)) << "attention weights";
  }
  // The same backend again: reused scratch must give the same bits.
  std::vector<float> again_weights;
  EXPECT_EQ(p.Run(**cpu, c.weights, &again_weights), got);
}

TEST(CpuBackend, UnknownKernelsAreInvalidArgument) {
  EXPECT_EQ(CpuBackend::Create("avx1024").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackend, DeviceNamesTheAttentionKernels) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> sgemm = CpuBackend::Create("sgemm");
  ASSERT_TRUE(sgemm.ok());
  EXPECT_NE((*sgemm)->device().find("sgemm attention tiles"), std::string::npos) << (*sgemm)->device();
}

TEST(CpuBackend, ConcurrentCallsOnOneInstanceMatchSerialOnes) {
  // Scratch is per calling thread, so threads sharing a backend must not disturb each other.
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok());
  std::vector<ParityCase> cases;
  for (int i = 0; i < 4; ++i) {
    ParityCase c;
    c.name = "thread";
    c.batch = 1 + i;
    c.q_len = c.kv_len = 8 + 5 * i;
    c.d_model = 32;
    c.d_kv_in = 0;
    c.heads = 4;
    c.kv_heads = i % 2 == 0 ? 4 : 2;
    c.head_dim = 8;
    c.causal = i % 2 == 1;
    cases.push_back(c);
  }
  std::vector<std::vector<float>> serial, concurrent(cases.size());
  std::vector<float> unused;
  for (const ParityCase& c : cases) serial.push_back(Problem(c).Run(**cpu, false, &unused));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] {
      std::vector<float> weights;
      const Problem p(cases[i]);
      for (int repeat = 0; repeat < 50; ++repeat) concurrent[i] = p.Run(**cpu, false, &weights);
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(concurrent[i], serial[i]) << "case " << i;
}

ParityCase Case(std::string name, int64_t b, int64_t tq, int64_t tk, int64_t d, int64_t dkv, int64_t h,
                int64_t hkv, int64_t dk);

TEST(CpuBackend, ScratchKeptFromALargeCallServesSmallerOnes) {
  // Each thread keeps its tile scratch at the largest size seen; what a larger call left in it must not leak into
  // a smaller or differently shaped one (head size, key count, masks).
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok());
  ReferenceBackend reference;
  ParityCase large = Case("large", 2, 600, 600, 160, 0, 2, 2, 80);
  large.causal = true;
  ParityCase small = Case("small", 3, 5, 5, 32, 0, 2, 1, 16);
  small.mask = Mask::kPerBatch;
  small.key_lengths = true;
  ParityCase medium = Case("medium", 1, 40, 70, 64, 24, 4, 2, 16);
  for (const ParityCase& c : {large, small, medium, small}) {
    const Problem p(c);
    std::vector<float> unused;
    EXPECT_TRUE(AllClose(p.Run(**cpu, false, &unused), p.Run(reference, false, &unused), c.atol, c.rtol)) << c;
  }
}

ParityCase Case(std::string name, int64_t b, int64_t tq, int64_t tk, int64_t d, int64_t dkv, int64_t h,
                int64_t hkv, int64_t dk) {
  ParityCase c;
  c.name = std::move(name);
  c.batch = b;
  c.q_len = tq;
  c.kv_len = tk;
  c.d_model = d;
  c.d_kv_in = dkv;
  c.heads = h;
  c.kv_heads = hkv;
  c.head_dim = dk;
  return c;
}

std::vector<ParityCase> Cases() {
  std::vector<ParityCase> cases;
  cases.push_back(Case("mha_self", 2, 7, 7, 32, 0, 4, 4, 8));
  cases.push_back(Case("gqa_self", 2, 9, 9, 32, 0, 4, 2, 8));
  cases.push_back(Case("mqa_self", 2, 9, 9, 32, 0, 4, 1, 8));
  cases.push_back(Case("cross_tq_ne_tk", 3, 5, 11, 24, 40, 6, 3, 4));
  cases.push_back(Case("head_dim_not_d_over_h", 2, 6, 6, 16, 0, 4, 4, 12));
  ParityCase c = Case("causal_self", 2, 13, 13, 32, 0, 4, 4, 8);
  c.causal = true;
  cases.push_back(c);
  c = Case("causal_decode_tq_lt_tk", 2, 3, 17, 32, 32, 4, 2, 8);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  c = Case("causal_tq_gt_tk_masks_early_rows", 2, 9, 4, 16, 16, 2, 2, 8);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  c = Case("key_lengths", 5, 6, 10, 16, 16, 2, 2, 8);
  c.key_lengths = true;
  c.weights = true;
  cases.push_back(c);
  c = Case("additive_mask_shared", 2, 6, 8, 16, 16, 2, 1, 8);
  c.mask = Mask::kShared;
  c.weights = true;
  cases.push_back(c);
  c = Case("additive_mask_per_batch_with_causal_and_lengths", 4, 8, 8, 16, 0, 4, 2, 4);
  c.mask = Mask::kPerBatch;
  c.causal = true;
  c.key_lengths = true;
  c.weights = true;
  cases.push_back(c);
  c = Case("biases", 2, 5, 5, 24, 0, 3, 3, 8);
  c.bias = true;
  cases.push_back(c);
  c = Case("biases_cross", 2, 5, 6, 24, 12, 3, 1, 8);
  c.bias = true;
  cases.push_back(c);
  c = Case("head_mask", 2, 5, 5, 24, 0, 6, 3, 4);
  c.head_mask = true;
  cases.push_back(c);
  c = Case("weights_returned", 3, 16, 16, 32, 0, 4, 4, 8);
  c.weights = true;
  cases.push_back(c);
  c = Case("demo_sized", 2, 64, 64, 512, 0, 8, 8, 64);
  c.weights = true;
  c.atol = 5e-5;
  cases.push_back(c);
  // Many query blocks (64 rows) and key blocks (256 keys): the online softmax carries its running max and sum
  // across key blocks, with causal and lengths skipping blocks and an additive mask inside them.
  c = Case("online_softmax_many_blocks_causal_mask", 2, 300, 1000, 32, 32, 8, 4, 4);
  c.causal = true;
  c.mask = Mask::kPerBatch;
  cases.push_back(c);
  c = Case("online_softmax_many_blocks_key_lengths", 5, 130, 3000, 16, 16, 16, 16, 1);
  c.key_lengths = true;
  cases.push_back(c);
  c = Case("exact_softmax_many_blocks_weights", 1, 400, 3000, 32, 32, 8, 4, 4);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  // Head sizes the tile kernels take (multiples of 8 or 16 floats), with panels of rows and blocks of columns
  // cut at odd places: Tq not a multiple of 6, Tk not a multiple of 16 or 64, several 512-key blocks.
  c = Case("tiles_dk16_causal_mask_lengths", 2, 37, 301, 64, 64, 4, 2, 16);
  c.causal = true;
  c.key_lengths = true;
  c.mask = Mask::kPerBatch;
  cases.push_back(c);
  c.name = "tiles_dk16_causal_mask_lengths_weights";
  c.weights = true;
  cases.push_back(c);
  c = Case("tiles_dk48_causal_many_key_blocks", 1, 70, 1100, 96, 96, 2, 1, 48);
  c.causal = true;
  cases.push_back(c);
  c = Case("tiles_dk64_lengths_many_key_blocks", 3, 140, 1300, 128, 0, 2, 2, 64);
  c.q_len = c.kv_len = 1300;
  c.key_lengths = true;
  c.atol = 5e-5;
  cases.push_back(c);
  c = Case("tiles_dk80_weights_cross", 2, 13, 77, 160, 40, 2, 2, 80);
  c.weights = true;
  c.atol = 5e-5;
  cases.push_back(c);
  c = Case("tiles_dk8_gqa_weights", 2, 19, 23, 32, 0, 4, 2, 8);
  c.weights = true;
  cases.push_back(c);
  c = Case("mask_lowest_and_largest_floats", 2, 9, 40, 64, 64, 4, 2, 16);
  c.mask = Mask::kExtremes;
  cases.push_back(c);
  c.name = "mask_lowest_and_largest_floats_weights";
  c.weights = true;
  cases.push_back(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CpuParityTest,
    ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::Values("auto", "avx512", "avx2", "sgemm")),
    [](const ::testing::TestParamInfo<CpuParityTest::ParamType>& info) {
      return std::get<0>(info.param).name + "_" + std::get<1>(info.param);
    });

TEST(CpuBackend, ScaledDotProductAttentionMatchesReference) {
  AttentionDims d;
  d.batch = 2;
  d.q_len = 5;
  d.kv_len = 9;
  d.num_heads = 4;
  d.num_kv_heads = 2;
  d.head_dim = 8;
  d.causal = true;
  d.scale = 0.3f;
  const std::vector<float> q = RandomVector(2 * 5 * 4 * 8, 1), k = RandomVector(2 * 9 * 2 * 8, 2),
                           v = RandomVector(2 * 9 * 2 * 8, 3);
  const std::vector<int32_t> lengths = {9, 4};
  auto run = [&](Backend& backend, std::vector<float>* weights) {
    std::vector<float> out(q.size());
    weights->assign(2 * 4 * 5 * 9, 0.0f);
    SdpaArgs a;
    a.dims = d;
    a.mask.key_lengths = lengths;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.out = out.data();
    a.weights = weights->data();
    EXPECT_OK(backend.ScaledDotProductAttention(a));
    return out;
  };
  ReferenceBackend reference;
  auto cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok());
  std::vector<float> want_w, got_w;
  const std::vector<float> want = run(reference, &want_w);
  const std::vector<float> got = run(**cpu, &got_w);
  EXPECT_TRUE(AllClose(got, want, 1e-5, 1e-4));
  EXPECT_TRUE(AllClose(got_w, want_w, 1e-6, 1e-4));
}

TEST(CpuBackend, ScaleBeyondLog2RangeStillMatchesReference) {
  // The tile kernels fold log2 e into the query scale only while scale * log2 e stays finite. A larger finite
  // scale (3e38 against FLT_MAX / log2 e = 2.4e38) on tiny queries and keys gives ordinary scores, and must give
  // the reference's result rather than inf or NaN.
  AttentionDims d;
  d.batch = 1;
  d.q_len = 6;
  d.kv_len = 20;
  d.num_heads = d.num_kv_heads = 2;
  d.head_dim = 16;
  d.scale = 3e38f;
  const std::vector<float> q = RandomVector(6 * 2 * 16, 4, 1e-18f), k = RandomVector(20 * 2 * 16, 5, 1e-19f),
                           v = RandomVector(20 * 2 * 16, 6);
  auto run = [&](Backend& backend) {
    std::vector<float> out(q.size(), std::nanf(""));
    SdpaArgs a;
    a.dims = d;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.out = out.data();
    EXPECT_OK(backend.ScaledDotProductAttention(a));
    return out;
  };
  ReferenceBackend reference;
  const std::vector<float> want = run(reference);
  for (const char* kernels : {"avx512", "avx2"}) {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(kernels);
    if (absl::IsUnavailable(cpu.status())) continue;
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    EXPECT_TRUE(AllClose(run(**cpu), want, 1e-5, 1e-4)) << kernels;
  }
}

}  // namespace
}  // namespace mha
