// The sessions' decode step on a GPU: how fast the paged kernels (paged_kernels.h) read a KV cache, next to the
// device-to-device copy bandwidth measured in the same run. Run by tests/gpu/device-check.sh on a GPU machine; built
// in CI so that it never rots. Without a GPU it prints the driver's reason and exits 2.
//
//   paged_bench --probe                 says whether a GPU is usable (exit 0) or why not (exit 2)
//   paged_bench [--quick] [--arena_max_gib N] [--shape SESSIONS:T ...] [--copy_mib N] [--reps N]
//
// --shape replaces the table's sizes (repeat it for several); --copy_mib sizes the copy (default 4096); --reps the
// timed kernel runs (default 20). tests/emulated_cuda's paged_bench_emulated (ctest) runs this on the CUDA backend
// emulated on the CPU at a few small shapes: the host side, the parameters and the check against the host.
//
// One decode step: every session has T cached tokens and one new token (H = 32 query heads over Hkv = 8 KV heads,
// d_k = 128, a bf16 cache in blocks of 32 tokens, the server's default), so the step reads
// sessions x T x Hkv x d_k x 2 (K and V) x 2 bytes of cache; GB/s below are those bytes (1e9) over the time of
// LaunchPagedAttention (split kernel and merge, on the backend's plan: PlanPaged), with append = false so that the
// lengths stay put between repetitions. The copy bandwidth is cudaMemcpyAsync device to device of a 4 GiB buffer,
// counted as bytes read plus bytes written (2 x 4 GiB per copy), the way a copy is usually quoted; the ratio is cache
// bytes read per second over it. Kernel timings: cudaEvents around each launch, 3 untimed, then the median and best
// of 20. append = true (LaunchPagedAppend then LaunchPagedAttention, T + 1 keys) is timed too, median of 5.
//
// The kernels alone run on PagedParams built here over one cudaMalloc of blocks, handed out to the sessions in a
// shuffled order (as a pool that has served a while would), filled with random bf16 values. The first and last
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

#include "server/backends/backend.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"
#include "server/backends/cuda/paged_plan.h"
#include "tests/gpu/bench_util.h"

