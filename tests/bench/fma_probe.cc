#include "tests/bench/fma_probe.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace mha::bench {
namespace {

// 12 independent accumulators hide the FMA latency (4 cycles) on two FMA ports. Each iteration is
// 12 FMAs x lanes x 2 flops. The inner loop must be unrolled so that the accumulators live in registers: at -O2
// without the pragma GCC keeps them in memory and the probe reads a third of the peak.
constexpr int kChains = 12;

__attribute__((target("avx512f"))) float ChainsAvx512(long iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx2,fma"))) float ChainsAvx2(long iterations) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(0.001f * c);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

// The sum of every lane of the chains (so that the compiler keeps them), lane by lane: GCC 12's 512-bit reduce
// intrinsics warn of an uninitialized operand. E: the lanes' type (float, int32_t).
template <typename E, typename V>
float Total(const V (&acc)[kChains]) {
  float total = 0;
  for (const V& v : acc) {
    E lanes[sizeof(V) / sizeof(E)];
    __builtin_memcpy(lanes, &v, sizeof(lanes));
    for (E x : lanes) total += static_cast<float>(x);
  }
  return total;
}

__attribute__((target("avx512f,avx512bf16"))) float ChainsBf16(long iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(0.001f * c);
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)), b = a;  // bf16 1.0
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  return Total<float>(acc);
}

__attribute__((target("avx512f,avx512vnni"))) float ChainsVnni(long iterations) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
  for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  }
  return Total<int32_t>(acc);
}

// The best rate of `chains` on `threads` threads over a few repetitions, in iterations per second (all threads).
double BestRate(float (*chains)(long), int threads, double seconds) {
  // Calibrate the iteration count on one thread, then run it on all of them at once.
  long iterations = 1 << 20;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    volatile float sink = chains(iterations);
    (void)sink;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > seconds / 4) {
      iterations = static_cast<long>(iterations * (seconds / 4) / elapsed);
      break;
    }
    iterations *= 2;
  }
  double best = 0;
  for (int repetition = 0; repetition < 8; ++repetition) {
    const auto start = std::chrono::steady_clock::now();
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += chains(iterations);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(iterations) * threads / elapsed + 0 * sink);
  }
  return best;
}

}  // namespace

DotPeaks MeasureDotPeaks(int threads, double seconds) {
  DotPeaks peaks;
  // Per iteration: kChains instructions of 16 lanes, 2 (bf16) or 4 (int8) multiply-adds each.
  if (__builtin_cpu_supports("avx512bf16")) {
    peaks.bf16_gmacs = BestRate(ChainsBf16, threads, seconds) * kChains * 32 / 1e9;
  }
  if (__builtin_cpu_supports("avx512vnni")) {
    peaks.int8_gmacs = BestRate(ChainsVnni, threads, seconds) * kChains * 64 / 1e9;
  }
  return peaks;
}

PeakResult MeasurePeak(int threads, double seconds) {
  PeakResult result;
  result.threads = threads;
  int lanes;
  float (*chains)(long);
  if (__builtin_cpu_supports("avx512f")) {
    result.isa = "avx512f";
    lanes = 16;
    chains = ChainsAvx512;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    result.isa = "avx2+fma";
    lanes = 8;
    chains = ChainsAvx2;
  } else {
    result.isa = "scalar";
    return result;
  }
  result.gflops = 2.0 * kChains * lanes * BestRate(chains, threads, seconds) / 1e9;
  return result;
}

}  // namespace mha::bench
