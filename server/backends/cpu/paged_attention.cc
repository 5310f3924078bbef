#include "server/backends/cpu/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/attention_core.h"
#include "server/backends/cpu/scratch.h"
#include "server/backends/float_io.h"

namespace mha::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A split of a long cache covers at least this many keys: a shorter one costs more in its merge than it saves.
constexpr int64_t kMinSplitKeys = 512;
// Work units per thread the decode path aims for, so that an uneven unit or a slow thread evens out.
constexpr int64_t kUnitsPerThread = 4;

// Blocks [b0, b1) of KV head g of sequence `seq`; its partial result at `partial` floats into the call's buffer:
// rows x d_k accumulators (relative to the rows' maxima), then rows maxima, then rows sums.
struct Unit {
  int64_t seq, g, b0, b1, partial;
};

// The decode path's plan: units in (sequence, KV head) order, each pair's splits next to each other.
struct DecodePlan {
  std::vector<Unit> units;
  std::vector<int64_t> pair_begin;  // per (decode sequence, KV head) pair: its first unit; one more at the end
  int64_t partial_floats = 0;
  bool log2_units = true;
  float q_scale = 0.0f;
};

int64_t Blocks(const KvCacheLayout& cache, const PagedSequence& seq) {
  return (seq.length + seq.new_tokens + cache.block_tokens - 1) / cache.block_tokens;
}

DecodePlan PlanDecode(const PagedProblem& p, absl::Span<const PagedSequence> sequences, int threads) {
  const HeadSpec& h = p.heads;
  DecodePlan plan;
  plan.log2_units = std::isfinite(h.scale * kernels::kLog2e);
  plan.q_scale = plan.log2_units ? h.scale * kernels::kLog2e : h.scale;
  int64_t pairs = 0;
  for (const PagedSequence& seq : sequences) pairs += TakesDecodePath(p, seq) ? h.num_kv_heads : 0;
  const int64_t wanted = std::max<int64_t>(1, (kUnitsPerThread * threads + pairs - 1) / std::max<int64_t>(pairs, 1));
  const int64_t min_blocks = std::max<int64_t>(1, kMinSplitKeys / p.cache.block_tokens);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
    if (!TakesDecodePath(p, seq)) continue;
    const int64_t blocks = Blocks(p.cache, seq), rows = h.group_size() * seq.new_tokens;
    const int64_t splits = std::clamp<int64_t>(blocks / min_blocks, 1, wanted);
    for (int64_t g = 0; g < h.num_kv_heads; ++g) {
      plan.pair_begin.push_back(static_cast<int64_t>(plan.units.size()));
      for (int64_t k = 0; k < splits; ++k) {
        plan.units.push_back({static_cast<int64_t>(s), g, blocks * k / splits, blocks * (k + 1) / splits,
                              plan.partial_floats});
        plan.partial_floats += rows * (h.head_dim + 2);
      }
    }
  }
  plan.pair_begin.push_back(static_cast<int64_t>(plan.units.size()));
  return plan;
}

// Per-thread buffers of the decode path, sized for kDecodeRows rows.
struct DecodeScratch {
  ScratchVector<float> queries, scores;
  ScratchVector<float> factor;
  ScratchVector<int64_t> visible, block_visible;
};

DecodeScratch& ThreadDecodeScratch() {
  thread_local DecodeScratch scratch;
  return scratch;
}

