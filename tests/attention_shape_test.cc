// What a call costs, defined once (proto/mha/v1/attention_shape.h): AttentionFlops, VisiblePairs, ExtendFlops and
// KvCacheBytes, which the scheduler, the metrics, the clients and the benchmarks all count with; and how
// ResolveHeads reads HeadConfig.rope_scaling.
#include "proto/mha/v1/attention_shape.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

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

// --- HeadConfig.rope_scaling ---------------------------------------------------------------------------------

// 4 heads of 16 with RoPE (theta 10000) and `scaling`.
v1::HeadConfig RopeHeads(const std::string& type) {
  v1::HeadConfig c;
  c.set_num_heads(4);
  c.set_head_dim(16);
  c.set_rope_theta(10000);
  c.mutable_rope_scaling()->set_rope_type(type);
  return c;
}

struct BadScaling {
  std::string name;
  std::function<void(v1::HeadConfig*)> edit;
  std::string message;  // what the INVALID_ARGUMENT says
};

std::ostream& operator<<(std::ostream& os, const BadScaling& b) { return os << b.name; }

std::vector<BadScaling> BadScalings() {
  using C = v1::HeadConfig;
  const auto r = [](C* c) { return c->mutable_rope_scaling(); };
  return {
      {"unknown_type", [&](C* c) { r(c)->set_rope_type("ntk"); },
       "heads.rope_scaling.rope_type must be one of default, linear, dynamic, yarn, longrope, llama3 (transformers' "
       "names), got 'ntk'"},
      {"without_rope_theta", [&](C* c) { c->set_rope_theta(0); },
       "heads.rope_scaling.rope_type is 'linear' but rope_theta is 0 (no RoPE)"},
      {"a_default_type_with_a_factor_and_no_rope",
       [&](C* c) {
         c->set_rope_theta(0);
         r(c)->set_rope_type("default");
       },
       "heads.rope_scaling.factor is set, but rope_type 'default' does not read it"},
      {"a_field_the_type_does_not_read", [&](C* c) { r(c)->set_beta_fast(16); },
       "heads.rope_scaling.beta_fast is set, but rope_type 'linear' does not read it"},
      {"truncate_outside_yarn", [&](C* c) { r(c)->set_truncate(false); },
       "heads.rope_scaling.truncate is set, but rope_type 'linear' does not read it"},
      {"linear_without_factor", [&](C* c) { r(c)->clear_factor(); },
       "heads.rope_scaling.factor is required (rope_type 'linear') and must be > 0"},
      {"nan_factor", [&](C* c) { r(c)->set_factor(std::nan("")); },
       "heads.rope_scaling.factor must be finite and >= 0, got nan"},
      {"negative_factor", [&](C* c) { r(c)->set_factor(-2); },
       "heads.rope_scaling.factor must be finite and >= 0, got -2"},
      {"llama3_without_original", [&](C* c) { r(c)->set_rope_type("llama3"); },
       "heads.rope_scaling.original_max_position_embeddings is required (rope_type 'llama3')"},
      {"llama3_high_not_above_low",
       [&](C* c) {
         r(c)->set_rope_type("llama3");
         r(c)->set_original_max_position_embeddings(64);
         r(c)->set_low_freq_factor(4);
         r(c)->set_high_freq_factor(4);
       },
       "heads.rope_scaling.high_freq_factor must satisfy 0 < low_freq_factor < high_freq_factor (rope_type "
       "'llama3'), got 4 and 4"},
      {"dynamic_without_max", [&](C* c) { r(c)->set_rope_type("dynamic"); },
       "heads.rope_scaling.max_position_embeddings is required (rope_type 'dynamic')"},
      {"dynamic_on_two_dims",
       [&](C* c) {
         r(c)->set_rope_type("dynamic");
         r(c)->set_max_position_embeddings(128);
         c->set_rope_dim(2);
       },
       "heads.rope_scaling.rope_type 'dynamic' needs rope_dim >= 4, got 2"},
      {"negative_max",
       [&](C* c) {
         r(c)->set_rope_type("dynamic");
         r(c)->set_max_position_embeddings(-1);
       },
       "heads.rope_scaling.max_position_embeddings must be >= 0, got -1"},
      {"yarn_without_factor_or_max",
       [&](C* c) {
         r(c)->set_rope_type("yarn");
         r(c)->clear_factor();
         r(c)->set_original_max_position_embeddings(64);
       },
       "heads.rope_scaling.factor is 0, so max_position_embeddings is required (rope_type 'yarn'): the factor is then "
       "max_position_embeddings / original_max_position_embeddings"},
      {"yarn_negative_attention_factor",
       [&](C* c) {
         r(c)->set_rope_type("yarn");
         r(c)->set_original_max_position_embeddings(64);
         r(c)->set_attention_factor(-1);
       },
       "heads.rope_scaling.attention_factor must be finite and >= 0, got -1"},
      {"longrope_short_list",
       [&](C* c) {
         r(c)->set_rope_type("longrope");
         r(c)->set_original_max_position_embeddings(64);
         for (int i = 0; i < 7; ++i) r(c)->add_short_factor(1);
       },
       "heads.rope_scaling.short_factor must hold rope_dim / 2 = 8 values (rope_type 'longrope'), got 7"},
      {"longrope_zero_entry",
       [&](C* c) {
         r(c)->set_rope_type("longrope");
         r(c)->set_original_max_position_embeddings(64);
         for (int i = 0; i < 8; ++i) r(c)->add_short_factor(1);
         for (int i = 0; i < 8; ++i) r(c)->add_long_factor(i == 3 ? 0 : 2);
       },
       "heads.rope_scaling.long_factor[3] must be finite and > 0, got 0"},
      // Finite fields whose frequencies would not be: NaN outputs (every rotated dim) if accepted.
      {"yarn_theta_one",
       [&](C* c) {
         c->set_rope_theta(1);
         r(c)->set_rope_type("yarn");
         r(c)->set_original_max_position_embeddings(4096);
       },
       "heads.rope_theta must not be 1 with rope_type 'yarn' (its ramp divides by log(rope_theta))"},
      {"yarn_mscale_divisor_zero",
       [&](C* c) {
         r(c)->set_rope_type("yarn");
         r(c)->set_factor(std::exp(1.0));
         r(c)->set_original_max_position_embeddings(4096);
         r(c)->set_mscale(1);
         r(c)->set_mscale_all_dim(-10);
       },
       "heads.rope_scaling.mscale_all_dim makes the attention factor's divisor 0.1 mscale_all_dim log(factor) + 1 "
       "zero; set attention_factor or another mscale_all_dim"},
      {"longrope_original_one",
       [&](C* c) {
         r(c)->set_rope_type("longrope");
         r(c)->set_original_max_position_embeddings(1);
         for (int i = 0; i < 8; ++i) r(c)->add_short_factor(1);
         for (int i = 0; i < 8; ++i) r(c)->add_long_factor(2);
       },
       "heads.rope_scaling.original_max_position_embeddings must be > 1 with rope_type 'longrope' and factor > 1 "
       "unless attention_factor is set (its default divides by log(original_max_position_embeddings))"},
  };
}

