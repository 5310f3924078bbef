#include "server/backends/cpu/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/attention_core.h"
#include "server/backends/cpu/paged_cascade.h"
#include "server/backends/cpu/paged_merge.h"
#include "server/backends/cpu/paged_prefill.h"
#include "server/backends/cpu/scratch.h"
#include "server/backends/float_io.h"
#include "server/backends/quantized_cache.h"

namespace mha::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kDecodeRows <= kernels::kQuantizedMaxRows, "the 8-bit decode kernels' row buffers");
// A split of a long cache covers at least this many keys: a shorter one costs more in its merge than it saves.
constexpr int64_t kMinSplitKeys = 512;
// Work units per thread the decode path aims for, so that an uneven unit or a slow thread evens out.
constexpr int64_t kUnitsPerThread = 4;

// Blocks [b0, b1) of sequence `seq`, every KV head: a thread streams its blocks whole, one after another, the way
// the memory prefetchers follow best. Its partial result lies at `partial` floats into the call's buffer: for each
// KV head g, its G n rows of d_k accumulators (relative to the rows' maxima), then the rows' maxima and sums, then
// their softmax statistics' accumulators (kStatsPerRow per row, zero unless asked for).
struct Unit {
  int64_t seq, b0, b1, partial;
};

// Blocks [b0, b1) of a group's shared blocks (paged_cascade.h), every KV head, for all its members' rows; its
// partial states at `partial` floats into the call's buffer.
struct SharedUnit {
  int64_t group, b0, b1, partial;
};

// The decode path's plan: units in sequence order, a sequence's splits next to each other; its own units start
// after the blocks it shares with a group, whose shared units compute those once for all members.
struct DecodePlan {
  std::vector<Unit> units;
  std::vector<int64_t> seq_units;  // per decode sequence: its first unit; one more at the end
  std::vector<int64_t> seq_index;  // per decode sequence: its index among the call's sequences
  std::vector<SharedGroup> groups;
  std::vector<SharedUnit> shared_units;  // in group order
  std::vector<int64_t> group_units;      // per group: its first shared unit; one more at the end
  std::vector<int64_t> group_of;         // per call sequence: its group, or -1
  std::vector<int64_t> row0_of;          // per call sequence in a group: its first stacked row
  int64_t partial_floats = 0;
  bool log2_units = true;
  float q_scale = 0.0f;
};

int64_t Blocks(const KvCacheLayout& cache, const PagedSequence& seq) {
  return (seq.Keys() + cache.block_tokens - 1) / cache.block_tokens;
}

// The groups' shared units: each group's shared blocks split as a long cache is, into splits of at least
// kMinSplitKeys keys and at most `wanted` per group.
void PlanShared(const PagedProblem& p, int64_t wanted, DecodePlan* plan) {
  const int64_t min_blocks = std::max<int64_t>(1, kMinSplitKeys / p.cache.block_tokens);
  for (size_t k = 0; k < plan->groups.size(); ++k) {
    const SharedGroup& group = plan->groups[k];
    plan->group_units.push_back(static_cast<int64_t>(plan->shared_units.size()));
    const int64_t splits = std::clamp<int64_t>(group.blocks / min_blocks, 1, std::max<int64_t>(wanted, 1));
    for (int64_t u = 0; u < splits; ++u) {
      plan->shared_units.push_back({static_cast<int64_t>(k), group.blocks * u / splits,
                                    group.blocks * (u + 1) / splits, plan->partial_floats});
      plan->partial_floats += p.heads.num_kv_heads * PartialFloats(p.heads, group.rows);
    }
    for (size_t m = 0; m < group.members.size(); ++m) {
      plan->group_of[group.members[m]] = static_cast<int64_t>(k);
      plan->row0_of[group.members[m]] = group.row0[m];
    }
  }
  plan->group_units.push_back(static_cast<int64_t>(plan->shared_units.size()));
}

