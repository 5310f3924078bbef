// Measures this machine's fp32 peak in the running process: independent FMA chains in the widest vector unit the
// CPU has (AVX-512 or AVX2+FMA), on every OpenMP thread at once. Benchmarks print their results as a share of it.
#ifndef MHA_TESTS_BENCH_FMA_PROBE_H_
#define MHA_TESTS_BENCH_FMA_PROBE_H_

#include <string>

namespace mha::bench {

struct PeakResult {
  double gflops = 0;   // all threads together
  int threads = 0;
  std::string isa;     // "avx512f" or "avx2+fma" or "scalar"
};

// Runs for about `seconds` and returns the best of a few repetitions.
PeakResult MeasurePeak(int threads, double seconds = 0.3);

// The multiply-add peaks of the dot-product instructions the 16-bit and 8-bit decode kernels multiply with, measured
// as MeasurePeak measures FMAs (independent chains of the 512-bit instruction on every thread): vdpbf16ps (two bf16
// products per fp32 lane) and vpdpbusd (four u8 x s8 products per int32 lane). 0 where the CPU lacks the
// instruction (AVX512-BF16, AVX512-VNNI).
struct DotPeaks {
  double bf16_gmacs = 0;
  double int8_gmacs = 0;
};
DotPeaks MeasureDotPeaks(int threads, double seconds = 0.3);

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_FMA_PROBE_H_