class RopeScalingRefusalTest : public ::testing::TestWithParam<BadScaling> {};

TEST_P(RopeScalingRefusalTest, IsInvalidArgumentNamingTheField) {
  v1::HeadConfig c = RopeHeads("linear");
  c.mutable_rope_scaling()->set_factor(4);
  GetParam().edit(&c);
  const absl::StatusOr<HeadSpec> h = ResolveHeads(c, HeadSpec(), "", 64, "heads");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.status().message(), GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(Fields, RopeScalingRefusalTest, ::testing::ValuesIn(BadScalings()),
                         [](const auto& info) { return info.param.name; });

// One valid configuration of each type, as transformers' configs carry them.
std::vector<v1::HeadConfig> ValidScalings() {
  std::vector<v1::HeadConfig> all;
  v1::HeadConfig c = RopeHeads("linear");
  c.mutable_rope_scaling()->set_factor(4);
  all.push_back(c);
  c = RopeHeads("dynamic");
  c.mutable_rope_scaling()->set_factor(2);
  c.mutable_rope_scaling()->set_max_position_embeddings(2048);
  all.push_back(c);
  c = RopeHeads("yarn");
  c.mutable_rope_scaling()->set_factor(4);
  c.mutable_rope_scaling()->set_original_max_position_embeddings(32768);
  c.mutable_rope_scaling()->set_truncate(false);
  all.push_back(c);
  c = RopeHeads("longrope");
  c.mutable_rope_scaling()->set_original_max_position_embeddings(4096);
  c.mutable_rope_scaling()->set_max_position_embeddings(131072);
  for (int i = 0; i < 8; ++i) c.mutable_rope_scaling()->add_short_factor(1 + i);
  for (int i = 0; i < 8; ++i) c.mutable_rope_scaling()->add_long_factor(2 + i);
  all.push_back(c);
  c = RopeHeads("llama3");
  c.mutable_rope_scaling()->set_factor(8);
  c.mutable_rope_scaling()->set_low_freq_factor(1);
  c.mutable_rope_scaling()->set_high_freq_factor(4);
  c.mutable_rope_scaling()->set_original_max_position_embeddings(8192);
  all.push_back(c);
  return all;
}

TEST(RopeScaling, EveryTypeResolvesAndSurvivesTheWireForm) {
  for (const v1::HeadConfig& c : ValidScalings()) {
    const absl::StatusOr<HeadSpec> h = ResolveHeads(c, HeadSpec(), "", 64, "heads");
    ASSERT_TRUE(h.ok()) << c.rope_scaling().rope_type() << ": " << h.status();
    EXPECT_EQ(RopeTypeName(h->rope_scaling.type), c.rope_scaling().rope_type());
    const absl::StatusOr<HeadSpec> again = ResolveHeads(HeadConfigOf(*h), HeadSpec(), "", 64, "heads");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->rope_scaling == h->rope_scaling) << c.rope_scaling().rope_type();
  }
}