DecodePlan PlanDecode(const PagedProblem& p, absl::Span<const PagedSequence> sequences, int threads) {
  const HeadSpec& h = p.heads;
  DecodePlan plan;
  plan.log2_units = std::isfinite(h.scale * kernels::kLog2e);
  plan.q_scale = plan.log2_units ? h.scale * kernels::kLog2e : h.scale;
  int64_t decoding = 0;
  for (const PagedSequence& seq : sequences) decoding += TakesDecodePath(p, seq) ? 1 : 0;
  plan.groups = FindSharedPrefixes(p, sequences);
  plan.group_of.assign(sequences.size(), -1);
  plan.row0_of.assign(sequences.size(), 0);
  // Few sequences split their caches so that every thread has units to take.
  const int64_t units_wanted = kUnitsPerThread * threads;
  const int64_t wanted = (units_wanted + decoding - 1) / std::max<int64_t>(decoding, 1);
  PlanShared(p, (units_wanted + static_cast<int64_t>(plan.groups.size()) - 1) /
                    std::max<int64_t>(1, static_cast<int64_t>(plan.groups.size())), &plan);
  const int64_t min_blocks = std::max<int64_t>(1, kMinSplitKeys / p.cache.block_tokens);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
    if (!TakesDecodePath(p, seq)) continue;
    const int64_t group = plan.group_of[s];
    const int64_t first = group >= 0 ? plan.groups[group].blocks : 0;  // the shared blocks are the group's
    const int64_t blocks = Blocks(p.cache, seq) - first, rows = h.group_size() * seq.new_tokens;
    const int64_t splits =
        blocks == 0 ? 0 : std::clamp<int64_t>(blocks / min_blocks, 1, std::max<int64_t>(wanted, 1));
    plan.seq_units.push_back(static_cast<int64_t>(plan.units.size()));
    plan.seq_index.push_back(static_cast<int64_t>(s));
    for (int64_t k = 0; k < splits; ++k) {
      plan.units.push_back({static_cast<int64_t>(s), first + blocks * k / splits,
                            first + blocks * (k + 1) / splits, plan.partial_floats});
      plan.partial_floats += h.num_kv_heads * PartialFloats(h, rows);
    }
  }
  plan.seq_units.push_back(static_cast<int64_t>(plan.units.size()));
  return plan;
}

// Per-thread buffers of the decode path: every KV head's queries (scaled), and one block's scores.
struct DecodeScratch {
  ScratchVector<float> queries, scores;
  ScratchVector<float> factor, query_pos;
  ScratchVector<int64_t> visible, block_visible;
};

DecodeScratch& ThreadDecodeScratch() {
  thread_local DecodeScratch scratch;
  return scratch;
}

// How many parts (one KV head's K^T and V in one block) ahead of the one computing the prefetches run: at least
// kLookaheadBytes of K^T ahead, so that a bf16 or fp16 cache, whose parts are half as long for the same compute,
// keeps as many bytes in flight as an fp32 one.
constexpr int64_t kLookaheadBytes = 16 << 10;
int64_t LookaheadParts(int64_t half) { return std::max<int64_t>(1, kLookaheadBytes / std::max<int64_t>(half, 1)); }

// A block's part sizes in bytes (KvCacheLayout's, computed once per unit rather than once per part: its functions
// are out of line, and a part computes in half a microsecond).
struct PartBytes {
  int64_t head, key, value;
  explicit PartBytes(const KvCacheLayout& c) : head(c.HeadBytes()), key(c.KeyBytes()), value(c.ValueBytes()) {}
};

// The address of part k of a unit (k = (block - b0) Hkv + KV head), or past its end, of the next unit's first
// block (`after`, may be null); null past that.
const char* PartAhead(int64_t Hkv, int64_t head_bytes, const PagedSequence& seq, const Unit& unit, const char* after,
                      int64_t k) {
  const int64_t parts = (unit.b1 - unit.b0) * Hkv;
  if (k < parts) return seq.blocks[unit.b0 + k / Hkv] + (k % Hkv) * head_bytes;
  if (after != nullptr && k - parts < Hkv) return after + (k - parts) * head_bytes;
  return nullptr;
}

