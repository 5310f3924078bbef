#include "server/backends/cpu/attention_core.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/backends/row_stats.h"

namespace mha::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The blocking of one Attend call, decided once before the parallel region.
struct CorePlan {
  int64_t query_blocks = 0;    // per (batch, head)
  int64_t items = 0;           // B H query_blocks work items
  int64_t row_block = 0;       // rows of a full item: min(kQueryBlock, Tq)
  int64_t panel = 0;           // rows per panel: one register block of the kernels
  int64_t key_block = 0;       // keys per online-softmax block
  int64_t kt_size = 0;         // floats of one packed K^T
  int64_t v_panel_stride = 0;  // floats between the panels of one packed V
  int64_t v_size = 0;          // floats of one packed V
  int64_t run = 0;             // items a thread claims at once
  bool log2_units = false;     // scores in log2 units (see TileKernels::online_softmax)
  float q_scale = 0.0f;        // what the queries are multiplied by when copied
  bool prefetch_next = false;
};

CorePlan PlanBlocks(const kernels::TileKernels& tiles, const AttentionShape& s, const AttentionMask& mask,
                    int threads) {
  const HeadSpec& h = s.heads;
  const int64_t dk = h.head_dim;
  CorePlan p;
  p.query_blocks = (s.q_len + kQueryBlock - 1) / kQueryBlock;
  p.items = s.batch * h.num_heads * p.query_blocks;
  p.row_block = std::min(kQueryBlock, s.q_len);
  p.panel = std::min<int64_t>(tiles.panel_rows, p.row_block);
  p.key_block = std::min<int64_t>(tiles.key_block, s.kv_len);
  // Sizes in floats: a bf16 set (tiles.elements_per_float = 2) packs two elements per float.
  p.kt_size = (s.kv_len + tiles.key_panel - 1) / tiles.key_panel * tiles.key_panel * dk / tiles.elements_per_float;
  p.v_panel_stride = (s.kv_len + tiles.key_multiple - 1) / tiles.key_multiple * tiles.key_multiple *
                     tiles.value_panel / tiles.elements_per_float;
  p.v_size = (dk + tiles.value_panel - 1) / tiles.value_panel * p.v_panel_stride;
  // Runs long enough to reuse a packed KV head, short enough to balance (another tenant can slow one thread).
  p.run = std::clamp<int64_t>(p.items / (4 * threads), 1, h.group_size() * p.query_blocks);
  // log2 units save two of the thirteen operations of each exp, but not with an additive mask or a scale above
  // FLT_MAX / log2 e: a finite mask value such as the lowest float (PyTorch's usual mask) would overflow to -inf,
  // and a row masked by it alone would get zero weights instead of the reference's uniform ones.
  p.log2_units = mask.additive == nullptr && std::isfinite(h.scale * kernels::kLog2e);
  p.q_scale = p.log2_units ? h.scale * kernels::kLog2e : h.scale;
  // Prefetching pays only when the inputs are not already cached (not for tiny requests).
  const int64_t input_bytes = (s.batch * s.q_len * h.num_heads + 2 * s.batch * s.kv_len * h.num_kv_heads) * dk *
                              static_cast<int64_t>(sizeof(float));
  p.prefetch_next = input_bytes > (1 << 20);
  return p;
}

// Per-thread buffers, kept across calls (up to kKeptTileScratchBytes each) and grown on demand.
struct TileScratch {
  ScratchVector<float> queries;      // [row_block, d_k], scaled
  ScratchVector<float> keys_t;       // one (batch, KV head) of K^T, packed
  ScratchVector<float> values;       // the same of V
  ScratchVector<float> scores;       // [panel, key_block]
  ScratchVector<float> accumulator;  // [panel, d_k]
  ScratchVector<float> row_max, row_sum, row_factor;  // [panel]
  ScratchVector<int64_t> visible, block_visible;      // [panel]: keys each row sees, in all and in this block
  ScratchVector<float> stats_acc, query_pos;          // softmax statistics: [row_block, kStatsPerRow], [row_block]
};

TileScratch& ThreadTileScratch() {
  thread_local TileScratch scratch;
  return scratch;
}