// Issues prefetches for every cache line of `bytes` bytes at p, so that the next block's part streams in while
// this one computes: blocks lie apart in the pool, where the hardware prefetchers do not follow.
void PrefetchRange(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// One unit of the decode path into its partial result.
void RunUnit(const kernels::TileKernels& tiles, const PagedProblem& p, const DecodePlan& plan,
             const PagedSequence& seq, int64_t first_row, const float* q, int64_t ldq, const Unit& unit,
             float* partials) {
  const HeadSpec& h = p.heads;
  const KvCacheLayout& c = p.cache;
  const int64_t dk = h.head_dim, tb = c.block_tokens, G = h.group_size(), n = seq.new_tokens, rows = G * n;
  const int64_t element = static_cast<int64_t>(DTypeSize(c.dtype)), part_bytes = c.HeadElements() * element;
  const kernels::PagedKernels& kernels = tiles.paged[c.dtype - 1];
  DecodeScratch& t = ThreadDecodeScratch();
  float* queries = Grown(t.queries, kDecodeRows * dk);
  float* scores = Grown(t.scores, kDecodeRows * tb);
  float* factor = Grown(t.factor, kDecodeRows);
  int64_t* visible = Grown(t.visible, kDecodeRows);
  int64_t* block_visible = Grown(t.block_visible, kDecodeRows);
  float* acc = partials + unit.partial;
  float* row_max = acc + rows * dk;
  float* row_sum = row_max + rows;
  std::fill_n(acc, rows * dk, 0.0f);
  std::fill_n(row_max, rows, kNegInf);
  std::fill_n(row_sum, rows, 0.0f);
  // Row i G + j is new token i of query head g G + j, which sees cache positions 0..length + i.
  for (int64_t i = 0; i < n; ++i) {
    tiles.copy_scaled(G, dk, plan.q_scale, q + (first_row + i) * ldq + unit.g * G * dk, dk, queries + i * G * dk,
                      dk);
    for (int64_t j = 0; j < G; ++j) visible[i * G + j] = seq.length + i + 1;
  }
  const int64_t tokens = seq.length + n;
  for (int64_t b = unit.b0; b < unit.b1; ++b) {
    const char* part = seq.blocks[b] + c.KeyOffset(unit.g) * element;
    if (b + 1 < unit.b1) PrefetchRange(seq.blocks[b + 1] + c.KeyOffset(unit.g) * element, part_bytes);
    const int64_t keys = std::min(tb, tokens - b * tb);  // slots past the cache's end hold no token
    int64_t seen = 0;
    for (int64_t r = 0; r < rows; ++r) {
      block_visible[r] = std::clamp<int64_t>(visible[r] - b * tb, 0, keys);
      seen = std::max(seen, block_visible[r]);
    }
    kernels.scores(rows, tb, dk, queries, dk, part, tb, scores, tb);
    tiles.online_softmax(rows, keys, block_visible, scores, tb, row_max, row_sum, factor, plan.log2_units);
    kernels.values(rows, seen, dk, scores, tb, part + dk * tb * element, factor, acc, dk);
  }
}

// The partial results of one (sequence, KV head) pair's units, merged by their log-sum-exp into its heads' rows.
void MergePair(const PagedProblem& p, const DecodePlan& plan, int64_t begin, int64_t end, const PagedSequence& seq,
               int64_t first_row, const float* partials, float* heads, int64_t ldh) {
  const HeadSpec& h = p.heads;
  const int64_t dk = h.head_dim, G = h.group_size(), rows = G * seq.new_tokens, g = plan.units[begin].g;
  const auto weight = [&](float x) { return plan.log2_units ? std::exp2(x) : std::exp(x); };
  for (int64_t r = 0; r < rows; ++r) {
    float* out = heads + (first_row + r / G) * ldh + (g * G + r % G) * dk;
    float max = kNegInf, sum = 0.0f;
    bool nan = false;
    for (int64_t u = begin; u < end; ++u) {
      const float* part = partials + plan.units[u].partial + rows * dk;
      max = std::max(max, part[r]);
      nan |= std::isnan(part[rows + r]);
    }
    if (max == kNegInf || nan) {  // nothing visible: zeros; a NaN score: NaN, as the stateless paths give
      std::fill_n(out, dk, nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
      continue;
    }
    std::fill_n(out, dk, 0.0f);
    for (int64_t u = begin; u < end; ++u) {
      const float* acc = partials + plan.units[u].partial;
      const float m = acc[rows * dk + r];
      if (m == kNegInf) continue;
      const float w = weight(m - max);
      sum += w * acc[rows * dk + rows + r];
      for (int64_t d = 0; d < dk; ++d) out[d] += w * acc[r * dk + d];
    }
    const float inverse = 1.0f / sum;
    for (int64_t d = 0; d < dk; ++d) out[d] *= inverse;
  }
}

absl::Status DecodeSequences(const kernels::TileKernels& tiles, const PagedProblem& p,
                             absl::Span<const PagedSequence> sequences, const PagedRows& rows, const float* q,
                             int64_t ldq, float* heads, int64_t ldh, const StopSignal* stop) {
  const DecodePlan plan = PlanDecode(p, sequences, omp_get_max_threads());
  if (plan.units.empty()) return absl::OkStatus();
  std::vector<float> partials(plan.partial_floats);
  std::atomic<bool> stopped{false};
  const int64_t units = static_cast<int64_t>(plan.units.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < units; ++u) {
    if (stopped.load(std::memory_order_relaxed)) continue;
    if (stop != nullptr && !stop->Check().ok()) {
      stopped = true;
      continue;
    }
    const Unit& unit = plan.units[u];
    RunUnit(tiles, p, plan, sequences[unit.seq], rows.first_row[unit.seq], q, ldq, unit, partials.data());
  }
  if (stopped) return stop->Check();
  const int64_t pairs = static_cast<int64_t>(plan.pair_begin.size()) - 1;
#pragma omp parallel for schedule(static) if (pairs > 1)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t begin = plan.pair_begin[pair];
    const int64_t s = plan.units[begin].seq;
    MergePair(p, plan, begin, plan.pair_begin[pair + 1], sequences[s], rows.first_row[s], partials.data(), heads,
              ldh);
  }
  return absl::OkStatus();
}

// The gather path's copy of one sequence's cache: fp32 head-packed k and v [tokens, Hkv d_k].
void GatherCache(const KvCacheLayout& c, const PagedSequence& seq, float* k, float* v) {
  const int64_t dk = c.head_dim, tb = c.block_tokens, width = c.num_kv_heads * dk;
  const int64_t tokens = seq.length + seq.new_tokens, blocks = (tokens + tb - 1) / tb;
  const size_t element = DTypeSize(c.dtype);
#pragma omp parallel for schedule(static) if (tokens * width > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const char* block = seq.blocks[b];
    const int64_t keys = std::min(tb, tokens - b * tb);
    std::vector<float> column(tb);
    for (int64_t g = 0; g < c.num_kv_heads; ++g) {
      for (int64_t d = 0; d < dk; ++d) {
        DecodeToFloat(c.dtype, block + (c.KeyOffset(g) + d * tb) * element, keys, column.data());
        for (int64_t t = 0; t < keys; ++t) k[(b * tb + t) * width + g * dk + d] = column[t];
      }
      for (int64_t t = 0; t < keys; ++t) {
        DecodeToFloat(c.dtype, block + (c.ValueOffset(g) + t * dk) * element, dk, v + (b * tb + t) * width + g * dk);
      }
    }
  }
}

