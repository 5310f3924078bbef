// The scaled RoPE frequencies (rope_frequencies.h) against transformers' own rope init functions: each row's values
// were printed by transformers 5.25's ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len) on a LlamaConfig with
// those rope_parameters (fp32 there, double here: within 2e-6 relative). tests/models/test_rope_scaling.py checks
// whole attention calls against transformers at run time; this suite needs no Python.
#include "server/backends/rope_frequencies.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace mha {
namespace {

using Type = RopeScaling::Type;

struct Golden {
  std::string name;
  int64_t rope_dim;
  double theta;
  RopeScaling scaling;
  int64_t seq_len;
  double attention_factor;
  std::vector<std::pair<int, double>> inv_freq;  // (pair, transformers' value)
};

std::ostream& operator<<(std::ostream& os, const Golden& g) { return os << g.name; }

RopeScaling Make(Type type, double factor, int64_t original, int64_t max = 0) {
  RopeScaling r;
  r.type = type;
  r.factor = factor;
  r.original_max_position_embeddings = original;
  r.max_position_embeddings = max;
  return r;
}

std::vector<double> Ramp(int n, double step) {
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back(1.0 + step * i);
  return v;
}

std::vector<Golden> Goldens() {
  std::vector<Golden> g;
  RopeScaling llama3 = Make(Type::kLlama3, 8, 8192);  // LLaMA 3.1's
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  g.push_back({"llama3_8b_3_1", 128, 500000, llama3, 0, 1.0,
               {{0, 1}, {1, 0.814617217}, {16, 0.0376060307}, {21, 0.0134904198}, {32, 0.000524846022},
                {42, 2.2748929e-05}, {48, 6.64786967e-06}, {62, 3.7673226e-07}, {63, 3.06892588e-07}}});
  g.push_back({"yarn_qwen2_5", 128, 1e6, Make(Type::kYarn, 4, 32768), 0, 1.13862944,
               {{0, 1}, {1, 0.805842221}, {16, 0.0316227786}, {21, 0.0107460786}, {32, 0.000602941145},
                {42, 2.88695483e-05}, {48, 7.90569356e-06}, {62, 3.84981632e-07}, {63, 3.10234441e-07}}});
  RopeScaling mscale = Make(Type::kYarn, 40, 4096);
  mscale.mscale = 1.0;
  mscale.mscale_all_dim = 0.5;
  g.push_back({"yarn_mscale_deepseek_like", 64, 10000, mscale, 0, 1.15572199,
               {{0, 1}, {1, 0.749894202}, {8, 0.100000001}, {10, 0.0562341288}, {16, 0.00550000044},
                {21, 0.000414990413}, {24, 2.49999994e-05}, {30, 4.44569832e-06}, {31, 3.33380353e-06}}});
  RopeScaling untruncated = Make(Type::kYarn, 16, 2048);
  untruncated.truncate = false;
  untruncated.beta_fast = 24;
  untruncated.beta_slow = 2;
  g.push_back({"yarn_untruncated_betas", 64, 10000, untruncated, 0, 1.27725887,
               {{0, 1}, {1, 0.749894202}, {8, 0.100000001}, {10, 0.0505155288}, {16, 0.00246771728},
                {21, 0.000148210864}, {24, 6.2500003e-05}, {30, 1.11142463e-05}, {31, 8.3345094e-06}}});
  // Phi-3's shape: the factor from max_position_embeddings / original_max_position_embeddings (32).
  RopeScaling longrope = Make(Type::kLongrope, 0, 4096, 131072);
  longrope.short_factor = Ramp(48, 0.01);
  longrope.long_factor = Ramp(48, 0.5);
  g.push_back({"longrope_short", 96, 10000, longrope, 100, 1.19023807,
               {{0, 1}, {1, 0.817231834}, {12, 0.0892857164}, {16, 0.0400136933}, {24, 0.00806451589},
                {32, 0.00163214712}, {36, 0.000735294132}, {46, 0.000100534213}, {47, 8.24168383e-05}}});
  g.push_back({"longrope_long", 96, 10000, longrope, 5000, 1.19023807,
               {{0, 1}, {1, 0.550269425}, {12, 0.0142857144}, {16, 0.00515732029}, {24, 0.00076923077},
                {32, 0.000126731422}, {36, 5.2631578e-05}, {46, 6.11583164e-06}, {47, 4.94501046e-06}}});
  g.push_back({"dynamic_past_max", 64, 10000, Make(Type::kDynamic, 2, 0, 2048), 5000, 1.0,
               {{0, 1}, {1, 0.717786491}, {8, 0.0704631805}, {10, 0.0363038555}, {16, 0.00496505899},
                {21, 0.000946020999}, {24, 0.000349853857}, {30, 4.78473958e-05}, {31, 3.43442152e-05}}});
  g.push_back({"dynamic_within_max", 64, 10000, Make(Type::kDynamic, 2, 0, 2048), 1000, 1.0,
               {{0, 1}, {1, 0.749894202}, {8, 0.100000001}, {10, 0.0562341288}, {16, 0.00999999978},
                {21, 0.00237137382}, {24, 0.00100000005}, {30, 0.00017782794}, {31, 0.00013335215}}});
  g.push_back({"linear", 64, 10000, Make(Type::kLinear, 4, 0), 0, 1.0,
               {{0, 0.25}, {1, 0.18747355}, {8, 0.0250000004}, {10, 0.0140585322}, {16, 0.00249999994},
                {21, 0.000592843455}, {24, 0.000250000012}, {30, 4.44569851e-05}, {31, 3.33380376e-05}}});
  return g;
}

HeadSpec Heads(int64_t rope_dim, double theta, const RopeScaling& scaling) {
  HeadSpec h;
  h.num_heads = h.num_kv_heads = 1;
  h.head_dim = h.rope_dim = rope_dim;
  h.rope_theta = theta;
  h.rope_scaling = scaling;
  return h;
}

class RopeGoldenTest : public ::testing::TestWithParam<Golden> {};

TEST_P(RopeGoldenTest, MatchesTransformersRopeInitFunction) {
  const Golden& g = GetParam();
  const RopeFrequencies f = ComputeRopeFrequencies(Heads(g.rope_dim, g.theta, g.scaling), g.seq_len);
  ASSERT_EQ(f.inv_freq.size(), static_cast<size_t>(g.rope_dim / 2));
  EXPECT_NEAR(f.attention_factor, g.attention_factor, 2e-6 * g.attention_factor);
  for (const auto& [i, want] : g.inv_freq) EXPECT_NEAR(f.inv_freq[i], want, 2e-6 * want) << "pair " << i;
}

INSTANTIATE_TEST_SUITE_P(Transformers, RopeGoldenTest, ::testing::ValuesIn(Goldens()),
                         [](const auto& info) { return info.param.name; });

TEST(RopeFrequencies, UnscaledAreThetaToTheMinusTwoIOverDim) {
  const RopeFrequencies f = ComputeRopeFrequencies(Heads(16, 10000, RopeScaling()), 1 << 20);
  EXPECT_EQ(f.attention_factor, 1.0);
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(f.inv_freq[i], std::pow(10000.0, -2.0 * i / 16)) << i;
}

TEST(RopeFrequencies, LongropeTakesTheLongFactorsOnlyPastTheOriginalContext) {
  RopeScaling r = Make(Type::kLongrope, 4, 64);
  r.short_factor = Ramp(4, 0.0);  // ones
  r.long_factor = Ramp(4, 1.0);   // 1, 2, 3, 4
  const HeadSpec h = Heads(8, 10000, r);
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(h, 64).inv_freq[3], std::pow(10000.0, -6.0 / 8));
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(h, 65).inv_freq[3], std::pow(10000.0, -6.0 / 8) / 4);
}

TEST(RopeFrequencies, DynamicGrowsItsBaseWithTheSequencePastTheMaximum) {
  const HeadSpec h = Heads(8, 10000, Make(Type::kDynamic, 2, 0, 100));
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(h, 100).inv_freq[1], std::pow(10000.0, -2.0 / 8));
  // L = 300: base 10000 (2 x 300 / 100 - 1)^(8 / 6).
  const double base = 10000 * std::pow(5.0, 8.0 / 6);
  EXPECT_NEAR(ComputeRopeFrequencies(h, 300).inv_freq[1], std::pow(base, -2.0 / 8), 1e-15);
}

TEST(RopeFrequencies, AnExplicitAttentionFactorWins) {
  RopeScaling r = Make(Type::kYarn, 4, 128);
  r.attention_factor = 0.75;
  EXPECT_EQ(ComputeRopeFrequencies(Heads(16, 10000, r), 0).attention_factor, 0.75);
}

}  // namespace
}  // namespace mha
