// The sessions' decode step on a GPU: how fast the paged kernels (paged_kernels.h) read a KV cache, next to the
// device-to-device copy bandwidth measured in the same run. Run by tests/gpu/device-check.sh on a GPU machine; built
// in CI so that it never rots. Without a GPU it prints the driver's reason and exits 2.
//
//   paged_bench --probe                 says whether a GPU is usable (exit 0) or why not (exit 2)
//   paged_bench [--quick] [--arena_max_gib N] [--shape SESSIONS:T ...] [--cache_dtype D[,D...]] [--shared_prefix N]
//               [--copy_mib N] [--reps N]
//
// --shape replaces the table's sizes (repeat it for several); --cache_dtype the caches each size runs with, bf16
// (the default), fp16, fp32, int8, fp8_e4m3, fp8_e5m2 (an 8-bit row also says its tokens/s against the bf16 row of
// its size, when there is one); --shared_prefix N adds, for each size and cache, a row whose sessions share their
// first N tokens' blocks (cascade decode; its speedup is over the row sharing nothing); --copy_mib sizes the copy
// (default 4096); --reps the timed kernel runs (default 20).
// tests/emulated_cuda's paged_bench_emulated (ctest) runs this on the CUDA backend emulated on the CPU at a few small
// shapes: the host side, the parameters and the check against the host.
//
// One decode step: every session has T cached tokens and one new token (H = 32 query heads over Hkv = 8 KV heads,
// d_k = 128, a bf16 cache in blocks of 32 tokens, the server's default), so the step reads
// sessions x T x Hkv x d_k x 2 (K and V) x 2 bytes of a bf16 cache (an 8-bit cache: its blocks' bytes per token,
// codes and scales); GB/s below are those bytes (1e9) over the time of
// LaunchPagedAttention (split kernel and merge, on the backend's plan: PlanPaged), with append = false so that the
// lengths stay put between repetitions. The copy bandwidth is cudaMemcpyAsync device to device of a 4 GiB buffer,
// counted as bytes read plus bytes written (2 x 4 GiB per copy), the way a copy is usually quoted; the ratio is cache
// bytes read per second over it. Kernel timings: cudaEvents around each launch, 3 untimed, then the median and best
// of 20. append = true (LaunchPagedAppend then LaunchPagedAttention, T + 1 keys) is timed too, median of 5.
//
// The kernels alone run on PagedParams built here over one cudaMalloc of blocks, handed out to the sessions in a
// shuffled order (as a pool that has served a while would), filled with a tile of 128 blocks of random values
// (an 8-bit cache's written by quant::WriteTokens, as every backend writes them). The first and last
// sessions' outputs (and session 0's of the backend call) are checked against a host computation on the same cache.
// Then, where the backend is available and the cache fits under --arena_max_gib (default 16: the arena is CUDA
// managed memory, and asking for more than the card has free can hang it), one whole CudaBackend::PagedAttention
// call over blocks in its AllocateCacheArena memory (host inputs and outputs, the backend's own plan), timed on the
// host clock.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/backends/backend.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"
#include "server/backends/cuda/paged_plan.h"
#include "server/backends/quantized_cache.h"
#include "proto/mha/v1/tensor_codec.h"
#include "tests/gpu/bench_util.h"

