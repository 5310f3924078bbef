// What the GPU benchmarks (flash_bench.cc, paged_bench.cc) share: failing loudly on a CUDA error, reproducible
// input values, and timing with CUDA events. Benchmark code only: a failed call exits the process.
#ifndef MHA_TESTS_GPU_BENCH_UTIL_H_
#define MHA_TESTS_GPU_BENCH_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace mha {
namespace bench {

// A value in [-1, 1) from a hash of the index.
inline float HashValue(uint64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32) * 40503u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f;
}

struct Stats {
  float median = 0, best = 0;  // milliseconds
};

// `reps` timed runs of f on `stream` (null: the default stream) after `warmups` untimed ones.
template <typename F>
Stats TimeMs(cudaStream_t stream, F f, int reps, int warmups = 3) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmups; ++i) f();
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    f();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {ms[ms.size() / 2], ms.front()};
}

}  // namespace bench
}  // namespace mha

#endif  // MHA_TESTS_GPU_BENCH_UTIL_H_