// Prefetches the inputs of a thread's next work item into L2 while the current one computes, a slice per panel.
// Their head-packed rows are a few cache lines each, thousands of floats apart, a pattern the hardware prefetchers
// do not run ahead on (docs/DESIGN.md, the attention core).
class RowPrefetch {
 public:
  // Rows of `width` floats: `rows` of them from `first`, `stride` floats apart, to be read or (`write`) written.
  // At most four ranges.
  void Add(const float* first, int64_t rows, int64_t stride, int64_t width, bool write = false) {
    ranges_[count_++] = {first, rows, stride, width, write};
    total_ += rows;
  }
  // Issues the prefetches of the rows up to fraction `part / parts` of all rows (parts > 0).
  void Until(int64_t part, int64_t parts) {
    const int64_t until = total_ * part / parts;
    for (; done_ < until; ++done_) {
      int64_t row = done_, r = 0;
      while (row >= ranges_[r].rows) row -= ranges_[r++].rows;
      const Range& range = ranges_[r];
      // Every 64-byte line the row touches, from the one holding its first float to the one holding its last.
      const uintptr_t begin = reinterpret_cast<uintptr_t>(range.first + row * range.stride) & ~uintptr_t{63};
      const uintptr_t last = reinterpret_cast<uintptr_t>(range.first + row * range.stride + range.width - 1);
      for (uintptr_t line = begin; line <= last; line += 64) {
        if (range.write) {
          __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 2);
        } else {
          __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
        }
      }
    }
  }

 private:
  struct Range {
    const float* first;
    int64_t rows, stride, width;
    bool write;
  };
  Range ranges_[4] = {};
  int count_ = 0;
  int64_t total_ = 0, done_ = 0;
};

// Where work item `item` lies: batch b, query head h, first query row i0, `rows` rows.
struct Item {
  int64_t b, h, i0, rows;
};

// One OpenMP thread's part of an Attend call.
class Worker {
 public:
  Worker(const kernels::TileKernels& tiles, const AttentionShape& s, const AttentionMask& mask, const CorePlan& plan,
         Packed q, Packed k, Packed v, PackedOut out, float* weights, const RowStats& stats, int64_t position_shift)
      : tiles_(tiles), s_(s), mask_(mask), plan_(plan), q_(q), k_(k), v_(v), out_(out),
        weights_(weights), stats_(stats), position_shift_(position_shift) {
    // Sized to the problem, not the tile constants, so a short sequence with a huge head_dim stays small.
    TileScratch& t = ThreadTileScratch();
    const int64_t panel = plan.panel, dk = s.heads.head_dim;
    row_max_ = Grown(t.row_max, plan.row_block);
    row_sum_ = Grown(t.row_sum, plan.row_block);
    row_factor_ = Grown(t.row_factor, panel);
    visible_ = Grown(t.visible, plan.row_block);
    block_visible_ = Grown(t.block_visible, panel);
    queries_ = Grown(t.queries, plan.row_block * dk);
    keys_t_ = Grown(t.keys_t, plan.kt_size);
    values_ = Grown(t.values, plan.v_size);
    if (weights == nullptr) scores_ = Grown(t.scores, panel * plan.key_block);
    // With weights, the accumulator stages a panel's bf16 output.
    if (weights == nullptr || out.bf16 != nullptr) acc_ = Grown(t.accumulator, plan.row_block * dk);
    // lse alone comes from the plain kernels' max and sum; the other statistics need the stats kernels.
    if (stats.entropy != nullptr) {
      stats_acc_ = Grown(t.stats_acc, plan.row_block * kernels::kStatsPerRow);
      query_pos_ = Grown(t.query_pos, plan.row_block);
    }
  }

  Item Locate(int64_t item) const {
    const int64_t H = s_.heads.num_heads, blocks = plan_.query_blocks;
    const int64_t i0 = (item % blocks) * kQueryBlock;
    return {item / (H * blocks), (item / blocks) % H, i0, std::min(kQueryBlock, s_.q_len - i0)};
  }