namespace mha {
namespace cuda {
namespace {

using bench::HashValue;
using bench::Stats;
using bench::TimeMs;

constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 32;
constexpr int64_t kGroup = kHeads / kKvHeads;
constexpr int64_t kGiB = int64_t{1} << 30;

// The cache's contents: block b of the pool holds tile block b % kTileBlocks (the tile copied over and over on the
// device), so the host computation reads the same values without a copy of the whole cache.
constexpr int64_t kTileBlocks = 128;

KvCacheLayout CacheOf(v1::DataType dtype) { return {kKvHeads, kHeadDim, kBlockTokens, dtype}; }

// kTileBlocks blocks of random keys and values in the cache's layout and dtype.
std::vector<char> MakeTile(const KvCacheLayout& cache) {
  std::vector<char> tile(kTileBlocks * cache.BlockBytes());
  if (!cache.Quantized()) {
    const int64_t elements = kTileBlocks * cache.BlockElements();
    std::vector<float> values(elements);
    for (int64_t i = 0; i < elements; ++i) values[i] = HashValue(i, 7);
    EncodeFromFloat(cache.dtype, values.data(), elements, tile.data());
    return tile;
  }
  std::vector<float> k(kBlockTokens * kHeadDim), v(k.size());
  for (int64_t b = 0; b < kTileBlocks; ++b) {
    for (int64_t g = 0; g < kKvHeads; ++g) {
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = HashValue((b * kKvHeads + g) * k.size() + i, 7);
        v[i] = HashValue((b * kKvHeads + g) * k.size() + i, 8);
      }
      quant::WriteTokens(cache, tile.data() + b * cache.BlockBytes(), g, 0, kBlockTokens, k.data(), kHeadDim,
                         v.data(), kHeadDim);
    }
  }
  return tile;
}

// Key (depth c) and value (column c) of slot j of KV head g in tile block b, as the kernels read them.
float TileKey(const KvCacheLayout& cache, const std::vector<char>& tile, int64_t b, int64_t g, int64_t j, int64_t c) {
  const char* block = tile.data() + b % kTileBlocks * cache.BlockBytes();
  if (cache.Quantized()) return quant::KeyAt(cache, block, g, j, c);
  float x = 0;
  DecodeToFloat(cache.dtype, block + (cache.KeyOffset(g) + c * kBlockTokens + j) * DTypeSize(cache.dtype), 1, &x);
  return x;
}
float TileValue(const KvCacheLayout& cache, const std::vector<char>& tile, int64_t b, int64_t g, int64_t j,
                int64_t c) {
  const char* block = tile.data() + b % kTileBlocks * cache.BlockBytes();
  if (cache.Quantized()) return quant::ValueAt(cache, block, g, j, c);
  float x = 0;
  DecodeToFloat(cache.dtype, block + (cache.ValueOffset(g) + j * kHeadDim + c) * DTypeSize(cache.dtype), 1, &x);
  return x;
}

// Device-to-device copy bandwidth in GB/s (1e9 bytes), bytes read plus bytes written, median and best.
Stats CopyGbs(cudaStream_t stream, int64_t bytes) {
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, bytes));
  CHECK_CUDA(cudaMalloc(&dst, bytes));
  CHECK_CUDA(cudaMemsetAsync(src, 0x5a, bytes, stream));
  CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, stream));
  const Stats ms = TimeMs(
      stream, [&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); }, 10);
  CHECK_CUDA(cudaFree(src));
  CHECK_CUDA(cudaFree(dst));
  return {2.0f * bytes / (ms.median * 1e-3f) / 1e9f, 2.0f * bytes / (ms.best * 1e-3f) / 1e9f};
}

// Fills `bytes` at `dst` (device or managed memory) with the tile of `tile_bytes`, which lies on the device at `tile`.
void Fill(char* dst, int64_t bytes, const char* tile, int64_t tile_bytes, cudaStream_t stream) {
  for (int64_t at = 0; at < bytes; at += tile_bytes) {
    CHECK_CUDA(cudaMemcpyAsync(dst + at, tile, std::min(tile_bytes, bytes - at), cudaMemcpyDeviceToDevice, stream));
  }
}

// A configuration's sessions: each holds `blocks_per_session` blocks (T + 1 tokens: room for append = true), given
// out from the pool in a shuffled order.
struct Layout {
  KvCacheLayout cache;
  int64_t sessions = 0, tokens = 0, blocks_per_session = 0;
  int64_t shared_blocks = 0;  // every session's first blocks are session 0's (a shared prefix: cascade decode)
  std::vector<int64_t> block_index;  // [sessions * blocks_per_session] block numbers in the pool
  int64_t PoolBytes() const { return sessions * blocks_per_session * cache.BlockBytes(); }
  // A block's bytes per token (K and V, codes and scales) for every cached token.
  int64_t CacheBytesRead() const { return sessions * tokens * cache.BlockBytes() / kBlockTokens; }
};

Layout MakeLayout(int64_t sessions, int64_t tokens, const KvCacheLayout& cache, int64_t shared_tokens = 0) {
  Layout l;
  l.cache = cache;
  l.shared_blocks = std::min(shared_tokens, tokens) / kBlockTokens;
  l.sessions = sessions;
  l.tokens = tokens;
  l.blocks_per_session = tokens / kBlockTokens + 1;
  const int64_t n = sessions * l.blocks_per_session;
  l.block_index.resize(n);
  for (int64_t i = 0; i < n; ++i) l.block_index[i] = i;
  uint64_t state = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(n);
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with a fixed xorshift: the same order every run
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::swap(l.block_index[i], l.block_index[state % static_cast<uint64_t>(i + 1)]);
  }
  for (int64_t s = 1; s < sessions; ++s) {
    for (int64_t b = 0; b < l.shared_blocks; ++b) l.block_index[s * l.blocks_per_session + b] = l.block_index[b];
  }
  return l;
}