// One unit of the decode path into its partial result: block after block, KV head after KV head, each head's part
// streamed once for its G n query rows, the next part prefetched while this one computes; during its last part,
// `after` (the next unit's first block, which this thread takes next if no other one does; may be null).
void RunUnit(const kernels::TileKernels& tiles, const kernels::PagedKernels& decode, const PagedProblem& p,
             const DecodePlan& plan, const PagedSequence& seq, int64_t first_row, const float* q, int64_t ldq,
             const Unit& unit, const char* after, float* partials) {
  const HeadSpec& h = p.heads;
  const KvCacheLayout& c = p.cache;
  const int64_t dk = h.head_dim, tb = c.block_tokens, G = h.group_size(), n = seq.new_tokens, rows = G * n;
  const int64_t Hkv = h.num_kv_heads;
  const PartBytes bytes(c);
  const int64_t distance = LookaheadParts(bytes.key);
  DecodeScratch& t = ThreadDecodeScratch();
  float* queries = Grown(t.queries, Hkv * rows * dk);
  float* scores = Grown(t.scores, rows * tb);
  float* factor = Grown(t.factor, rows);
  int64_t* visible = Grown(t.visible, rows);
  int64_t* block_visible = Grown(t.block_visible, rows);
  float* query_pos = Grown(t.query_pos, rows);
  float* part_of_unit = partials + unit.partial;
  // Row i G + j of KV head g is new token i of query head g G + j, which sees cache positions 0..length + i.
  for (int64_t g = 0; g < Hkv; ++g) {
    float* acc = part_of_unit + g * PartialFloats(h, rows);
    std::fill_n(acc, rows * dk, 0.0f);
    std::fill_n(acc + rows * dk, rows, kNegInf);
    std::fill_n(acc + rows * dk + rows, rows * (1 + kernels::kStatsPerRow), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      tiles.copy_scaled(G, dk, plan.q_scale, q + (first_row + i) * ldq + g * G * dk, dk,
                        queries + (g * rows + i * G) * dk, dk);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    std::fill_n(visible + i * G, G, PagedVisibleKeys(seq, i));
    std::fill_n(query_pos + i * G, G, static_cast<float>(seq.length + i));
  }
  const int64_t tokens = seq.Keys();
  for (int64_t b = unit.b0; b < unit.b1; ++b) {
    const int64_t keys = std::min(tb, tokens - b * tb);  // slots past the cache's end hold no token
    int64_t seen = 0;
    for (int64_t r = 0; r < rows; ++r) {
      block_visible[r] = std::clamp<int64_t>(visible[r] - b * tb, 0, keys);
      seen = std::max(seen, block_visible[r]);
    }
    for (int64_t g = 0; g < Hkv; ++g) {
      const char* part = seq.blocks[b] + g * bytes.head;
      const char* value_part = part + bytes.key;
      // The next part: this block's next head, or the next block's first; its K^T streams in during these
      // scores, its V during these values.
      const char* next = PartAhead(Hkv, bytes.head, seq, unit, after, (b - unit.b0) * Hkv + g + distance);
      float* acc = part_of_unit + g * PartialFloats(h, rows);
      decode.scores(rows, tb, dk, queries + g * rows * dk, dk, part, tb, KeyScales(c, part), scores, tb, next,
                    bytes.key);
      if (seq.stats.entropy != nullptr) {  // lse alone comes from the plain kernel's max and sum
        const kernels::SoftmaxStatsBlock stats{b * tb, query_pos, seq.stats.sink_tokens, acc + rows * (dk + 2)};
        tiles.online_softmax_stats(rows, keys, block_visible, scores, tb, acc + rows * dk, acc + rows * dk + rows,
                                   factor, plan.log2_units, stats);
      } else {
        tiles.online_softmax(rows, keys, block_visible, scores, tb, acc + rows * dk, acc + rows * dk + rows, factor,
                             plan.log2_units);
      }
      decode.values(rows, seen, dk, scores, tb, value_part, ValueScales(c, value_part), factor, acc, dk,
                    next == nullptr ? nullptr : next + bytes.key, bytes.value);
    }
  }
}

// Sequence s's units' partial results for KV head g, merged by their log-sum-exp into its heads' rows.
void MergeHead(const PagedProblem& p, const DecodePlan& plan, int64_t begin, int64_t end, int64_t g,
               int64_t seq_index, const PagedSequence& seq, int64_t first_row, const float* partials, float* heads,
               int64_t ldh) {
  const HeadSpec& h = p.heads;
  const int64_t dk = h.head_dim, G = h.group_size(), rows = G * seq.new_tokens;
  thread_local std::vector<SplitRow> splits;  // reused: a decode step merges every (sequence, KV head) pair
  // Its group's shared units first (their rows row0.. of the stacked ones), then its own.
  const int64_t group = plan.group_of[seq_index], row0 = plan.row0_of[seq_index];
  const int64_t shared_begin = group >= 0 ? plan.group_units[group] : 0;
  const int64_t shared = group >= 0 ? plan.group_units[group + 1] - shared_begin : 0;
  const int64_t stacked = group >= 0 ? plan.groups[group].rows : 0;
  splits.resize(shared + end - begin);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t u = 0; u < shared; ++u) {
      const float* acc = partials + plan.shared_units[shared_begin + u].partial + g * PartialFloats(h, stacked);
      const int64_t row = row0 + r;
      splits[u] = {acc + row * dk, acc[stacked * dk + row], acc[stacked * dk + stacked + row],
                   acc + stacked * (dk + 2) + row * kernels::kStatsPerRow};
    }
    for (int64_t u = begin; u < end; ++u) {
      const float* acc = partials + plan.units[u].partial + g * PartialFloats(h, rows);
      splits[shared + u - begin] = {acc + r * dk, acc[rows * dk + r], acc[rows * dk + rows + r],
                                    acc + rows * (dk + 2) + r * kernels::kStatsPerRow};
    }
    const int64_t stats_row = (g * G + r % G) * seq.new_tokens + r / G;  // in the sequence's [H, n]
    MergeRow(splits, dk, plan.log2_units, seq, stats_row, heads + (first_row + r / G) * ldh + (g * G + r % G) * dk);
  }
}