  // Computes `item`, issuing `prefetch` (the next items' inputs) a slice per panel.
  void Run(int64_t item, RowPrefetch& prefetch) {
    const Item it = Locate(item);
    const int64_t dk = s_.heads.head_dim, Tq = s_.q_len, Tk = s_.kv_len;
    PackKvHead(it.b, it.h / s_.heads.group_size());
    const int64_t q_offset = (it.b * Tq + it.i0) * q_.row_stride + it.h * dk;  // dense and scaled below
    if (q_.bf16 != nullptr) {
      tiles_.copy_scaled_bf16(it.rows, dk, plan_.q_scale, q_.bf16 + q_offset, q_.row_stride, queries_, dk);
    } else {
      tiles_.copy_scaled(it.rows, dk, plan_.q_scale, q_.data + q_offset, q_.row_stride, queries_, dk);
    }
    const float* additive = mask_.additive == nullptr ? nullptr
                            : mask_.additive + (mask_.additive_per_batch ? it.b * Tq * Tk : 0) + it.i0 * Tk;
    for (int64_t r = 0; r < it.rows; ++r) visible_[r] = VisibleKeyCount(s_, mask_, it.b, it.i0 + r);
    stats_row_ = (it.b * s_.heads.num_heads + it.h) * Tq + it.i0;
    if (stats_acc_ != nullptr) {
      for (int64_t r = 0; r < it.rows; ++r) query_pos_[r] = static_cast<float>(it.i0 + r + Tk - Tq + position_shift_);
      std::fill_n(stats_acc_, it.rows * kernels::kStatsPerRow, 0.0f);
    }
    const int64_t out = (it.b * Tq + it.i0) * out_.row_stride + it.h * dk;  // the item's first output element
    if (weights_ == nullptr) {
      OnlineSoftmaxItem(it.rows, additive, out, prefetch);
      return;
    }
    const int64_t panels = (it.rows + plan_.panel - 1) / plan_.panel;
    for (int64_t p0 = 0; p0 < it.rows; p0 += plan_.panel) {
      prefetch.Until(p0 / plan_.panel + 1, panels);
      ExactSoftmaxPanel(it, p0, std::min(plan_.panel, it.rows - p0),
                        additive == nullptr ? nullptr : additive + p0 * Tk, out + p0 * out_.row_stride);
    }
  }

  // Adds to `prefetch` the next item's queries and output rows, and this item's share (index j of `share` items in
  // the current run) of the next run's K and V when that run starts a new KV head. fp32 inputs and output only
  // (Attend turns prefetching off for bf16 ones).
  void PrefetchNext(int64_t item, int64_t next, int64_t ahead, int64_t j, int64_t share, RowPrefetch& prefetch) const {
    if (!plan_.prefetch_next) return;
    const int64_t dk = s_.heads.head_dim, G = s_.heads.group_size(), Tq = s_.q_len, Tk = s_.kv_len;
    if (next < plan_.items) {
      const Item n = Locate(next);
      prefetch.Add(q_.data + (n.b * Tq + n.i0) * q_.row_stride + n.h * dk, n.rows, q_.row_stride, dk);
      prefetch.Add(out_.data + (n.b * Tq + n.i0) * out_.row_stride + n.h * dk, n.rows, out_.row_stride, dk,
                   /*write=*/true);
    }
    if (ahead < plan_.items) {
      const Item a = Locate(ahead), cur = Locate(item);
      const int64_t a_kv = a.h / G;
      if (a.b != cur.b || a_kv != cur.h / G) {
        const int64_t k0 = Tk * j / share, k1 = Tk * (j + 1) / share;
        prefetch.Add(k_.data + (a.b * Tk + k0) * k_.row_stride + a_kv * dk, k1 - k0, k_.row_stride, dk);
        prefetch.Add(v_.data + (a.b * Tk + k0) * v_.row_stride + a_kv * dk, k1 - k0, v_.row_stride, dk);
      }
    }
  }

 private:
  // Packs (batch b, KV head kv) of K^T and V into this thread's panels, unless they hold it already. Read in place
  // through the head-packed row stride instead, consecutive rows would fall into a handful of L1 sets and evict
  // each other.
  void PackKvHead(int64_t b, int64_t kv) {
    const int64_t id = b * s_.heads.num_kv_heads + kv;
    if (id == packed_kv_) return;
    const int64_t dk = s_.heads.head_dim, Tk = s_.kv_len;
    const int64_t k_offset = b * Tk * k_.row_stride + kv * dk, v_offset = b * Tk * v_.row_stride + kv * dk;
    if (k_.bf16 != nullptr) {
      tiles_.pack_keys_bf16(Tk, dk, k_.bf16 + k_offset, k_.row_stride, keys_t_);
      tiles_.pack_values_bf16(Tk, dk, v_.bf16 + v_offset, v_.row_stride, values_, plan_.v_panel_stride);
    } else {
      tiles_.pack_keys(Tk, dk, k_.data + k_offset, k_.row_stride, keys_t_);
      tiles_.pack_values(Tk, dk, v_.data + v_offset, v_.row_stride, values_, plan_.v_panel_stride);
    }
    packed_kv_ = id;
  }