// The decode step as the backend sees it: one new token per session, fp32 in and out, the server's cache layout.
PagedProblem DecodeProblem(const Layout& l) {
  PagedProblem problem;
  problem.heads.num_heads = kHeads;
  problem.heads.num_kv_heads = kKvHeads;
  problem.heads.head_dim = kHeadDim;
  problem.heads.causal = true;
  problem.heads.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  problem.cache = l.cache;
  problem.input_dtype = problem.output_dtype = v1::FP32;
  problem.sequences = l.sessions;
  problem.new_tokens = l.sessions;
  problem.max_new_tokens = 1;
  problem.max_length = l.tokens;
  return problem;
}

// The sessions over `blocks` (Layout::block_index resolved to addresses), with host inputs and outputs when given.
std::vector<PagedSequence> DecodeSequences(const Layout& l, const std::vector<char*>& blocks, bool append,
                                           const float* q = nullptr, const float* kv = nullptr, float* out = nullptr) {
  std::vector<PagedSequence> sequences(l.sessions);
  for (int64_t s = 0; s < l.sessions; ++s) {
    PagedSequence& seq = sequences[s];
    seq.blocks = absl::MakeConstSpan(&blocks[s * l.blocks_per_session], l.blocks_per_session);
    seq.length = l.tokens;
    seq.new_tokens = 1;
    seq.append = append;
    if (q != nullptr) {
      seq.q = {q + s * kHeads * kHeadDim, v1::FP32};
      seq.k = {kv + s * kKvHeads * kHeadDim, v1::FP32};
      seq.v = {kv + s * kKvHeads * kHeadDim, v1::FP32};
      seq.out = {out + s * kHeads * kHeadDim, v1::FP32};
    }
  }
  return sequences;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// Session `s`'s output [H, d_k] computed on the host from the tile: softmax(q k^T scale) v over its T keys.
std::vector<float> HostOutput(const Layout& l, int64_t s, const std::vector<char>& tile, const std::vector<float>& q,
                              float scale) {
  std::vector<float> out(kHeads * kHeadDim, 0.0f);
  std::vector<double> scores(l.tokens);
  for (int64_t h = 0; h < kHeads; ++h) {
    const int64_t g = h / kGroup;
    const float* qh = &q[(s * kHeads + h) * kHeadDim];
    double max = -INFINITY;
    for (int64_t j = 0; j < l.tokens; ++j) {
      const int64_t block = l.block_index[s * l.blocks_per_session + j / kBlockTokens], slot = j % kBlockTokens;
      double dot = 0;
      for (int64_t c = 0; c < kHeadDim; ++c) dot += qh[c] * TileKey(l.cache, tile, block, g, slot, c);
      scores[j] = dot * scale;
      max = std::max(max, scores[j]);
    }
    double sum = 0;
    std::vector<double> acc(kHeadDim, 0.0);
    for (int64_t j = 0; j < l.tokens; ++j) {
      const int64_t block = l.block_index[s * l.blocks_per_session + j / kBlockTokens], slot = j % kBlockTokens;
      const double w = std::exp(scores[j] - max);
      sum += w;
      for (int64_t c = 0; c < kHeadDim; ++c) acc[c] += w * TileValue(l.cache, tile, block, g, slot, c);
    }
    for (int64_t c = 0; c < kHeadDim; ++c) out[h * kHeadDim + c] = static_cast<float>(acc[c] / sum);
  }
  return out;
}

struct KernelResult {
  Stats ms;
  float append_ms = 0;  // LaunchPagedAppend + LaunchPagedAttention with append = true, median of 5
  int splits = 0;
  int shared_splits = 0;  // the shared units' (cascade decode), 0 without them
  float max_diff = 0;     // the first and last sessions against the host
};

// The kernels alone on blocks in `pool` (device memory).
KernelResult TimeKernels(const Layout& l, char* pool, const std::vector<char>& tile, int sms, int reps,
                         cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<char*> blocks(l.block_index.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = pool + l.block_index[i] * l.cache.BlockBytes();
  std::vector<PagedSequenceDesc> sequences(l.sessions);
  for (int64_t s = 0; s < l.sessions; ++s) {
    sequences[s].block_offset = s * l.blocks_per_session;
    sequences[s].length = l.tokens;
    sequences[s].new_tokens = 1;
    sequences[s].row = s;
    sequences[s].append = 0;
  }
  std::vector<float> q(l.sessions * kHeads * kHeadDim), kv(l.sessions * kKvHeads * kHeadDim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = HashValue(i, 101);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = HashValue(i, 102);
  // The backend's plan (paged_plan.h) for each mode; append = true sees T + 1 keys, and its scratch serves both.
  const PagedProblem problem = DecodeProblem(l);
  const PagedPlan plan = PlanPaged(problem, DecodeSequences(l, blocks, false), sms);
  const PagedPlan append_plan = PlanPaged(problem, DecodeSequences(l, blocks, true), sms);
  const std::vector<PagedUnit>& units = plan.units;
  const int64_t most_slots = std::max(PagedSlotsOf(plan), PagedSlotsOf(append_plan));
  for (int64_t s = 0; s < l.sessions; ++s) sequences[s].shared_keys = plan.shared_keys[s];

  PagedParams p;
  p.num_sequences = l.sessions;
  p.num_units = static_cast<int64_t>(units.size());
  p.num_mma_units = plan.mma_units;
  p.rows = l.sessions;
  p.q_stride = kHeads * kHeadDim;
  p.kv_stride = kKvHeads * kHeadDim;
  p.heads = kHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.block_tokens = kBlockTokens;
  p.cache_dtype = l.cache.dtype;
  if (l.cache.Quantized()) {
    p.key_part_bytes = l.cache.KeyBytes();
    p.head_part_bytes = l.cache.HeadBytes();
  }
  p.scale = scale;
  char** d_blocks = ToDevice(blocks);
  PagedSequenceDesc* d_sequences = ToDevice(sequences);
  PagedUnit* d_units = ToDevice(units);
  float *d_q = ToDevice(q), *d_k = ToDevice(kv), *d_v = ToDevice(kv);
  float *partial_out = nullptr, *partial_state = nullptr, *out = nullptr;
  int32_t* d_cascade = plan.cascade.empty() ? nullptr : ToDevice(plan.cascade);
  CHECK_CUDA(cudaMalloc(&partial_out, l.sessions * kHeads * most_slots * kHeadDim * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&partial_state, l.sessions * kHeads * most_slots * 5 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out, l.sessions * kHeads * kHeadDim * sizeof(float)));
  p.sequences = d_sequences;
  p.blocks = d_blocks;
  p.units = d_units;
  p.cascade = d_cascade;
  p.q = d_q;
  p.k = d_k;
  p.v = d_v;
  p.partial_out = partial_out;
  p.partial_state = partial_state;
  p.out = out;

  KernelResult r;
  p.splits = r.splits = plan.splits;
  p.split_keys = plan.split_keys;
  p.shared_splits = r.shared_splits = plan.shared_splits;
  p.shared_split_keys = plan.shared_split_keys;
  CHECK_CUDA(cudaMemsetAsync(out, 0xff, l.sessions * kHeads * kHeadDim * sizeof(float), stream));  // NaN
  r.ms = TimeMs(stream, [&] { CHECK_CUDA(LaunchPagedAttention(p, stream)); }, reps);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (int64_t s : {int64_t{0}, l.sessions - 1}) {
    std::vector<float> got(kHeads * kHeadDim);
    CHECK_CUDA(cudaMemcpy(got.data(), out + s * kHeads * kHeadDim, got.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
    const std::vector<float> want = HostOutput(l, s, tile, q, scale);
    for (size_t i = 0; i < got.size(); ++i) {
      const float d = std::fabs(got[i] - want[i]);
      r.max_diff = std::isnan(d) ? INFINITY : std::max(r.max_diff, d);
    }
  }

  // append = true: each repetition writes the new token into slot T again and attends to T + 1 keys.
  for (PagedSequenceDesc& s : sequences) s.append = 1;
  CHECK_CUDA(cudaMemcpy(d_sequences, sequences.data(), sequences.size() * sizeof(PagedSequenceDesc),
                        cudaMemcpyHostToDevice));
  if (append_plan.units.size() != units.size() || append_plan.cascade != plan.cascade ||
      append_plan.mma_units != plan.mma_units) {
    std::fprintf(stderr, "the append plan has other units\n");
    std::exit(1);
  }
  p.splits = append_plan.splits;
  p.split_keys = append_plan.split_keys;
  p.shared_splits = append_plan.shared_splits;
  p.shared_split_keys = append_plan.shared_split_keys;
  r.append_ms = TimeMs(
                    stream,
                    [&] {
                      CHECK_CUDA(LaunchPagedAppend(p, stream));
                      CHECK_CUDA(LaunchPagedAttention(p, stream));
                    },
                    5)
                    .median;
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (void* x : {static_cast<void*>(d_blocks), static_cast<void*>(d_sequences), static_cast<void*>(d_units),
                  static_cast<void*>(d_q), static_cast<void*>(d_k), static_cast<void*>(d_v),
                  static_cast<void*>(partial_out), static_cast<void*>(partial_state), static_cast<void*>(out),
                  static_cast<void*>(d_cascade)}) {
    CHECK_CUDA(cudaFree(x));
  }
  return r;
}

// One CudaBackend::PagedAttention call (append = false, fp32 inputs and outputs on the host) over blocks in the
// backend's arena: median wall-clock ms of 5 after one untimed; a negative value with `why` set when it did not run.
// Session 0's output against the host joins `max_diff`.
float TimeBackend(CudaBackend& backend, const Layout& l, const char* tile, const std::vector<char>& host_tile,
                  cudaStream_t stream, float* max_diff, std::string* why) {
  const PagedProblem problem = DecodeProblem(l);
  if (absl::Status s = backend.SupportsPaged(problem); !s.ok()) {
    *why = std::string(s.message());
    return -1;
  }
  absl::StatusOr<std::unique_ptr<CacheArena>> arena = backend.AllocateCacheArena(l.PoolBytes());
  if (!arena.ok()) {
    *why = std::string(arena.status().message());
    return -1;
  }
  Fill((*arena)->base(), l.PoolBytes(), tile, static_cast<int64_t>(host_tile.size()), stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<char*> blocks(l.block_index.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (*arena)->base() + l.block_index[i] * l.cache.BlockBytes();
  std::vector<float> q(l.sessions * kHeads * kHeadDim), kv(l.sessions * kKvHeads * kHeadDim), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = HashValue(i, 101);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = HashValue(i, 102);
  const std::vector<PagedSequence> sequences = DecodeSequences(l, blocks, false, q.data(), kv.data(), out.data());
  PagedArgs args;
  args.problem = problem;
  args.sequences = sequences;
  std::vector<float> ms;
  for (int r = 0; r < 6; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status s = backend.PagedAttention(args); !s.ok()) {
      *why = std::string(s.message());
      return -1;
    }
    const auto stop = std::chrono::steady_clock::now();
    if (r > 0) ms.push_back(std::chrono::duration<float, std::milli>(stop - start).count());
  }
  const std::vector<float> want = HostOutput(l, 0, host_tile, q, problem.heads.scale);
  for (size_t i = 0; i < want.size(); ++i) {
    const float d = std::fabs(out[i] - want[i]);
    *max_diff = std::isnan(d) ? INFINITY : std::max(*max_diff, d);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Options {
  bool quick = false, probe = false;
  double arena_max_gib = 16;
  int64_t copy_mib = 4096;
  int reps = 20;
  int64_t shared_prefix = 0;  // tokens; > 0: each size also runs with its sessions sharing that many
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (sessions, T)
  std::vector<v1::DataType> dtypes;
};

// false on a flag it does not know.
bool ParseDtypes(const char* list, std::vector<v1::DataType>* dtypes) {
  for (const absl::string_view name : absl::StrSplit(list, ',')) {
    bool known = false;
    for (v1::DataType d : {v1::BF16, v1::FP16, v1::FP32, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
      if (DTypeName(d) == name) {
        dtypes->push_back(d);
        known = true;
      }
    }
    if (!known) return false;
  }
  return !dtypes->empty();
}

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    long long sessions = 0, tokens = 0;
    if (std::strcmp(argv[i], "--quick") == 0) {
      o->quick = true;
      o->reps = 5;
    } else if (std::strcmp(argv[i], "--probe") == 0) {
      o->probe = true;
    } else if (std::strcmp(argv[i], "--arena_max_gib") == 0 && i + 1 < argc) {
      o->arena_max_gib = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--copy_mib") == 0 && i + 1 < argc) {
      o->copy_mib = std::max(1LL, std::atoll(argv[++i]));
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      o->reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--shared_prefix") == 0 && i + 1 < argc) {
      o->shared_prefix = std::max(0LL, std::atoll(argv[++i]));
    } else if (std::strcmp(argv[i], "--cache_dtype") == 0 && i + 1 < argc) {
      if (!ParseDtypes(argv[++i], &o->dtypes)) return false;
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc &&
               std::sscanf(argv[++i], "%lld:%lld", &sessions, &tokens) == 2 && sessions > 0 && tokens > 0) {
      o->shapes.emplace_back(sessions, tokens);
    } else {
      return false;
    }
  }
  if (o->dtypes.empty()) o->dtypes.push_back(v1::BF16);
  // bf16 first: the other caches' rows compare with its row of the same size.
  std::stable_partition(o->dtypes.begin(), o->dtypes.end(), [](v1::DataType d) { return d == v1::BF16; });
  if (o->shapes.empty()) {
    for (int64_t sessions : {1, 32, 256}) {
      for (int64_t tokens : {1024, 4096, 16384, 32768}) {
        if (!o->quick || (tokens == 4096 && sessions != 256)) o->shapes.emplace_back(sessions, tokens);
      }
    }
  }
  return true;
}

// A row's tokens/s over another row's of the same size: an 8-bit cache's over bf16's ("bf16"), a shared prefix's
// over the same sessions sharing nothing ("apart").
struct Speedup {
  std::string base;
  v1::DataType dtype;
  int64_t sessions = 0, tokens = 0;
  double ratio = 0;
};

// What the table's rows add up to for the summary lines.
struct Summary {
  double best_ratio = 0, worst_ratio = INFINITY;  // bf16 rows at 32+ sessions sharing nothing, against the copy rate
  int rows_32 = 0;
  std::vector<Speedup> speedups;  // rows at 32+ sessions
  bool mismatch = false;
  std::vector<std::string> notes;  // why a backend call did not run, each once
};

// One row of the table: size (sessions, T) with a cache of `tile`'s dtype. Returns its kernel's median ms, or a
// negative value when the size did not fit. `base_ms`: the row `base` names (bf16, apart) of the same size, or <= 0.
double RunRow(const Options& o, const Layout& l, const std::vector<char>& tile, const char* d_tile,
              const cudaDeviceProp& props, absl::StatusOr<std::unique_ptr<CudaBackend>>& backend, double copy_gbs,
              int64_t margin, const char* base, double base_ms, cudaStream_t stream, Summary* sum) {
  const std::string dtype = DTypeName(l.cache.dtype);
  const double gb = l.CacheBytesRead() / 1e9;
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (l.PoolBytes() + margin > static_cast<int64_t>(free_bytes)) {
    std::printf("| %lld | %lld | %lld | %s | %.2f | skipped: %.1f GiB of blocks, %.1f GiB free ||||||||||\n",
                static_cast<long long>(l.sessions), static_cast<long long>(l.tokens),
                static_cast<long long>(l.shared_blocks * kBlockTokens), dtype.c_str(), gb,
                static_cast<double>(l.PoolBytes()) / kGiB, static_cast<double>(free_bytes) / kGiB);
    return -1;
  }
  char* pool = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, l.PoolBytes()));
  Fill(pool, l.PoolBytes(), d_tile, static_cast<int64_t>(tile.size()), stream);
  const KernelResult k = TimeKernels(l, pool, tile, props.multiProcessorCount, o.reps, stream);
  CHECK_CUDA(cudaFree(pool));
  const double gbs = gb / (k.ms.median * 1e-3), ratio = gbs / copy_gbs;
  const double tokens_per_s = static_cast<double>(l.sessions) / (k.ms.median * 1e-3);
  std::string versus = "-";
  if (base_ms > 0) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.2fx %s", base_ms / k.ms.median, base);
    versus = buf;
    if (l.sessions >= 32) sum->speedups.push_back({base, l.cache.dtype, l.sessions, l.tokens, base_ms / k.ms.median});
  }
  if (l.sessions >= 32 && l.cache.dtype == v1::BF16 && l.shared_blocks == 0) {
    sum->best_ratio = std::max(sum->best_ratio, ratio);
    sum->worst_ratio = std::min(sum->worst_ratio, ratio);
    ++sum->rows_32;
  }
  float max_diff = k.max_diff;  // the backend call's output joins below
  std::string backend_ms = "-", backend_gbs = "-";
  if (backend.ok() && static_cast<double>(l.PoolBytes()) > o.arena_max_gib * kGiB) {
    backend_ms = "arena > limit";
  } else if (backend.ok()) {
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
    std::string why = "the arena would not fit the free memory";
    const float ms = l.PoolBytes() + 2 * margin < static_cast<int64_t>(free_bytes)
                         ? TimeBackend(**backend, l, d_tile, tile, stream, &max_diff, &why)
                         : -1.0f;
    if (ms >= 0) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.3f", ms);
      backend_ms = buf;
      std::snprintf(buf, sizeof buf, "%.0f", gb / (ms * 1e-3));
      backend_gbs = buf;
    } else {
      const auto it = std::find(sum->notes.begin(), sum->notes.end(), why);
      backend_ms = "note " + std::to_string(1 + (it - sum->notes.begin()));
      if (it == sum->notes.end()) sum->notes.push_back(why);
    }
  }
  const bool bad = !(max_diff < 2e-2f);
  // Own splits, then the shared units' (cascade decode) after a +.
  const std::string splits = absl::StrCat(k.splits, k.shared_splits > 0 ? absl::StrCat("+", k.shared_splits) : "");
  sum->mismatch |= bad;
  std::printf(
      "| %lld | %lld | %lld | %s | %.2f | %s | %.3f / %.3f | %.0f | %.2f | %.0f | %s | %.3f | %s | %s | %.1e%s |\n",
      static_cast<long long>(l.sessions), static_cast<long long>(l.tokens),
      static_cast<long long>(l.shared_blocks * kBlockTokens), dtype.c_str(), gb, splits.c_str(), k.ms.median, k.ms.best,
      gbs, ratio, tokens_per_s, versus.c_str(), k.append_ms, backend_ms.c_str(), backend_gbs.c_str(), max_diff,
      bad ? " MISMATCH" : "");
  std::fflush(stdout);
  return k.ms.median;
}

void PrintSummary(const Options& o, const Summary& sum, absl::StatusOr<std::unique_ptr<CudaBackend>>& backend) {
  if (!backend.ok()) std::printf("\nbackend calls not timed: %s\n", std::string(backend.status().message()).c_str());
  std::printf("\nbackend calls: blocks in AllocateCacheArena memory up to %.0f GiB (--arena_max_gib)\n",
              o.arena_max_gib);
  for (size_t i = 0; i < sum.notes.size(); ++i) std::printf("backend call note %zu: %s\n", i + 1, sum.notes[i].c_str());
  std::printf("\nGB/s: cache bytes read (sessions x T x the blocks' bytes per token) over the median kernel time; of"
              " copy: that over the median D2D copy rate (read + write); speedup: tokens/s over the bf16 row's of the size, or"
              " over the row whose sessions share nothing (apart); shared: tokens of each session in blocks all share;"
              " splits: the key splits of each session's own units, + those of the shared units (cascade)\n");
  if (sum.rows_32 > 0) {
    std::printf("decode at 32+ sessions >= 75%% of copy bandwidth: %s (best ratio %.2f, worst %.2f, %d rows)%s\n",
                sum.best_ratio >= 0.75 ? "PASS" : "FAIL", sum.best_ratio, sum.worst_ratio, sum.rows_32,
                sum.mismatch ? "; outputs MISMATCH the host" : "");
  }
  for (v1::DataType d : {v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    double best = 0, worst = INFINITY;
    int rows = 0;
    for (const Speedup& x : sum.speedups) {
      if (x.dtype != d || x.base != "bf16") continue;
      best = std::max(best, x.ratio);
      worst = std::min(worst, x.ratio);
      ++rows;
    }
    if (rows == 0) continue;
    std::printf("%s decode at 32+ sessions >= 1.7x bf16's tokens/s: %s (best %.2fx, worst %.2fx, %d rows)\n",
                DTypeName(d).c_str(), best >= 1.7 ? "PASS" : "FAIL", best, worst, rows);
  }
  // #57's cascade target: 64 sessions x (8192 shared + 256 own), bf16, >= 8x the same sessions sharing nothing.
  for (const Speedup& x : sum.speedups) {
    if (x.base != "apart" || x.dtype != v1::BF16) continue;
    const bool target = x.sessions == 64 && x.tokens == 8192 + 256 && o.shared_prefix == 8192;
    std::printf("cascade %lld x (%lld shared + %lld own) bf16: %.2fx apart%s\n", static_cast<long long>(x.sessions),
                static_cast<long long>(o.shared_prefix), static_cast<long long>(x.tokens - o.shared_prefix), x.ratio,
                target ? (x.ratio >= 8 ? " (>= 8x: PASS)" : " (>= 8x: FAIL)") : "");
  }
  if (sum.rows_32 == 0 && sum.mismatch) std::printf("outputs MISMATCH the host\n");
}

int Main(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: paged_bench [--probe] [--quick] [--arena_max_gib N] [--shape SESSIONS:T ...]"
                 " [--cache_dtype bf16|fp16|fp32|int8|fp8_e4m3|fp8_e5m2[,...]] [--shared_prefix N] [--copy_mib N]"
                 " [--reps N]\n");
    return 64;
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    std::printf("no usable GPU: %s\n", e != cudaSuccess ? cudaGetErrorString(e) : "no device");
    return 2;
  }
  cudaDeviceProp props;
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  if (o.probe) {
    std::printf("GPU: %s\n", props.name);
    return 0;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::printf("# paged_bench on %s (sm_%d%d, %d SMs, %.1f of %.1f GiB free)\n", props.name, props.major, props.minor,
              props.multiProcessorCount, static_cast<double>(free_bytes) / kGiB,
              static_cast<double>(total_bytes) / kGiB);
  std::printf("# decode: 1 new token per session, H=%lld Hkv=%lld d_k=%lld, caches in %lld-token blocks\n",
              static_cast<long long>(kHeads), static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim),
              static_cast<long long>(kBlockTokens));
  // Room kept free beside a size's blocks: 2 GiB on a large card, less on a small (or emulated) one.
  const int64_t margin = std::min<int64_t>(2 * kGiB, static_cast<int64_t>(total_bytes / 16));
  const int64_t copy_bytes = std::min<int64_t>(o.copy_mib << 20, static_cast<int64_t>(free_bytes / 4));
  const Stats copy = CopyGbs(stream, copy_bytes);
  std::printf("copy D2D %.1f GiB (read + write counted): %.0f GB/s median, %.0f best\n\n",
              static_cast<double>(copy_bytes) / kGiB, copy.median, copy.best);

  std::vector<std::vector<char>> tiles;
  std::vector<char*> d_tiles;
  for (v1::DataType d : o.dtypes) {
    tiles.push_back(MakeTile(CacheOf(d)));
    d_tiles.push_back(ToDevice(tiles.back()));
  }
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create();
  Summary sum;
  std::printf("| sessions | T | shared | cache | cache GB | splits | kernel ms median / best | GB/s | of copy |"
              " tokens/s | speedup | append+attn ms | backend ms | backend GB/s | max diff |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& [sessions, tokens] : o.shapes) {
    double bf16_ms = -1;
    for (size_t i = 0; i < o.dtypes.size(); ++i) {
      const KvCacheLayout cache = CacheOf(o.dtypes[i]);
      const bool versus_bf16 = o.dtypes[i] != v1::BF16;
      const double ms = RunRow(o, MakeLayout(sessions, tokens, cache), tiles[i], d_tiles[i], props, backend,
                               copy.median, margin, "bf16", versus_bf16 ? bf16_ms : -1, stream, &sum);
      if (o.dtypes[i] == v1::BF16) bf16_ms = ms;
      if (o.shared_prefix >= kBlockTokens && sessions > 1) {
        RunRow(o, MakeLayout(sessions, tokens, cache, o.shared_prefix), tiles[i], d_tiles[i], props, backend,
               copy.median, margin, "apart", ms, stream, &sum);
      }
    }
  }
  for (char* d : d_tiles) CHECK_CUDA(cudaFree(d));
  PrintSummary(o, sum, backend);
  cudaStreamDestroy(stream);
  return sum.mismatch ? 1 : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace mha

int main(int argc, char** argv) { return mha::cuda::Main(argc, argv); }
