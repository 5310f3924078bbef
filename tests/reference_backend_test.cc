// The reference backend on cases small enough to compute by hand. It is the ground truth of every other test,
// so these pin down the math itself: scaling, softmax, masking rules, GQA head sharing, projections.
#include "server/backends/reference/reference_backend.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

AttentionShape Dims(int64_t b, int64_t tq, int64_t tk, int64_t h, int64_t hkv, int64_t dk, float scale = 1.0f,
                    bool causal = false) {
  AttentionShape d;
  d.batch = b;
  d.q_len = tq;
  d.kv_len = tk;
  d.heads.num_heads = h;
  d.heads.num_kv_heads = hkv;
  d.heads.head_dim = dk;
  d.heads.scale = scale;
  d.heads.causal = causal;
  return d;
}

struct Sdpa {
  std::vector<float> out, weights;
};

Sdpa RunSdpa(const AttentionShape& d, const std::vector<float>& q, const std::vector<float>& k,
             const std::vector<float>& v, AttentionMask mask = {}) {
  ReferenceBackend backend;
  Sdpa r;
  r.out.assign(d.batch * d.q_len * d.heads.num_heads * d.heads.head_dim, -1.0f);
  r.weights.assign(d.batch * d.heads.num_heads * d.q_len * d.kv_len, -1.0f);
  SdpaArgs args;
  args.shape = d;
  args.mask = mask;
  args.q = {q.data(), v1::FP32};
  args.k = {k.data(), v1::FP32};
  args.v = {v.data(), v1::FP32};
  args.out = {r.out.data(), v1::FP32};
  args.weights = {r.weights.data(), v1::FP32};
  EXPECT_OK(backend.ScaledDotProductAttention(args));
  return r;
}

TEST(ReferenceBackend, EqualScoresAverageTheValues) {
  // q is orthogonal to every key, so all scores are 0 and the output is the mean of V.
  const AttentionShape d = Dims(1, 1, 3, 1, 1, 2);
  const Sdpa r = RunSdpa(d, {0, 0}, {1, 2, 3, 4, 5, 6}, {1, 10, 2, 20, 6, 60});
  EXPECT_FLOAT_EQ(r.out[0], 3.0f);
  EXPECT_FLOAT_EQ(r.out[1], 30.0f);
  for (float w : r.weights) EXPECT_FLOAT_EQ(w, 1.0f / 3.0f);
}

TEST(ReferenceBackend, DominantScorePicksItsValueRow) {
  const AttentionShape d = Dims(1, 1, 3, 1, 1, 1, /*scale=*/100.0f);
  const Sdpa r = RunSdpa(d, {1}, {0, 1, 0}, {7, 8, 9});
  EXPECT_NEAR(r.out[0], 8.0f, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.0f, 1e-6);
}

TEST(ReferenceBackend, ScaleMultipliesTheScores) {
  // Two keys with scores 0 and scale * 1: the weights are softmax([0, scale]).
  const float scale = 1.0f / std::sqrt(4.0f);
  const AttentionShape d = Dims(1, 1, 2, 1, 1, 4, scale);
  const Sdpa r = RunSdpa(d, {1, 0, 0, 0}, {0, 0, 0, 0, 1, 0, 0, 0}, {0, 0, 0, 0, 1, 1, 1, 1});
  const double want = std::exp(scale) / (1.0 + std::exp(scale));
  EXPECT_NEAR(r.weights[1], want, 1e-7);
  EXPECT_NEAR(r.out[0], want, 1e-7);
}

TEST(ReferenceBackend, CausalIsBottomRightAligned) {
  // Tq = 2, Tk = 4: query 0 sees keys 0..2, query 1 sees keys 0..3.
  const AttentionShape d = Dims(1, 2, 4, 1, 1, 1, 1.0f, /*causal=*/true);
  const Sdpa r = RunSdpa(d, {0, 0}, {0, 0, 0, 0}, {1, 2, 3, 4});
  EXPECT_FLOAT_EQ(r.weights[3], 0.0f);
  EXPECT_NEAR(r.out[0], 2.0f, 1e-6);  // mean of 1, 2, 3
  EXPECT_NEAR(r.out[1], 2.5f, 1e-6);  // mean of 1..4
}

TEST(ReferenceBackend, CausalWithEqualLengthsIsLowerTriangular) {
  const AttentionShape d = Dims(1, 3, 3, 1, 1, 1, 1.0f, true);
  const Sdpa r = RunSdpa(d, {0, 0, 0}, {0, 0, 0}, {3, 6, 9});
  EXPECT_NEAR(r.out[0], 3.0f, 1e-6);
  EXPECT_NEAR(r.out[1], 4.5f, 1e-6);
  EXPECT_NEAR(r.out[2], 6.0f, 1e-6);
  EXPECT_FLOAT_EQ(r.weights[1], 0.0f);
  EXPECT_FLOAT_EQ(r.weights[2], 0.0f);
  EXPECT_FLOAT_EQ(r.weights[5], 0.0f);
}