absl::Status DecodeSequences(const kernels::TileKernels& tiles, const kernels::PagedKernels& decode,
                             const PagedProblem& p, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                             const float* q, int64_t ldq, float* heads, int64_t ldh, const StopSignal* stop) {
  const DecodePlan plan = PlanDecode(p, sequences, omp_get_max_threads());
  if (plan.seq_index.empty()) return absl::OkStatus();
  // The calling thread's, kept across calls (every unit fills its own part): a fresh zeroed vector cost a decode
  // step of 32 sessions more than its merges.
  thread_local ScratchVector<float> partial_scratch;
  float* const partials = Grown(partial_scratch, plan.partial_floats);
  const absl::Cleanup release = [] { ReleaseIfLarge(partial_scratch, kKeptCallScratchBytes); };
  std::atomic<bool> stopped{false};
  // Polled before each unit: once `stop` says stop, the units left are skipped.
  const auto Stopping = [&] {
    if (stopped.load(std::memory_order_relaxed)) return true;
    if (stop != nullptr && !stop->Check().ok()) stopped = true;
    return stopped.load(std::memory_order_relaxed);
  };
  const int64_t shared_units = static_cast<int64_t>(plan.shared_units.size());
#pragma omp parallel for schedule(dynamic, 1) if (shared_units > 0)
  for (int64_t u = 0; u < shared_units; ++u) {
    if (Stopping()) continue;
    const SharedUnit& unit = plan.shared_units[u];
    RunSharedBlocks(tiles, decode, p, plan.groups[unit.group], sequences, rows.first_row, q, ldq, plan.q_scale,
                    plan.log2_units, unit.b0, unit.b1, partials + unit.partial);
  }
  if (stopped) return stop->Check();
  const int64_t units = static_cast<int64_t>(plan.units.size());
  // Round robin, so that a thread knows its next unit and streams its first block in while it ends this one. The
  // units are about equal (whole sequences of a batch, or equal splits of a long one).
  const int64_t threads = omp_get_max_threads();
#pragma omp parallel for schedule(static, 1)
  for (int64_t u = 0; u < units; ++u) {
    if (Stopping()) continue;
    const Unit& unit = plan.units[u];
    const char* after = nullptr;
    if (u + threads < units) after = sequences[plan.units[u + threads].seq].blocks[plan.units[u + threads].b0];
    RunUnit(tiles, decode, p, plan, sequences[unit.seq], rows.first_row[unit.seq], q, ldq, unit, after,
            partials);
  }
  if (stopped) return stop->Check();
  const int64_t Hkv = p.heads.num_kv_heads, decoding = static_cast<int64_t>(plan.seq_index.size());
#pragma omp parallel for schedule(static) if (decoding * Hkv > 1)
  for (int64_t pair = 0; pair < decoding * Hkv; ++pair) {
    const int64_t d = pair / Hkv, s = plan.seq_index[d];
    MergeHead(p, plan, plan.seq_units[d], plan.seq_units[d + 1], pair % Hkv, s, sequences[s], rows.first_row[s],
              partials, heads, ldh);
  }
  return absl::OkStatus();
}