// Buffers of the gather path, kept by the calling thread like the backend's call scratch.
struct GatherScratch {
  ScratchVector<float> keys, values;
};

absl::Status GatherSequence(const kernels::TileKernels& tiles, const PagedProblem& p, const PagedSequence& seq,
                            int64_t first_row, const float* q, int64_t ldq, float* heads, int64_t ldh,
                            const StopSignal* stop) {
  thread_local GatherScratch scratch;
  const HeadSpec& h = p.heads;
  AttentionShape s;
  s.batch = 1;
  s.q_len = seq.new_tokens;
  s.kv_len = seq.length + seq.new_tokens;
  s.heads = h;
  s.heads.causal = true;
  const int64_t width = h.kv_width();
  float* k = Grown(scratch.keys, s.kv_len * width);
  float* v = Grown(scratch.values, s.kv_len * width);
  GatherCache(p.cache, seq, k, v);
  FloatOutput weights(seq.weights, h.num_heads * s.q_len * s.kv_len);
  const absl::Status status = Attend(tiles, s, AttentionMask(), Packed{q + first_row * ldq, ldq}, Packed{k, width},
                                     Packed{v, width}, PackedOut{heads + first_row * ldh, ldh}, weights.data(), stop);
  ReleaseIfLarge(scratch.keys, kKeptCallScratchBytes);
  ReleaseIfLarge(scratch.values, kKeptCallScratchBytes);
  if (!status.ok()) return status;
  weights.Finish();
  return absl::OkStatus();
}