  // Output row at element `dst` = scale * src[0, d_k) (rounded to bf16 for a bf16 output), or zeros for a null
  // src.
  void StoreRow(int64_t dst, const float* src, float scale) {
    const int64_t dk = s_.heads.head_dim;
    if (out_.bf16 != nullptr) {
      if (src != nullptr) {
        tiles_.copy_scaled_to_bf16(1, dk, scale, src, dk, out_.bf16 + dst, dk);
      } else {
        std::fill_n(out_.bf16 + dst, dk, uint16_t{0});
      }
    } else if (src != nullptr) {
      tiles_.copy_scaled(1, dk, scale, src, dk, out_.data + dst, dk);
    } else {
      std::fill_n(out_.data + dst, dk, 0.0f);
    }
  }

  // Keys at or past the returned count are invisible to every row [p0, p0 + rows) of the item.
  int64_t PanelKeys(int64_t p0, int64_t rows) const {
    return *std::max_element(visible_ + p0, visible_ + p0 + rows);
  }

  // Rows [p0, p0 + rows) of `it` with weights requested: the exact softmax over whole rows, computed in place in
  // the returned weights [B, H, Tq, Tk], then P V.
  void ExactSoftmaxPanel(const Item& it, int64_t p0, int64_t rows, const float* additive, int64_t out) {
    const int64_t dk = s_.heads.head_dim, Tq = s_.q_len, Tk = s_.kv_len;
    const int64_t keys = PanelKeys(p0, rows);
    const int64_t* visible = visible_ + p0;
    float* p = weights_ + ((it.b * s_.heads.num_heads + it.h) * Tq + it.i0 + p0) * Tk;
    if (keys > 0) tiles_.scores(rows, keys, dk, 1.0f, queries_ + p0 * dk, dk, keys_t_, p, Tk);
    if (additive != nullptr) {
      for (int64_t r = 0; r < rows; ++r) tiles_.add(visible[r], additive + r * Tk, p + r * Tk);
    }
    if (stats_.softmax()) {  // the exact softmax's stats kernel gives lse too
      tiles_.softmax_stats(rows, Tk, visible, p, Tk, plan_.log2_units, StatsBlock(p0, 0), row_max_ + p0,
                           row_sum_ + p0);
      for (int64_t r = p0; r < p0 + rows; ++r) FinishStats(r);
    } else {
      tiles_.softmax(rows, Tk, visible, p, Tk, plan_.log2_units);
    }
    const int64_t ldo = out_.row_stride;
    if (keys > 0 && out_.bf16 == nullptr) {
      tiles_.values(rows, keys, dk, p, Tk, values_, plan_.v_panel_stride, /*o_scale=*/nullptr, out_.data + out, ldo);
      return;
    }
    // Nothing visible: zeros; a bf16 output: staged in fp32, then rounded.
    if (keys > 0) tiles_.values(rows, keys, dk, p, Tk, values_, plan_.v_panel_stride, /*o_scale=*/nullptr, acc_, dk);
    for (int64_t r = 0; r < rows; ++r) StoreRow(out + r * ldo, keys > 0 ? acc_ + r * dk : nullptr, 1.0f);
  }