namespace mha {
namespace cuda {
namespace {

using bench::HashValue;
using bench::Stats;
using bench::TimeMs;

constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 32;
constexpr int64_t kGroup = kHeads / kKvHeads;
constexpr int64_t kBlockElements = kKvHeads * 2 * kHeadDim * kBlockTokens;  // KvCacheLayout::BlockElements
constexpr int64_t kBlockBytes = kBlockElements * 2;                          // bf16
constexpr int64_t kGiB = int64_t{1} << 30;

// The cache's contents: element e of the block memory is tile[e % kTileElements] (the tile copied over and over on
// the device), so the host computation reads the same values without a copy of the whole cache.
constexpr int64_t kTileElements = int64_t{8} << 20;  // 16 MiB, a multiple of a block

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

// Fills `bytes` at `dst` (device or managed memory) with the tile, which lies on the device at `tile`.
void Fill(char* dst, int64_t bytes, const char* tile, cudaStream_t stream) {
  const int64_t tile_bytes = kTileElements * 2;
  for (int64_t at = 0; at < bytes; at += tile_bytes) {
    CHECK_CUDA(cudaMemcpyAsync(dst + at, tile, std::min(tile_bytes, bytes - at), cudaMemcpyDeviceToDevice, stream));
  }
}

// A configuration's sessions: each holds `blocks_per_session` blocks (T + 1 tokens: room for append = true), given
// out from the pool in a shuffled order.
struct Layout {
  int64_t sessions = 0, tokens = 0, blocks_per_session = 0;
  std::vector<int64_t> block_index;  // [sessions * blocks_per_session] block numbers in the pool
  int64_t PoolBytes() const { return sessions * blocks_per_session * kBlockBytes; }
  int64_t CacheBytesRead() const { return sessions * tokens * kKvHeads * kHeadDim * 2 * 2; }
};

Layout MakeLayout(int64_t sessions, int64_t tokens) {
  Layout l;
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
  problem.cache = {kKvHeads, kHeadDim, kBlockTokens, v1::BF16};
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
std::vector<float> HostOutput(const Layout& l, int64_t s, const std::vector<__nv_bfloat16>& tile,
                              const std::vector<float>& q, float scale) {
  std::vector<float> out(kHeads * kHeadDim, 0.0f);
  auto at = [&](int64_t block, int64_t element) {
    return __bfloat162float(tile[(block * kBlockElements + element) % kTileElements]);
  };
  std::vector<double> scores(l.tokens);
  for (int64_t h = 0; h < kHeads; ++h) {
    const int64_t g = h / kGroup;
    const float* qh = &q[(s * kHeads + h) * kHeadDim];
    double max = -INFINITY;
    for (int64_t j = 0; j < l.tokens; ++j) {
      const int64_t block = l.block_index[s * l.blocks_per_session + j / kBlockTokens], slot = j % kBlockTokens;
      double dot = 0;
      for (int64_t c = 0; c < kHeadDim; ++c) {
        dot += qh[c] * at(block, g * 2 * kHeadDim * kBlockTokens + c * kBlockTokens + slot);
      }
      scores[j] = dot * scale;
      max = std::max(max, scores[j]);
    }
    double sum = 0;
    std::vector<double> acc(kHeadDim, 0.0);
    for (int64_t j = 0; j < l.tokens; ++j) {
      const int64_t block = l.block_index[s * l.blocks_per_session + j / kBlockTokens], slot = j % kBlockTokens;
      const double w = std::exp(scores[j] - max);
      sum += w;
      const int64_t v0 = g * 2 * kHeadDim * kBlockTokens + kHeadDim * kBlockTokens + slot * kHeadDim;
      for (int64_t c = 0; c < kHeadDim; ++c) acc[c] += w * at(block, v0 + c);
    }
    for (int64_t c = 0; c < kHeadDim; ++c) out[h * kHeadDim + c] = static_cast<float>(acc[c] / sum);
  }
  return out;
}

struct KernelResult {
  Stats ms;
  float append_ms = 0;  // LaunchPagedAppend + LaunchPagedAttention with append = true, median of 5
  int splits = 0;
  float max_diff = 0;  // the first and last sessions against the host
};

// The kernels alone on blocks in `pool` (device memory).
KernelResult TimeKernels(const Layout& l, char* pool, const std::vector<__nv_bfloat16>& tile, int sms, int reps,
                         cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<char*> blocks(l.block_index.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = pool + l.block_index[i] * kBlockBytes;
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
  const int most_splits = std::max(plan.splits, append_plan.splits);

  PagedParams p;
  p.num_sequences = l.sessions;
  p.num_units = static_cast<int64_t>(units.size());
  p.rows = l.sessions;
  p.q_stride = kHeads * kHeadDim;
  p.kv_stride = kKvHeads * kHeadDim;
  p.heads = kHeads;
  p.kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.block_tokens = kBlockTokens;
  p.cache_dtype = kBF16;
  p.scale = scale;
  char** d_blocks = ToDevice(blocks);
  PagedSequenceDesc* d_sequences = ToDevice(sequences);
  PagedUnit* d_units = ToDevice(units);
  float *d_q = ToDevice(q), *d_k = ToDevice(kv), *d_v = ToDevice(kv);
  float *partial_out = nullptr, *partial_state = nullptr, *out = nullptr;
  CHECK_CUDA(cudaMalloc(&partial_out, l.sessions * kHeads * most_splits * kHeadDim * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&partial_state, l.sessions * kHeads * most_splits * 5 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&out, l.sessions * kHeads * kHeadDim * sizeof(float)));
  p.sequences = d_sequences;
  p.blocks = d_blocks;
  p.units = d_units;
  p.q = d_q;
  p.k = d_k;
  p.v = d_v;
  p.partial_out = partial_out;
  p.partial_state = partial_state;
  p.out = out;

  KernelResult r;
  p.splits = r.splits = plan.splits;
  p.split_keys = plan.split_keys;
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
  if (append_plan.units.size() != units.size()) {
    std::fprintf(stderr, "the append plan has other units\n");
    std::exit(1);
  }
  p.splits = append_plan.splits;
  p.split_keys = append_plan.split_keys;
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
                  static_cast<void*>(partial_out), static_cast<void*>(partial_state), static_cast<void*>(out)}) {
    CHECK_CUDA(cudaFree(x));
  }
  return r;
}

// One CudaBackend::PagedAttention call (append = false, fp32 inputs and outputs on the host) over blocks in the
// backend's arena: median wall-clock ms of 5 after one untimed; a negative value with `why` set when it did not run.
// Session 0's output against the host joins `max_diff`.
float TimeBackend(CudaBackend& backend, const Layout& l, const char* tile, const std::vector<__nv_bfloat16>& host_tile,
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
  Fill((*arena)->base(), l.PoolBytes(), tile, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<char*> blocks(l.block_index.size());
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (*arena)->base() + l.block_index[i] * kBlockBytes;
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

int Main(int argc, char** argv) {
  bool quick = false, probe = false;
  double arena_max_gib = 16;
  int64_t copy_mib = 4096;
  int reps = 20;
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (sessions, T)
  for (int i = 1; i < argc; ++i) {
    long long sessions = 0, tokens = 0;
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
      reps = 5;
    } else if (std::strcmp(argv[i], "--probe") == 0) {
      probe = true;
    } else if (std::strcmp(argv[i], "--arena_max_gib") == 0 && i + 1 < argc) {
      arena_max_gib = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--copy_mib") == 0 && i + 1 < argc) {
      copy_mib = std::max(1LL, std::atoll(argv[++i]));
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc &&
               std::sscanf(argv[++i], "%lld:%lld", &sessions, &tokens) == 2 && sessions > 0 && tokens > 0) {
      shapes.emplace_back(sessions, tokens);
    } else {
      std::fprintf(stderr,
                   "usage: paged_bench [--probe] [--quick] [--arena_max_gib N] [--shape SESSIONS:T ...]"
                   " [--copy_mib N] [--reps N]\n");
      return 64;
    }
  }
  if (shapes.empty()) {
    for (int64_t sessions : {1, 32, 256}) {
      for (int64_t tokens : {1024, 4096, 16384, 32768}) {
        if (!quick || (tokens == 4096 && sessions != 256)) shapes.emplace_back(sessions, tokens);
      }
    }
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    std::printf("no usable GPU: %s\n", e != cudaSuccess ? cudaGetErrorString(e) : "no device");
    return 2;
  }
  cudaDeviceProp props;
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  if (probe) {
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
  std::printf("# decode: 1 new token per session, H=%lld Hkv=%lld d_k=%lld, bf16 cache in %lld-token blocks\n",
              static_cast<long long>(kHeads), static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim),
              static_cast<long long>(kBlockTokens));
  // Room kept free beside a size's blocks: 2 GiB on a large card, less on a small (or emulated) one.
  const int64_t margin = std::min<int64_t>(2 * kGiB, static_cast<int64_t>(total_bytes / 16));
  const int64_t copy_bytes = std::min<int64_t>(copy_mib << 20, static_cast<int64_t>(free_bytes / 4));
  const Stats copy = CopyGbs(stream, copy_bytes);
  std::printf("copy D2D %.1f GiB (read + write counted): %.0f GB/s median, %.0f best\n\n",
              static_cast<double>(copy_bytes) / kGiB, copy.median, copy.best);

  std::vector<__nv_bfloat16> tile(kTileElements);
  for (int64_t i = 0; i < kTileElements; ++i) tile[i] = __float2bfloat16(HashValue(i, 7));
  char* d_tile = ToDevice(std::vector<char>(reinterpret_cast<const char*>(tile.data()),
                                            reinterpret_cast<const char*>(tile.data()) + kTileElements * 2));

  // Why a backend call did not run, each said once below the table.
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create();
  std::vector<std::string> notes;

  std::printf("| sessions | T | cache GB | splits | kernel ms median / best | GB/s | of copy | append+attn ms |"
              " backend ms | backend GB/s | max diff |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  double best_ratio = 0, worst_ratio = INFINITY;
  int rows_32 = 0;
  bool mismatch = false;
  for (const auto& [sessions, tokens] : shapes) {
    const Layout l = MakeLayout(sessions, tokens);
    const double gb = l.CacheBytesRead() / 1e9;
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (l.PoolBytes() + margin > static_cast<int64_t>(free_bytes)) {
      std::printf("| %lld | %lld | %.2f | skipped: %.1f GiB of blocks, %.1f GiB free |||||||\n",
                  static_cast<long long>(sessions), static_cast<long long>(tokens), gb,
                  static_cast<double>(l.PoolBytes()) / kGiB, static_cast<double>(free_bytes) / kGiB);
      continue;
    }
    char* pool = nullptr;
    CHECK_CUDA(cudaMalloc(&pool, l.PoolBytes()));
    Fill(pool, l.PoolBytes(), d_tile, stream);
    const KernelResult k = TimeKernels(l, pool, tile, props.multiProcessorCount, reps, stream);
    CHECK_CUDA(cudaFree(pool));
    const double gbs = gb / (k.ms.median * 1e-3);
    const double ratio = gbs / copy.median;
    if (sessions >= 32) {
      best_ratio = std::max(best_ratio, ratio);
      worst_ratio = std::min(worst_ratio, ratio);
      ++rows_32;
    }
    float max_diff = k.max_diff;  // the backend call's output joins below
    std::string backend_ms = "-", backend_gbs = "-";
    if (backend.ok() && static_cast<double>(l.PoolBytes()) > arena_max_gib * kGiB) {
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
        const auto it = std::find(notes.begin(), notes.end(), why);
        backend_ms = "note " + std::to_string(1 + (it - notes.begin()));
        if (it == notes.end()) notes.push_back(why);
      }
    }
    const bool bad = !(max_diff < 2e-2f);
    mismatch |= bad;
    std::printf("| %lld | %lld | %.2f | %d | %.3f / %.3f | %.0f | %.2f | %.3f | %s | %s | %.1e%s |\n",
                static_cast<long long>(sessions), static_cast<long long>(tokens), gb, k.splits, k.ms.median,
                k.ms.best, gbs, ratio, k.append_ms, backend_ms.c_str(), backend_gbs.c_str(), max_diff,
                bad ? " MISMATCH" : "");
    std::fflush(stdout);
  }
  CHECK_CUDA(cudaFree(d_tile));
  if (!backend.ok()) std::printf("\nbackend calls not timed: %s\n", std::string(backend.status().message()).c_str());
  std::printf("\nbackend calls: blocks in AllocateCacheArena memory up to %.0f GiB (--arena_max_gib)\n", arena_max_gib);
  for (size_t i = 0; i < notes.size(); ++i) std::printf("backend call note %zu: %s\n", i + 1, notes[i].c_str());
  std::printf("\nGB/s: cache bytes read (sessions x T x Hkv x d_k x 2 x 2) over the median kernel time; of copy: that"
              " over the median D2D copy rate (read + write)\n");
  std::printf("decode at 32+ sessions >= 75%% of copy bandwidth: %s (best ratio %.2f, worst %.2f, %d rows)%s\n",
              rows_32 > 0 && best_ratio >= 0.75 ? "PASS" : "FAIL", best_ratio, rows_32 > 0 ? worst_ratio : 0.0,
              rows_32, mismatch ? "; outputs MISMATCH the host" : "");
  cudaStreamDestroy(stream);
  return mismatch ? 1 : 0;
}

}  // namespace
}  // namespace cuda
}  // namespace mha

int main(int argc, char** argv) { return mha::cuda::Main(argc, argv); }
