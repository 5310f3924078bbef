#include "tests/bench/memory_probe.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace mha::bench {
namespace {

// Sum of n floats at p (64-byte aligned, n a multiple of 64) through eight independent accumulators, so that the
// loads, not the adds, set the pace.
__attribute__((target("avx512f"))) float SumAvx512(const float* p, int64_t n) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 64) {
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) acc[a] = _mm512_add_ps(acc[a], _mm512_load_ps(p + i + 16 * a));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

__attribute__((target("avx2"))) float SumAvx2(const float* p, int64_t n) {
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 64) {
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) acc[a] = _mm256_add_ps(acc[a], _mm256_load_ps(p + i + 8 * a));
  }
  __m256 sum = acc[0];
  for (int a = 1; a < 8; ++a) sum = _mm256_add_ps(sum, acc[a]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

float SumPortable(const float* p, int64_t n) {
  float acc[8] = {};
  for (int64_t i = 0; i < n; i += 8) {
    for (int a = 0; a < 8; ++a) acc[a] += p[i + a];
  }
  float s = 0;
  for (float x : acc) s += x;
  return s;
}

}  // namespace

namespace {

// The size of the highest-level cache the kernel lists for CPU 0 (sysfs: "8192K"), or 0. glibc's sysconf reads
// cpuid's package-wide total on AMD (64 MiB on a Zen 1 EPYC whose core shares 8 MiB), which a working set must not be
// sized by.
int64_t SysfsLastLevelCacheBytes() {
  int64_t best_level = 0, bytes = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int64_t level = 0, size = 0;
    char unit = 0;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;
    const int64_t scaled = unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : size;
    if (level > best_level) {
      best_level = level;
      bytes = scaled;
    }
  }
  return bytes;
}

}  // namespace

int64_t LastLevelCacheBytes() {
  static const int64_t bytes = [] {
    const int64_t sysfs = SysfsLastLevelCacheBytes();
    if (sysfs > 0) return sysfs;
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::max<int64_t>(std::max<long>(l3, l2), int64_t{32} << 20);
  }();
  return bytes;
}

int64_t RotationBytes() { return 4 * std::max<int64_t>(LastLevelCacheBytes(), int64_t{32} << 20); }

BandwidthResult MeasureReadBandwidth(int threads, int passes) {
  BandwidthResult result;
  result.threads = threads;
  result.buffer_bytes = std::max<int64_t>(4 * LastLevelCacheBytes(), int64_t{1} << 30);
  const int64_t floats = result.buffer_bytes / sizeof(float);
  // Huge pages where the system allows them, as the session pool asks for its blocks: the probe is the best read
  // this machine's memory gives, not a measure of its TLB.
  void* mapped = mmap(nullptr, result.buffer_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return result;
  madvise(mapped, result.buffer_bytes, MADV_HUGEPAGE);
  float* buffer = static_cast<float*>(mapped);
  const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
  // Every page written once, by the thread that will read it (first touch places it near that thread).
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < floats; i += 1024) std::memset(buffer + i, 0, 1024 * sizeof(float));
  std::vector<double> rates;
  volatile float sink = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t chunk = floats / n / 1024 * 1024, begin = t * chunk;
      const float* p = buffer + begin;
      total += avx512 ? SumAvx512(p, chunk) : avx2 ? SumAvx2(p, chunk) : SumPortable(p, chunk);
    }
    sink = sink + total;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rates.push_back(result.buffer_bytes / seconds / 1e9);
  }
  munmap(mapped, result.buffer_bytes);
  std::sort(rates.begin(), rates.end());
  result.gb_per_s = rates.back();
  result.median_gb_per_s = rates[rates.size() / 2];
  return result;
}

}  // namespace mha::bench