// The gather path's copy of the first `tokens` of one sequence's cache: fp32 head-packed k and v [tokens, Hkv d_k].
void GatherHistory(const KvCacheLayout& c, const PagedSequence& seq, int64_t tokens, float* k, float* v) {
  const int64_t dk = c.head_dim, tb = c.block_tokens, width = c.num_kv_heads * dk;
  const int64_t blocks = (tokens + tb - 1) / tb;
  const size_t element = DTypeSize(c.dtype);
#pragma omp parallel for schedule(static) if (tokens * width > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const char* block = seq.blocks[b];
    const int64_t keys = std::min(tb, tokens - b * tb);
    std::vector<float> column(tb);
    for (int64_t g = 0; g < c.num_kv_heads && c.Quantized(); ++g) {
      quant::ReadTokens(c, block, g, keys, k + b * tb * width + g * dk, width, v + b * tb * width + g * dk, width);
    }
    for (int64_t g = 0; g < c.num_kv_heads && !c.Quantized(); ++g) {
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

// n rows of `width` fp32 values (row stride ld) as the cache holds them: rounded to its dtype, into dst (dense).
void AsCached(v1::DataType dtype, const float* src, int64_t n, int64_t width, int64_t ld, float* dst) {
#pragma omp parallel for schedule(static) if (n * width > (1 << 16))
  for (int64_t r = 0; r < n; ++r) {
    thread_local std::vector<char> encoded;
    if (dtype != v1::FP32) encoded.resize(width * DTypeSize(dtype));
    if (dtype == v1::FP32) {
      std::memcpy(dst + r * width, src + r * ld, width * sizeof(float));
      continue;
    }
    EncodeFromFloat(dtype, src + r * ld, width, encoded.data());
    DecodeToFloat(dtype, encoded.data(), width, dst + r * width);
  }
}

// Buffers of the gather path, kept by the calling thread like the backend's call scratch.
struct GatherScratch {
  ScratchVector<float> keys, values;
};

// The history from the cache, the new tokens' k and v from their projections as the cache now holds them (the
// same values, without reading back what WriteTokens just wrote in its transposed layout).
absl::Status GatherSequence(const kernels::TileKernels& tiles, const PagedProblem& p, const PagedSequence& seq,
                            int64_t first_row, const PagedQkv& qkv, float* heads, int64_t ldh,
                            const StopSignal* stop) {
  thread_local GatherScratch scratch;
  const HeadSpec& h = p.heads;
  AttentionShape s;
  s.batch = 1;
  s.q_len = seq.new_tokens;
  s.kv_len = seq.Keys();
  s.heads = h;
  s.heads.causal = seq.append;  // without append every new token sees the whole (earlier) cache
  const int64_t width = h.kv_width();
  Packed keys{qkv.k + first_row * qkv.ldk, qkv.ldk}, values{qkv.v + first_row * qkv.ldv, qkv.ldv};
  // An empty fp32 cache holds exactly the projections: attended where they are. Otherwise history and new tokens
  // together, as the cache holds them.
  if (!seq.append || seq.length > 0 || p.cache.dtype != v1::FP32) {
    float* k = Grown(scratch.keys, std::max<int64_t>(s.kv_len, 1) * width);
    float* v = Grown(scratch.values, std::max<int64_t>(s.kv_len, 1) * width);
    // An 8-bit cache's new tokens as it holds them depend on the block's scales: read back with the history.
    GatherHistory(p.cache, seq, p.cache.Quantized() ? seq.Keys() : seq.length, k, v);
    if (seq.append && !p.cache.Quantized()) {
      AsCached(p.cache.dtype, keys.data, seq.new_tokens, width, keys.row_stride, k + seq.length * width);
      AsCached(p.cache.dtype, values.data, seq.new_tokens, width, values.row_stride, v + seq.length * width);
    }
    keys = Packed{k, width};
    values = Packed{v, width};
  }
  FloatOutput weights(seq.weights, h.num_heads * s.q_len * s.kv_len);
  // Without append the queries sit at length.. while the stateless rule puts them at length - n..
  const absl::Status status =
      Attend(tiles, s, AttentionMask(), Packed{qkv.q + first_row * qkv.ldq, qkv.ldq}, keys, values,
             PackedOut{heads + first_row * ldh, ldh}, weights.data(), stop, seq.stats, seq.append ? 0 : seq.new_tokens);
  ReleaseIfLarge(scratch.keys, kKeptCallScratchBytes);
  ReleaseIfLarge(scratch.values, kKeptCallScratchBytes);
  if (!status.ok()) return status;
  weights.Finish();
  return absl::OkStatus();
}

}  // namespace

const uint16_t* KeyScales(const KvCacheLayout& c, const char* key_part) {
  return c.Quantized() ? reinterpret_cast<const uint16_t*>(key_part + quant::KeyScalesOffset(c)) : nullptr;
}

const uint16_t* ValueScales(const KvCacheLayout& c, const char* value_part) {
  return c.Quantized() ? reinterpret_cast<const uint16_t*>(value_part + quant::ValueScalesOffset(c)) : nullptr;
}

bool QuantizedKernelsTake(const KvCacheLayout& c) {
  return !c.Quantized() ||
         (c.head_dim <= kernels::kQuantizedMaxElements && c.block_tokens <= kernels::kQuantizedMaxElements);
}

bool TakesDecodePath(const PagedProblem& problem, const PagedSequence& seq) {
  return !seq.weights.requested() && problem.heads.group_size() * seq.new_tokens <= kDecodeRows &&
         problem.cache.block_tokens % 16 == 0 && QuantizedKernelsTake(problem.cache);
}

void ForEachSequence(absl::Span<const PagedSequence> sequences, absl::FunctionRef<void(size_t)> each) {
  const bool short_ones = sequences.size() > 1 && std::all_of(sequences.begin(), sequences.end(), [](const auto& seq) {
                            return seq.new_tokens <= kShortSequenceTokens;
                          });
  const int64_t count = static_cast<int64_t>(sequences.size());
#pragma omp parallel for schedule(dynamic, 1) if (short_ones)
  for (int64_t s = 0; s < count; ++s) each(static_cast<size_t>(s));
}

namespace {

// n rows of dk elements of type T at `rows` (dense) into the columns of K^T at `kt` (row stride ld elements).
template <typename T>
void Transpose(int64_t n, int64_t dk, const char* rows, char* kt, int64_t ld) {
  for (int64_t d = 0; d < dk; ++d) {
    for (int64_t i = 0; i < n; ++i) {
      T x;
      std::memcpy(&x, rows + (i * dk + d) * sizeof(T), sizeof(T));
      std::memcpy(kt + (d * ld + i) * sizeof(T), &x, sizeof(T));
    }
  }
}

// n new tokens' k and v of KV head g (fp32 rows of d_k at k and v, strides ldk and ldv) into a 16- or 32-bit block
// at slots slot0.., rounded to its dtype. The keys are encoded as rows, then transposed into K^T's columns: encoded
// one K^T element at a time, a decode step's single token cost a conversion call per depth.
void WriteHead(const KvCacheLayout& c, char* block, int64_t g, int64_t slot0, int64_t n, const float* k,
               int64_t ldk, const float* v, int64_t ldv) {
  const int64_t dk = c.head_dim, tb = c.block_tokens;
  const size_t element = DTypeSize(c.dtype);
  thread_local ScratchVector<char> scratch;  // at most a block's keys of one head
  char* encoded = Grown(scratch, n * dk * static_cast<int64_t>(element));
  for (int64_t i = 0; i < n; ++i) EncodeFromFloat(c.dtype, k + i * ldk, dk, encoded + i * dk * element);
  char* key_part = block + (c.KeyOffset(g) + slot0) * element;
  if (element == 2) {
    Transpose<uint16_t>(n, dk, encoded, key_part, tb);
  } else {
    Transpose<uint32_t>(n, dk, encoded, key_part, tb);
  }
  for (int64_t i = 0; i < n; ++i) {
    EncodeFromFloat(c.dtype, v + i * ldv, dk, block + (c.ValueOffset(g) + (slot0 + i) * dk) * element);
  }
}

}  // namespace

void WriteTokens(const KvCacheLayout& c, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                 const float* k, int64_t ldk, const float* v, int64_t ldv) {
  const int64_t dk = c.head_dim, tb = c.block_tokens, Hkv = c.num_kv_heads;
  ForEachSequence(sequences, [&](size_t s) {
    const PagedSequence& seq = sequences[s];
    if (!seq.append) return;
    // Block by block: a block's new slots of a K^T row are contiguous.
    const int64_t first_block = seq.length / tb, last_block = (seq.length + seq.new_tokens - 1) / tb;
#pragma omp parallel for schedule(static) if (seq.new_tokens * Hkv * dk > (1 << 16))
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t t0 = std::max(seq.length, b * tb), t1 = std::min(seq.length + seq.new_tokens, (b + 1) * tb);
      const int64_t row0 = rows.first_row[s] + t0 - seq.length, slot0 = t0 - b * tb, n = t1 - t0;
      for (int64_t g = 0; g < Hkv; ++g) {  // an 8-bit cache's head's new tokens in one write, as every backend's
        const float* head_k = k + row0 * ldk + g * dk;
        const float* head_v = v + row0 * ldv + g * dk;
        if (c.Quantized()) {
          quant::WriteTokens(c, seq.blocks[b], g, slot0, n, head_k, ldk, head_v, ldv);
        } else {
          WriteHead(c, seq.blocks[b], g, slot0, n, head_k, ldk, head_v, ldv);
        }
      }
    }
  });
}

