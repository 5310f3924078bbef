// What the in-process benchmarks share: seeded inputs, a head configuration, and best / median of a series.
#ifndef MHA_TESTS_BENCH_BENCH_UTIL_H_
#define MHA_TESTS_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/mha/v1/attention_shape.h"

namespace mha::bench {

// Ends the benchmark with exit status 1 when a timed call failed: its time says nothing, and the smoke tests
// (tests/bench/CMakeLists.txt) must fail.
inline void ExitUnlessOk(const absl::Status& status, const std::string& what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

// n values uniform in [-1, 1] from `seed`.
inline std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng);
  return v;
}

// H / Hkv / d_k, causal, 1/sqrt(d_k), LLaMA 3's RoPE.
inline HeadSpec Heads(int64_t h, int64_t hkv, int64_t dk) {
  HeadSpec heads;
  heads.num_heads = h;
  heads.num_kv_heads = hkv;
  heads.head_dim = dk;
  heads.causal = true;
  heads.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  heads.rope_theta = 500000;
  heads.rope_dim = dk;
  return heads;
}

// Best and median of a series.
struct Stats {
  double best = 0, median = 0;
};
inline Stats Of(std::vector<double> v, bool higher_is_better) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return {};
  return {higher_is_better ? v.back() : v.front(), v[v.size() / 2]};
}

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_BENCH_UTIL_H_
