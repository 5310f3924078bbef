// What a call costs, defined once (proto/mha/v1/attention_shape.h): AttentionFlops, VisiblePairs, ExtendFlops and
// KvCacheBytes, which the scheduler, the metrics, the clients and the benchmarks all count with.
#include "proto/mha/v1/attention_shape.h"

#include <algorithm>
#include <utility>

#include "gtest/gtest.h"

namespace mha {
namespace {

// The demo layer's shape: d_model 512, 8 heads of 64.
AttentionShape DemoShape(int64_t batch, int64_t seq) {
  AttentionShape s;
  s.batch = batch;
  s.q_len = s.kv_len = seq;
  s.d_model = s.d_kv_in = s.d_v_in = 512;
  s.heads.num_heads = s.heads.num_kv_heads = 8;
  s.heads.head_dim = 64;
  return s;
}

TEST(AttentionFlops, MatchesTheFormula) {
  // 2 B Tq d H dk + 4 B Tk dkv Hkv dk + 2 B Tq H dk d + 4 B H Tq Tk dk for B=8, T=512, d=512, H=8, dk=64.
  AttentionShape s = DemoShape(8, 512);
  const double projections = 2.0 * 8 * 512 * 512 * 8 * 64 + 4.0 * 8 * 512 * 512 * 8 * 64 + 2.0 * 8 * 512 * 8 * 64 * 512;
  const double attention = 4.0 * 8 * 8 * 512 * 512 * 64;
  EXPECT_DOUBLE_EQ(AttentionFlops(s), projections + attention);
  // Causal: only the T (T + 1) / 2 visible pairs.
  s.heads.causal = true;
  EXPECT_DOUBLE_EQ(AttentionFlops(s), projections + attention * (512.0 * 513 / 2) / (512.0 * 512));
  // GQA: K and V projections shrink with Hkv.
  s.heads.causal = false;
  s.heads.num_kv_heads = 2;
  EXPECT_DOUBLE_EQ(AttentionFlops(s), projections - 4.0 * 8 * 512 * 512 * 6 * 64 + attention);
  // Attention alone (no projections), as ScaledDotProductAttention counts it.
  s.d_model = s.d_kv_in = s.d_v_in = 0;
  EXPECT_DOUBLE_EQ(AttentionFlops(s), attention);
}

TEST(VisiblePairs, CountsBottomRightCausalRowsExactly) {
  AttentionShape s;
  s.heads.causal = true;
  // Row i of Tq rows sees min(Tk, max(0, i + Tk - Tq + 1)) keys.
  for (const auto& [tq, tk] : {std::pair{1, 10}, {3, 17}, {9, 4}, {13, 13}, {4, 1}}) {
    s.q_len = tq;
    s.kv_len = tk;
    double want = 0;
    for (int i = 0; i < tq; ++i) want += std::min(tk, std::max(0, i + tk - tq + 1));
    EXPECT_DOUBLE_EQ(VisiblePairs(s), want) << "Tq=" << tq << " Tk=" << tk;
  }
  s.heads.causal = false;
  EXPECT_DOUBLE_EQ(VisiblePairs(s), 4.0 * 1);
}

TEST(ExtendFlops, APrefillOnAnEmptyCacheCostsACausalSelfAttentionCall) {
  AttentionShape s = DemoShape(1, 300);
  s.heads.causal = true;
  EXPECT_DOUBLE_EQ(ExtendFlops(s.heads, 512, 0, 300, true), AttentionFlops(s));
  s.d_model = s.d_kv_in = s.d_v_in = 0;  // head sessions project nothing
  EXPECT_DOUBLE_EQ(ExtendFlops(s.heads, 0, 0, 300, true), AttentionFlops(s));
}

TEST(ExtendFlops, ChunksAddUpToTheWholeCall) {
  HeadSpec heads = DemoShape(1, 1).heads;
  heads.num_kv_heads = 2;
  const double whole = ExtendFlops(heads, 512, 100, 256, true);
  EXPECT_DOUBLE_EQ(ExtendFlops(heads, 512, 100, 128, true) + ExtendFlops(heads, 512, 228, 128, true), whole);
}

TEST(ExtendFlops, ADecodeStepAttendsToTheCacheAndItself) {
  const HeadSpec heads = DemoShape(1, 1).heads;
  // 4 H d_k per visible pair: the 1000 cached tokens and the new one.
  EXPECT_DOUBLE_EQ(ExtendFlops(heads, 0, 1000, 1, true), 4.0 * 8 * 64 * 1001);
  // Without append, the new tokens see the cache alone, every one of its tokens.
  EXPECT_DOUBLE_EQ(ExtendFlops(heads, 0, 1000, 3, false), 4.0 * 8 * 64 * 3000);
}

TEST(KvCacheBytes, IsKAndVOfEveryKvHead) {
  HeadSpec heads;
  heads.num_heads = 32;
  heads.num_kv_heads = 8;
  heads.head_dim = 128;
  EXPECT_DOUBLE_EQ(KvCacheBytes(heads, 2048, 2), 2.0 * 8 * 128 * 2048 * 2);
}

}  // namespace
}  // namespace mha
