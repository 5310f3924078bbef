#include "server/backends/cpu/paged_prefill.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/paged_attention.h"
#include "server/backends/cpu/paged_merge.h"
#include "server/backends/cpu/scratch.h"

namespace mha::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys of one step of the online softmax: several blocks' scores at once, so that each row's max, sum and rescaling
// (two horizontal reductions and a scalar exp) are paid once per this many keys rather than once per block.
constexpr int64_t kSpanKeys = 256;
int64_t SpanBlocks(int64_t block_tokens) { return std::max<int64_t>(1, kSpanKeys / block_tokens); }

// Units per thread the tiles aim for before they shrink (down to kMinTileRows rows): an uneven unit or a slow
// thread evens out.
constexpr int64_t kUnitsPerThread = 4;
constexpr int64_t kMinTileRows = 32;

// New tokens [i0, i1) of sequence `seq` for KV head g; `cost` orders the units (longest first).
struct Unit {
  int64_t seq, g, i0, i1, cost;
};

// Tokens per tile: as many as fill kPrefillTileRows rows, fewer while the units would not keep every thread busy.
int64_t TileTokens(const PagedProblem& p, absl::Span<const PagedSequence> sequences, int threads) {
  const int64_t G = p.heads.group_size();
  int64_t tile = std::max<int64_t>(1, kPrefillTileRows / G);
  while (tile * G > kMinTileRows && tile > 1) {
    int64_t units = 0;
    for (const PagedSequence& seq : sequences) {
      if (TakesPrefillPath(p, seq)) units += p.heads.num_kv_heads * ((seq.new_tokens + tile - 1) / tile);
    }
    if (units >= kUnitsPerThread * threads) break;
    tile /= 2;
  }
  return tile;
}

std::vector<Unit> PlanUnits(const PagedProblem& p, absl::Span<const PagedSequence> sequences, int threads) {
  const int64_t tile = TileTokens(p, sequences, threads), G = p.heads.group_size();
  std::vector<Unit> units;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
    if (!TakesPrefillPath(p, seq)) continue;
    for (int64_t i0 = 0; i0 < seq.new_tokens; i0 += tile) {
      const int64_t i1 = std::min(seq.new_tokens, i0 + tile);
      const int64_t cost = (i1 - i0) * G * PagedVisibleKeys(seq, i1 - 1);
      for (int64_t g = 0; g < p.heads.num_kv_heads; ++g) units.push_back({static_cast<int64_t>(s), g, i0, i1, cost});
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  return units;
}

// A thread's buffers for one unit: its rows' scaled queries, a span's scores, and their online softmax state.
struct PrefillScratch {
  ScratchVector<float> queries, scores, acc, max, sum, stats, factor, query_pos;
  ScratchVector<int64_t> visible, block_visible;
};

PrefillScratch& ThreadPrefillScratch() {
  thread_local PrefillScratch scratch;
  return scratch;
}

// The score and softmax settings of a call: scores in log2 units where the scale allows (tile_kernels.h).
struct Scaling {
  bool log2 = true;
  float q_scale = 0.0f;
};

// One unit: row r = (i - i0) G + j is new token i of query head g G + j, block after block of its cache.
void RunUnit(const kernels::TileKernels& tiles, const kernels::PagedKernels& kernels, const PagedProblem& p,
             const Scaling& scaling, const PagedSequence& seq, int64_t first_row, const float* q, int64_t ldq,
             const Unit& unit, float* heads, int64_t ldh) {
  const KvCacheLayout& c = p.cache;
  const int64_t dk = p.heads.head_dim, tb = c.block_tokens, G = p.heads.group_size();
  const int64_t rows = G * (unit.i1 - unit.i0);
  const int64_t half = c.KeyBytes();  // bytes of a head's K^T, and of its V
  const bool stats = seq.stats.entropy != nullptr;     // lse alone comes from the plain softmax's max and sum
  PrefillScratch& t = ThreadPrefillScratch();
  float* queries = Grown(t.queries, rows * dk);
  float* scores = Grown(t.scores, rows * SpanBlocks(tb) * tb);
  float* acc = Grown(t.acc, rows * dk);
  float* max = Grown(t.max, rows);
  float* sum = Grown(t.sum, rows);
  float* stat = Grown(t.stats, rows * kernels::kStatsPerRow);
  float* factor = Grown(t.factor, rows);
  float* query_pos = Grown(t.query_pos, rows);
  int64_t* visible = Grown(t.visible, rows);
  int64_t* block_visible = Grown(t.block_visible, rows);
  const int64_t tokens = seq.Keys(), blocks = (PagedVisibleKeys(seq, unit.i1 - 1) + tb - 1) / tb;
  const void* values[kSpanKeys / 16];  // a span's V parts (blocks of at least 16 tokens), and their scales
  const uint16_t* value_scales[kSpanKeys / 16];
  // KV head g's part of block b (its K^T, then V `half` bytes on); null past the unit's last block.
  const auto Part = [&](int64_t b) -> const char* {
    return b < blocks ? seq.blocks[b] + c.KeyPart(unit.g) : nullptr;
  };
  for (int64_t i = unit.i0; i < unit.i1; ++i) {
    const int64_t r = (i - unit.i0) * G;
    tiles.copy_scaled(G, dk, scaling.q_scale, q + (first_row + i) * ldq + unit.g * G * dk, dk, queries + r * dk, dk);
    std::fill_n(visible + r, G, PagedVisibleKeys(seq, i));
    std::fill_n(query_pos + r, G, static_cast<float>(seq.length + i));
  }
  std::fill_n(acc, rows * dk, 0.0f);
  std::fill_n(max, rows, kNegInf);
  std::fill_n(sum, rows, 0.0f);
  std::fill_n(stat, rows * kernels::kStatsPerRow, 0.0f);
  const int64_t span = SpanBlocks(tb), lds = span * tb;
  for (int64_t b0 = 0; b0 < blocks; b0 += span) {
    const int64_t b1 = std::min(blocks, b0 + span), keys = std::min((b1 - b0) * tb, tokens - b0 * tb);
    // Rows see more keys the later their token: those that see none of these blocks come first and sit them out.
    int64_t first = rows;
    for (int64_t r = rows - 1; r >= 0; --r) {
      block_visible[r] = std::clamp<int64_t>(visible[r] - b0 * tb, 0, keys);
      if (block_visible[r] > 0) first = r;
    }
    const int64_t live = rows - first, seen = block_visible[rows - 1];
    if (live == 0) continue;
    float* s = scores + first * lds;
    for (int64_t b = b0; b < b1; ++b) {
      kernels.prefill_scores(live, tb, dk, queries + first * dk, dk, Part(b), tb, KeyScales(c, Part(b)),
                             s + (b - b0) * tb, lds, Part(b + 1), half);
    }
    if (stats) {
      const kernels::SoftmaxStatsBlock block{b0 * tb, query_pos + first, seq.stats.sink_tokens,
                                             stat + first * kernels::kStatsPerRow};
      tiles.online_softmax_stats(live, keys, block_visible + first, s, lds, max + first, sum + first, factor + first,
                                 scaling.log2, block);
    } else {
      tiles.online_softmax(live, keys, block_visible + first, s, lds, max + first, sum + first, factor + first,
                           scaling.log2);
    }
    // The blocks' values at once (each row's outputs rescaled by its softmax factor, then summed over them in
    // registers): the blocks up to the last key any row sees.
    const int64_t seen_blocks = (seen + tb - 1) / tb;
    for (int64_t b = 0; b < seen_blocks; ++b) {
      values[b] = Part(b0 + b) + half;
      value_scales[b] = ValueScales(c, Part(b0 + b) + half);
    }
    const char* next = Part(b0 + seen_blocks);
    kernels.prefill_values(live, values, value_scales, seen_blocks, tb, seen - (seen_blocks - 1) * tb, dk, s, lds,
                           factor + first, acc + first * dk, dk, next == nullptr ? nullptr : next + half, half);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = unit.i0 + r / G, head = unit.g * G + r % G;
    const SplitRow split{acc + r * dk, max[r], sum[r], stat + r * kernels::kStatsPerRow};
    MergeRow({&split, 1}, dk, scaling.log2, seq, head * seq.new_tokens + i, heads + (first_row + i) * ldh + head * dk);
  }
}

}  // namespace

