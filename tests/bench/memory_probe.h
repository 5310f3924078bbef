// Measures this machine's memory-read bandwidth in the running process: every OpenMP thread streaming its share of
// a buffer several times the last-level cache, summing it with AVX where the CPU has it. Decode attention reads a
// KV cache larger than the caches once per step, so this is its ceiling; benchmarks print KV bytes read per second
// as a share of it.
#ifndef MHA_TESTS_BENCH_MEMORY_PROBE_H_
#define MHA_TESTS_BENCH_MEMORY_PROBE_H_

#include <cstdint>

namespace mha::bench {

// The last-level cache one core reads from (sysfs: a Zen CCX's L3, not the package's total), else sysconf's, at
// least 32 MiB when neither says.
int64_t LastLevelCacheBytes();

// The bytes a benchmark's calls rotate over so that each reads its data from memory, as a server with many
// sessions does: 4x max(the last-level cache, 32 MiB; two vCPUs may sit on two CCXs' L3s). Not 2x: Zen 4's L3
// keeps part of a cyclic working set twice its size (a single session's decode then read past the probe).
int64_t RotationBytes();

struct BandwidthResult {
  double gb_per_s = 0;  // best pass, 1e9 bytes per second, all threads together
  double median_gb_per_s = 0;
  int64_t buffer_bytes = 0;
  int threads = 0;
};

// Reads a buffer of max(4 x the last-level cache, 1 GiB) bytes `passes` times on `threads` threads.
BandwidthResult MeasureReadBandwidth(int threads, int passes = 6);

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_MEMORY_PROBE_H_