absl::Status PagedAttend(const kernels::TileKernels& fp32_tiles, const kernels::PagedKernels& decode,
                         const PagedProblem& p, absl::Span<const PagedSequence> sequences, const PagedRows& rows,
                         const PagedQkv& qkv, float* heads, int64_t ldh, const StopSignal* stop) {
  if (absl::Status status = DecodeSequences(fp32_tiles, decode, p, sequences, rows, qkv.q, qkv.ldq, heads, ldh, stop);
      !status.ok()) {
    return status;
  }
  if (absl::Status status = PrefillSequences(fp32_tiles, decode, p, sequences, rows.first_row, qkv.q, qkv.ldq, heads,
                                             ldh, stop);
      !status.ok()) {
    return status;
  }
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (TakesDecodePath(p, sequences[s]) || TakesPrefillPath(p, sequences[s])) continue;
    absl::Status status = GatherSequence(fp32_tiles, p, sequences[s], rows.first_row[s], qkv, heads, ldh, stop);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

int64_t PagedAttendBytes(const kernels::TileKernels& fp32_tiles, const PagedProblem& p, int threads) {
  const HeadSpec& h = p.heads;
  const int64_t dk = h.head_dim;
  // Decode: partial results of up to kUnitsPerThread * threads splits per pair, and each thread's scratch.
  const int64_t splits = std::max<int64_t>(1, kUnitsPerThread * threads);
  // The shared blocks' partial states as many again (their stacked rows are the members' rows).
  const int64_t decode = 2 * p.sequences * h.num_kv_heads * splits * PartialFloats(h, kDecodeRows) +
                         threads * kDecodeRows * (h.num_kv_heads * dk + p.cache.block_tokens + 1);
  const int64_t prefill = threads * (PrefillBytesPerThread(p) + SharedBlocksBytesPerThread(p));
  // Gather (weights asked for, or blocks no paged kernel takes): one sequence's cache in fp32, its weights before
  // encoding, the tile kernels' scratch.
  if (!p.return_weights && p.cache.block_tokens % 16 == 0) {
    return decode * static_cast<int64_t>(sizeof(float)) + prefill;
  }
  AttentionShape s;
  s.batch = 1;
  s.q_len = p.max_new_tokens;
  s.kv_len = p.max_length;
  s.heads = h;
  const int64_t gather = 2 * p.max_length * h.kv_width() +
                         (p.return_weights ? h.num_heads * p.max_new_tokens * p.max_length : 0);
  return (decode + gather) * static_cast<int64_t>(sizeof(float)) + prefill +
         threads * AttendScratchBytesPerThread(fp32_tiles, s);
}

}  // namespace mha::cpu