TEST(RopeScaling, YarnTakesTransformersDefaultsForItsUnsetFields) {
  v1::HeadConfig c = RopeHeads("yarn");
  c.mutable_rope_scaling()->set_factor(4);
  c.mutable_rope_scaling()->set_original_max_position_embeddings(128);
  const HeadSpec h = *ResolveHeads(c, HeadSpec(), "", 64, "heads");
  EXPECT_EQ(h.rope_scaling.beta_fast, 32);
  EXPECT_EQ(h.rope_scaling.beta_slow, 1);
  EXPECT_TRUE(h.rope_scaling.truncate);
}

TEST(RopeScaling, ADefaultTypeIsNoScaling) {
  for (const std::string type : {"", "default"}) {
    const absl::StatusOr<HeadSpec> h = ResolveHeads(RopeHeads(type), HeadSpec(), "", 64, "heads");
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_FALSE(h->rope_scaling.scaled());
  }
}

TEST(RopeScaling, ALayersScalingIsInheritedAndMustNotBeContradicted) {
  const HeadSpec layer = *ResolveHeads(ValidScalings().back(), HeadSpec(), "", 64, "heads");  // llama3
  v1::HeadConfig call;
  EXPECT_TRUE(ResolveHeads(call, layer, "layer 'l'", 64, "heads")->rope_scaling == layer.rope_scaling);
  *call.mutable_rope_scaling() = ValidScalings()[0].rope_scaling();  // linear
  const absl::StatusOr<HeadSpec> other = ResolveHeads(call, layer, "layer 'l'", 64, "heads");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other.status().message(),
            "heads.rope_scaling (linear) disagrees with layer 'l' (llama3); leave it unset to use that");
}

}  // namespace
}  // namespace mha