TEST(ReferenceBackend, CausalQueryBeforeAllKeysIsFullyMaskedAndZero) {
  // Tq = 3 > Tk = 1: query 0 may see key j iff j <= 0 + (1 - 3) = -2: none.
  const AttentionShape d = Dims(1, 3, 1, 1, 1, 1, 1.0f, true);
  const Sdpa r = RunSdpa(d, {1, 1, 1}, {1}, {5});
  EXPECT_EQ(r.out[0], 0.0f);
  EXPECT_EQ(r.out[1], 0.0f);
  EXPECT_NEAR(r.out[2], 5.0f, 1e-6);
  EXPECT_EQ(r.weights[0], 0.0f);
}

TEST(ReferenceBackend, KeyLengthZeroGivesZeroRowsNotNaN) {
  const AttentionShape d = Dims(2, 1, 2, 1, 1, 1);
  const std::vector<int32_t> lengths = {0, 1};
  AttentionMask mask;
  mask.key_lengths = lengths;
  const Sdpa r = RunSdpa(d, {1, 1}, {1, 1, 1, 1}, {4, 5, 6, 7}, mask);
  EXPECT_EQ(r.out[0], 0.0f);
  EXPECT_EQ(r.weights[0], 0.0f);
  EXPECT_EQ(r.weights[1], 0.0f);
  EXPECT_NEAR(r.out[1], 6.0f, 1e-6);  // batch 1 sees only its key 0
}

TEST(ReferenceBackend, AllMinusInfAdditiveMaskGivesZeroRow) {
  const AttentionShape d = Dims(1, 2, 2, 1, 1, 1);
  const std::vector<float> additive = {kNegInf, kNegInf, 0.0f, kNegInf};
  AttentionMask mask;
  mask.additive = additive.data();
  const Sdpa r = RunSdpa(d, {1, 1}, {1, 2}, {10, 20}, mask);
  EXPECT_EQ(r.out[0], 0.0f);
  EXPECT_NEAR(r.out[1], 10.0f, 1e-6);
  EXPECT_EQ(r.weights[0] + r.weights[1], 0.0f);
}

TEST(ReferenceBackend, MasksCombine) {
  // causal (Tq == Tk == 3) AND key_lengths = 2 AND an additive -inf on key 0 of query 2: query 2 sees key 1 only.
  const AttentionShape d = Dims(1, 3, 3, 1, 1, 1, 1.0f, true);
  const std::vector<int32_t> lengths = {2};
  const std::vector<float> additive = {0, 0, 0, 0, 0, 0, kNegInf, 0, 0};
  AttentionMask mask;
  mask.key_lengths = lengths;
  mask.additive = additive.data();
  const Sdpa r = RunSdpa(d, {0, 0, 0}, {0, 0, 0}, {1, 2, 3}, mask);
  EXPECT_NEAR(r.out[0], 1.0f, 1e-6);
  EXPECT_NEAR(r.out[1], 1.5f, 1e-6);
  EXPECT_NEAR(r.out[2], 2.0f, 1e-6);
}

TEST(ReferenceBackend, GroupedQueryHeadsShareConsecutively) {
  // H = 4, Hkv = 2: heads 0,1 use KV head 0 and heads 2,3 use KV head 1. One key, so out = v of the KV head.
  const AttentionShape d = Dims(1, 1, 1, 4, 2, 1);
  const Sdpa r = RunSdpa(d, {1, 1, 1, 1}, {1, 1}, {10, 20});
  EXPECT_FLOAT_EQ(r.out[0], 10.0f);
  EXPECT_FLOAT_EQ(r.out[1], 10.0f);
  EXPECT_FLOAT_EQ(r.out[2], 20.0f);
  EXPECT_FLOAT_EQ(r.out[3], 20.0f);
}

TEST(ReferenceBackend, MultiHeadProjectsAttendsAndMixes) {
  // d_model = 2, H = 2, d_k = 1, identity projections, one token: each head attends to itself, so the output is
  // x W_O + b_O with W_O swapping the two features, times the head mask.
  AttentionShape d = Dims(1, 1, 1, 2, 2, 1);
  d.d_model = d.d_kv_in = d.d_v_in = 2;
  const std::vector<float> x = {3, 5}, eye = {1, 0, 0, 1}, swap = {0, 1, 1, 0}, b_o = {0.5f, -0.5f};
  const std::vector<float> head_mask = {1.0f, 0.0f};
  LayerWeights w;
  w.w_q = w.w_k = w.w_v = eye.data();
  w.ld_q = w.ld_k = w.ld_v = 2;
  w.w_o = swap.data();
  w.b_o = b_o.data();
  std::vector<float> out(2), weights(2);
  MhaArgs args;
  args.shape = d;
  args.weights = w;
  args.kv_source = KvSource::kQuery;
  args.query = args.key = args.value = {x.data(), v1::FP32};
  args.head_mask = head_mask;
  args.out = {out.data(), v1::FP32};
  args.attention_weights = {weights.data(), v1::FP32};
  ReferenceBackend backend;
  ASSERT_OK(backend.MultiHeadAttention(args));
  EXPECT_FLOAT_EQ(out[0], 0.5f);         // head 1 (value 5) is masked out
  EXPECT_FLOAT_EQ(out[1], 3.0f - 0.5f);  // head 0 (value 3) lands in feature 1
  EXPECT_FLOAT_EQ(weights[0], 1.0f);
}

}  // namespace
}  // namespace mha