bool TakesPrefillPath(const PagedProblem& problem, const PagedSequence& seq) {
  return !TakesDecodePath(problem, seq) && !seq.weights.requested() && problem.cache.block_tokens % 16 == 0 &&
         QuantizedKernelsTake(problem.cache);
}

absl::Status PrefillSequences(const kernels::TileKernels& tiles, const kernels::PagedKernels& kernels,
                              const PagedProblem& p, absl::Span<const PagedSequence> sequences,
                              absl::Span<const int64_t> first_row, const float* q, int64_t ldq, float* heads,
                              int64_t ldh, const StopSignal* stop) {
  const std::vector<Unit> units = PlanUnits(p, sequences, omp_get_max_threads());
  if (units.empty()) return absl::OkStatus();
  Scaling settings;
  settings.log2 = std::isfinite(p.heads.scale * kernels::kLog2e);
  settings.q_scale = settings.log2 ? p.heads.scale * kernels::kLog2e : p.heads.scale;
  std::atomic<bool> stopped{false};
  const int64_t count = static_cast<int64_t>(units.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < count; ++u) {
    if (stopped.load(std::memory_order_relaxed)) continue;
    if (stop != nullptr && !stop->Check().ok()) {
      stopped = true;
      continue;
    }
    const Unit& unit = units[u];
    RunUnit(tiles, kernels, p, settings, sequences[unit.seq], first_row[unit.seq], q, ldq, unit, heads, ldh);
  }
  if (stopped) return stop->Check();
  return absl::OkStatus();
}

int64_t PrefillBytesPerThread(const PagedProblem& p) {
  const int64_t rows = kPrefillTileRows + p.heads.group_size();  // a tile of G rows per token at most
  const int64_t span_keys = SpanBlocks(p.cache.block_tokens) * p.cache.block_tokens;  // a span's scores per row
  const int64_t floats = rows * (2 * p.heads.head_dim + span_keys + 4 + kernels::kStatsPerRow);
  return floats * static_cast<int64_t>(sizeof(float)) + 2 * rows * static_cast<int64_t>(sizeof(int64_t));
}

}  // namespace mha::cpu