// One element of the cache at `to`, from fp32.
void StoreElement(v1::DataType dtype, float value, char* to) { EncodeFromFloat(dtype, &value, 1, to); }

}  // namespace

bool TakesDecodePath(const PagedProblem& problem, const PagedSequence& seq) {
  return !seq.weights.requested() && problem.heads.group_size() * seq.new_tokens <= kDecodeRows &&
         problem.cache.block_tokens % 16 == 0;
}

void WriteTokens(const KvCacheLayout& c, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                 const float* k, int64_t ldk, const float* v, int64_t ldv) {
  const int64_t dk = c.head_dim, tb = c.block_tokens;
  const size_t element = DTypeSize(c.dtype);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
#pragma omp parallel for schedule(static) if (seq.new_tokens * c.num_kv_heads * dk > (1 << 16))
    for (int64_t i = 0; i < seq.new_tokens; ++i) {
      const int64_t t = seq.length + i, row = rows.first_row[s] + i;
      char* block = seq.blocks[t / tb];
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        const float* key = k + row * ldk + g * dk;
        for (int64_t d = 0; d < dk; ++d) {
          StoreElement(c.dtype, key[d], block + (c.KeyOffset(g) + d * tb + t % tb) * element);
        }
        EncodeFromFloat(c.dtype, v + row * ldv + g * dk, dk, block + (c.ValueOffset(g) + (t % tb) * dk) * element);
      }
    }
  }
}

absl::Status PagedAttend(const kernels::TileKernels& fp32_tiles, const PagedProblem& p,
                         absl::Span<const PagedSequence> sequences, const PagedRows& rows, const float* q,
                         int64_t ldq, float* heads, int64_t ldh, const StopSignal* stop) {
  if (absl::Status status = DecodeSequences(fp32_tiles, p, sequences, rows, q, ldq, heads, ldh, stop);
      !status.ok()) {
    return status;
  }
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (TakesDecodePath(p, sequences[s])) continue;
    absl::Status status = GatherSequence(fp32_tiles, p, sequences[s], rows.first_row[s], q, ldq, heads, ldh, stop);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

int64_t PagedAttendBytes(const kernels::TileKernels& fp32_tiles, const PagedProblem& p, int threads) {
  const HeadSpec& h = p.heads;
  const int64_t dk = h.head_dim;
  // Decode: partial results of up to kUnitsPerThread * threads splits per pair, and each thread's scratch.
  const int64_t splits = std::max<int64_t>(1, kUnitsPerThread * threads);
  const int64_t decode = p.sequences * h.num_kv_heads * splits * kDecodeRows * (dk + 2) +
                         threads * kDecodeRows * (dk + p.cache.block_tokens + 1);
  // Gather: one sequence's cache in fp32, its weights before encoding, the tile kernels' scratch.
  AttentionShape s;
  s.batch = 1;
  s.q_len = p.max_new_tokens;
  s.kv_len = p.max_length;
  s.heads = h;
  const int64_t gather = 2 * p.max_length * h.kv_width() +
                         (p.return_weights ? h.num_heads * p.max_new_tokens * p.max_length : 0);
  return (decode + gather) * static_cast<int64_t>(sizeof(float)) +
         threads * AttendScratchBytesPerThread(fp32_tiles, s);
}

}  // namespace mha::cpu