  // The current item's `rows` rows without weights: FlashAttention's online softmax over key blocks, a running max
  // and sum per row and the output accumulator rescaled whenever a row's max grows. Key blocks outside, panels
  // inside: a block of packed K^T and V (256 KiB at 512 keys of head_dim 64) stays in L2 for every panel of the item,
  // where a whole head of a long sequence does not (4 MiB at 8192 keys); each panel still sees its blocks in order,
  // so the result is what a panel at a time would give. `additive` points at the item's first row, `out` is the
  // offset of its first output element.
  void OnlineSoftmaxItem(int64_t rows, const float* additive, int64_t out, RowPrefetch& prefetch) {
    const int64_t dk = s_.heads.head_dim, Tk = s_.kv_len, key_block = plan_.key_block, panel = plan_.panel;
    const int64_t panels = (rows + panel - 1) / panel, keys = PanelKeys(0, rows);
    const int64_t steps = std::max<int64_t>((keys + key_block - 1) / key_block * panels, 1);
    std::fill_n(row_max_, rows, kNegInf);
    std::fill_n(row_sum_, rows, 0.0f);
    int64_t step = 0;
    for (int64_t j0 = 0; j0 < keys; j0 += key_block) {
      for (int64_t p0 = 0; p0 < rows; p0 += panel) {
        prefetch.Until(++step, steps);
        const int64_t panel_rows = std::min(panel, rows - p0), panel_keys = PanelKeys(p0, panel_rows);
        if (j0 >= panel_keys) continue;
        const int64_t n = std::min(key_block, panel_keys - j0);
        // j0 is a multiple of key_block, so of the set's key panel and key multiple.
        tiles_.scores(panel_rows, n, dk, 1.0f, queries_ + p0 * dk, dk, keys_t_ + j0 * dk / tiles_.elements_per_float,
                      scores_, key_block);
        for (int64_t r = 0; r < panel_rows; ++r) {
          block_visible_[r] = std::clamp<int64_t>(visible_[p0 + r] - j0, 0, n);
          if (additive != nullptr) {
            tiles_.add(block_visible_[r], additive + (p0 + r) * Tk + j0, scores_ + r * key_block);
          }
        }
        if (stats_.entropy != nullptr) {
          tiles_.online_softmax_stats(panel_rows, n, block_visible_, scores_, key_block, row_max_ + p0,
                                      row_sum_ + p0, row_factor_, plan_.log2_units, StatsBlock(p0, j0));
        } else {
          tiles_.online_softmax(panel_rows, n, block_visible_, scores_, key_block, row_max_ + p0, row_sum_ + p0,
                                row_factor_, plan_.log2_units);
        }
        // A panel's first block writes its accumulator; later ones rescale it by each row's factor and add.
        tiles_.values(panel_rows, n, dk, scores_, key_block,
                      values_ + j0 * tiles_.value_panel / tiles_.elements_per_float, plan_.v_panel_stride,
                      j0 == 0 ? nullptr : row_factor_, acc_ + p0 * dk, dk);
      }
    }
    prefetch.Until(steps, steps);
    for (int64_t r = 0; r < rows; ++r) {
      // The sum is at least 1 when any key is visible (its max contributes exp(0)), 0 when none is, and NaN
      // when a score overflowed: NaN then reaches the output, as in PyTorch. Every key masked: zero output, never
      // NaN.
      const bool any = row_sum_[r] != 0.0f;
      StoreRow(out + r * out_.row_stride, any ? acc_ + r * dk : nullptr, any ? 1.0f / row_sum_[r] : 0.0f);
      if (stats_.softmax()) FinishStats(r);
    }
  }

  // The statistics' view of the current item's rows from p0 on, for a block of keys from first_key on.
  // (The exact softmax asks for it with lse alone too: its scratch is then the panel's.)
  kernels::SoftmaxStatsBlock StatsBlock(int64_t p0, int64_t first_key) {
    if (stats_acc_ == nullptr) {
      TileScratch& t = ThreadTileScratch();
      stats_acc_ = Grown(t.stats_acc, plan_.row_block * kernels::kStatsPerRow);
      query_pos_ = Grown(t.query_pos, plan_.row_block);
      std::fill_n(query_pos_, plan_.row_block, 0.0f);
    }
    return {first_key, query_pos_ + p0, stats_.sink_tokens, stats_acc_ + p0 * kernels::kStatsPerRow,
            mask_.additive != nullptr};
  }

  // Writes the current item's row r's statistics from its max, sum and accumulators (zeros for lse alone).
  void FinishStats(int64_t r) const {
    const float zeros[kernels::kStatsPerRow] = {};
    const float* acc = stats_.entropy != nullptr ? stats_acc_ + r * kernels::kStatsPerRow : zeros;
    const RowSums sums{row_max_[r], row_sum_[r], acc[0], acc[1], acc[2]};
    WriteRowStats(stats_, stats_row_ + r, sums, plan_.log2_units ? M_LN2 : 1.0);
  }

  const kernels::TileKernels& tiles_;
  const AttentionShape& s_;
  const AttentionMask& mask_;
  const CorePlan& plan_;
  const Packed q_, k_, v_;
  const PackedOut out_;
  float* const weights_;
  const RowStats stats_;
  const int64_t position_shift_;
  float* stats_acc_ = nullptr;  // with entropy asked for, or (lazily) for the exact softmax's lse
  float* query_pos_ = nullptr;
  int64_t stats_row_ = 0;  // the current item's first row in stats_' arrays
  float *row_max_, *row_sum_, *row_factor_, *queries_, *keys_t_, *values_;
  float* scores_ = nullptr;
  float* acc_ = nullptr;
  int64_t *visible_, *block_visible_;
  int64_t packed_kv_ = -1;  // b * Hkv + kv of the KV head in keys_t_ and values_
};

}  // namespace

absl::Status Attend(const kernels::TileKernels& tiles, const AttentionShape& shape, const AttentionMask& mask,
                    Packed q, Packed k, Packed v, PackedOut out, float* weights, const StopSignal* stop,
                    const RowStats& stats, int64_t position_shift) {
  const bool bf16 = q.bf16 != nullptr;
  if ((k.bf16 != nullptr) != bf16 || (v.bf16 != nullptr) != bf16 ||
      ((bf16 || out.bf16 != nullptr) && tiles.elements_per_float != 2)) {
    return absl::InvalidArgumentError(absl::StrCat("Q, K and V must be all fp32 or all bf16, and bf16 (in or out) "
                                                   "only for a bf16 tile set (this one: ", tiles.isa, ")"));
  }
  CorePlan plan = PlanBlocks(tiles, shape, mask, omp_get_max_threads());
  // bf16 inputs are half the bytes, and prefetching them costs more than it saves (docs/DESIGN.md, bf16 attention). A
  // bf16 output comes only with bf16 inputs; the prefetch handles fp32 rows alone.
  if (bf16 || out.bf16 != nullptr) plan.prefetch_next = false;
  std::atomic<int64_t> next_run{0};
  std::atomic<bool> stopped{false};
#pragma omp parallel
  {
    Worker worker(tiles, shape, mask, plan, q, k, v, out, weights, stats, position_shift);
    // Runs of `plan.run` consecutive items are claimed from a shared counter, as schedule(dynamic) would. A thread
    // claims one run ahead, so that while it computes a run it knows the next one and prefetches its inputs.
    int64_t first = next_run.fetch_add(1) * plan.run, item = first, end = std::min(first + plan.run, plan.items);
    int64_t ahead = next_run.fetch_add(1) * plan.run;
    while (item < end) {
      if (stop != nullptr && (stopped.load(std::memory_order_relaxed) || !stop->Check().ok())) {
        stopped = true;
        break;
      }
      RowPrefetch prefetch;
      worker.PrefetchNext(item, item + 1 < end ? item + 1 : ahead, ahead, item - first, end - first, prefetch);
      worker.Run(item, prefetch);
      if (++item == end) {
        first = item = ahead;
        end = std::min(ahead + plan.run, plan.items);
        ahead = next_run.fetch_add(1) * plan.run;
      }
    }
    TileScratch& t = ThreadTileScratch();
    for (ScratchVector<float>* v : {&t.queries, &t.keys_t, &t.values, &t.scores, &t.accumulator}) {
      ReleaseIfLarge(*v, kKeptTileScratchBytes);
    }
  }
  // A stop is final (cancelled, past the deadline, shutting down), so asking again gives its status.
  if (!stopped) return absl::OkStatus();
  absl::Status status = stop->Check();
  return status.ok() ? absl::CancelledError("the computation was stopped") : status;
}

int64_t AttendScratchBytesPerThread(const kernels::TileKernels& tiles, const AttentionShape& shape) {
  AttentionMask no_mask;
  const CorePlan p = PlanBlocks(tiles, shape, no_mask, 1);
  const int64_t dk = shape.heads.head_dim;
  const int64_t floats = 2 * p.row_block * dk + p.kt_size + p.v_size + p.panel * (p.key_block + 1) +
                         (3 + kernels::kStatsPerRow) * p.row_block;
  return floats * static_cast<int64_t>(sizeof(float)) +
         (p.row_block + p.panel) * static_cast<int64_t>(sizeof(int64_t));
}

}  // namespace mha::cpu
