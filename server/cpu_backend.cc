#include "server/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/softmax_kernels.h"
#include "server/tile_kernels.h"

namespace mha {
namespace {

absl::Status FromDnnlError(const dnnl::error& e, absl::string_view what) {
  return absl::InternalError(absl::StrCat("oneDNN failed in ", what, ": ", e.what(), " (status ",
                                          static_cast<int>(e.status), ")"));
}

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return "unknown CPU";
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(absl::string_view tile_kernels) {
  // Projections go through oneDNN's sgemm; a 1x1x1 product proves the library loads and runs here.
  const float one = 1.0f;
  float out = 0.0f;
  if (dnnl_sgemm('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &out, 1) != dnnl_success || out != 1.0f) {
    return absl::UnavailableError("oneDNN's sgemm does not run on this machine");
  }
  std::vector<const kernels::TileKernels*> tiles;
  if (tile_kernels == "auto") {
    for (const char* isa : {"avx512", "avx2"}) {
      if (const kernels::TileKernels* k = kernels::TileKernelsFor(isa); k != nullptr) tiles.push_back(k);
    }
  } else if (tile_kernels == "avx512" || tile_kernels == "avx2") {
    const kernels::TileKernels* k = kernels::TileKernelsFor(std::string(tile_kernels).c_str());
    if (k == nullptr) {
      return absl::UnavailableError(absl::StrCat("this CPU does not run the ", tile_kernels, " tile kernels"));
    }
    tiles.push_back(k);
  } else if (tile_kernels != "sgemm") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown tile kernels \"", tile_kernels, "\"; expected auto, avx512, avx2 or sgemm"));
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(tiles)));
}

std::string CpuBackend::device() const {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(CpuModelName(), " (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ",
                      tile_kernels_.empty() ? "sgemm" : tile_kernels_.front()->isa, " attention tiles, ",
                      omp_get_max_threads(), " OpenMP threads)");
}

void CpuBackend::Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, const float* bias,
                        int64_t n, float* y, int64_t ldy) {
  // oneDNN's sgemm rather than a matmul primitive: measured here at 2048x1024x3072 it runs at 295 GFLOP/s against
  // 81 for the brgemm matmul primitive (and at least as fast on every projection shape we serve). The bias is
  // broadcast into y first and accumulated with beta = 1.
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * ldy, bias, n * sizeof(float));
  }
  if (dnnl_sgemm('N', 'N', m, n, k, 1.0f, x, ldx, w, n, bias != nullptr ? 1.0f : 0.0f, y, ldy) != dnnl_success) {
    throw dnnl::error(dnnl_runtime_error, "dnnl_sgemm failed in a projection");
  }
}

namespace {

// C[m, n] (row stride ldc) = alpha * A[m, k] op(B) + beta * C, row-major, through oneDNN's JIT sgemm. Inside an
// OpenMP parallel region oneDNN runs it on the calling thread only.
bool Gemm(bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  return dnnl_sgemm('N', transpose_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) == dnnl_success;
}

// Sets the calling thread's OpenMP thread count for a scope (oneDNN reads it when it executes a primitive).
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) { omp_set_num_threads(threads); }
  ~ScopedOmpThreads() { omp_set_num_threads(saved_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  const int saved_;
};

// Requests below this many flops run on the calling thread alone: waking the others costs more than they save
// (tens of microseconds against a budget of that order for a tiny request).
constexpr double kSerialFlops = 8e6;

// Buffers a MultiHeadAttention call reuses from the previous call on the same thread (grown on demand, kept at
// the largest size seen): per thread, so that concurrent calls never share them.
struct CallScratch {
  std::vector<float> projected;  // Q|K|V projections
  std::vector<float> heads;      // concatenated head outputs [B*Tq, H*d_k]
  std::vector<float> fused_w;    // fused Q|K|V weights and bias, when the layer has none precomputed
  std::vector<float> fused_b;
};

CallScratch& ThreadScratch() {
  thread_local CallScratch scratch;
  return scratch;
}

// Per-thread scratch of the attention kernel, sized for one (query block x key block) tile.
struct TileScratch {
  std::vector<float> queries;      // [row_block, d_k], scaled, for the tile kernels
  std::vector<float> keys_t;       // one (batch, kv head) of K^T, packed for the tile kernels
  std::vector<float> values;       // the same of V
  std::vector<float> scores;       // [row_block, key_block]
  std::vector<float> accumulator;  // [row_block, d_k]
  std::vector<float> row_max, row_sum, row_factor;  // [panel]
  std::vector<int64_t> visible, block_visible;      // [panel]: keys each row sees, in all and in this block
};

// Per thread and kept across calls (grown on demand, like CallScratch): allocated in every parallel region, its
// malloc and free showed in a tiny request's profile.
TileScratch& ThreadTileScratch() {
  thread_local TileScratch scratch;
  return scratch;
}

template <typename T>
T* Grown(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

namespace {

// The kernels of one work item (one batch, head and query block), over a panel of its rows: the tile kernels on
// the packed Q, K^T and V, or sgemm on the head-packed tensors in place with the generic softmax row kernels.
struct ItemKernels {
  const kernels::TileKernels* tiles;  // null: sgemm
  int64_t head_dim;
  float scale;
  bool log2_units;           // tiles only: scores in log2 units (see kernels::TileKernels::online_softmax)
  const float* q = nullptr;  // the block's first query; tiles: packed [rows, d_k] and already scaled
  int64_t q_stride = 0;
  const float* k = nullptr;  // tiles: the head's packed K^T; sgemm: the head's first key, rows k_stride apart
  int64_t k_stride = 0;
  const float* v = nullptr;  // tiles: the head's packed V, panels v_stride apart; sgemm: rows v_stride apart
  int64_t v_stride = 0;
  bool ok = true;  // false once an sgemm call failed

  // s[rows, n] (row stride lds) = scale * Q[r0, r0 + rows) K[j0, j0 + n)^T, times log2 e in log2 units.
  void Scores(int64_t r0, int64_t rows, int64_t j0, int64_t n, float* s, int64_t lds) {
    if (tiles != nullptr) {
      tiles->scores(rows, n, head_dim, 1.0f, q + r0 * q_stride, q_stride, k + j0 * head_dim, s, lds);
    } else {
      ok &= Gemm(true, rows, n, head_dim, scale, q + r0 * q_stride, q_stride, k + j0 * k_stride, k_stride, 0.0f,
                 s, lds);
    }
  }

  // o[rows, d_k] (row stride ldo) = p[rows, n] (row stride ldp) V[j0, j0 + n), plus o_scale[r] * o[r, :] for
  // each row r when o_scale is not null.
  void Values(int64_t rows, int64_t j0, int64_t n, const float* p, int64_t ldp, const float* o_scale, float* o,
              int64_t ldo) {
    if (tiles != nullptr) {
      tiles->values(rows, n, head_dim, p, ldp, v + j0 * tiles->value_panel, v_stride, o_scale, o, ldo);
      return;
    }
    if (o_scale != nullptr) {
      for (int64_t r = 0; r < rows; ++r) kernels::Scale(o + r * ldo, head_dim, o_scale[r]);
    }
    ok &= Gemm(false, rows, head_dim, n, 1.0f, p, ldp, v + j0 * v_stride, v_stride, o_scale != nullptr ? 1.0f : 0.0f,
               o, ldo);
  }

  // See kernels::TileKernels::online_softmax.
  void OnlineSoftmax(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, float* row_max,
                     float* row_sum, float* factor) {
    if (tiles != nullptr) {
      tiles->online_softmax(rows, n, visible, s, lds, row_max, row_sum, factor, log2_units);
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s + r * lds;
      std::fill(row + visible[r], row + n, 0.0f);
      const float new_max = std::max(row_max[r], kernels::RowMax(row, visible[r]));
      if (new_max == -std::numeric_limits<float>::infinity()) {  // nothing visible yet
        std::fill(row, row + visible[r], 0.0f);
        factor[r] = 1.0f;
        continue;
      }
      factor[r] = row_max[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(row_max[r] - new_max);
      row_sum[r] = row_sum[r] * factor[r] + kernels::ExpShiftSum(row, visible[r], new_max);
      row_max[r] = new_max;
    }
  }

  // dst[0, n) = scale * src[0, n).
  void CopyScaled(int64_t n, float scale, const float* src, float* dst) {
    if (tiles != nullptr) {
      tiles->copy_scaled(1, n, scale, src, n, dst, n);
    } else {
      for (int64_t c = 0; c < n; ++c) dst[c] = scale * src[c];
    }
  }

  // See kernels::TileKernels::softmax.
  void Softmax(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds) {
    if (tiles != nullptr) {
      tiles->softmax(rows, n, visible, s, lds, log2_units);
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s + r * lds;
      const float max = kernels::RowMax(row, visible[r]);
      if (max == -std::numeric_limits<float>::infinity()) {  // nothing visible: zero weights
        std::fill(row, row + n, 0.0f);
        continue;
      }
      kernels::Scale(row, visible[r], 1.0f / kernels::ExpShiftSum(row, visible[r], max));
      std::fill(row + visible[r], row + n, 0.0f);
    }
  }
};

// Prefetches the inputs of a thread's next work item into L2 while the current one computes, a slice per panel.
// Their head-packed rows are a few cache lines each, thousands of floats apart, a pattern the hardware
// prefetchers do not run ahead on: read on demand (the queries' copy, the K/V packing, the output rows) they took
// 14% of the attention core's time on one thread. Measured in alternating runs on two threads: the core 2-4%
// faster, the (8,512,512,512,8,8) layer 1-3% (prefetching the output rows for writing is about 1% of that, and
// into L2 beat into L1 by 1-2%). On one thread it gains nothing: the prefetches stall about as long as the loads.
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

}  // namespace

void CpuBackend::Attend(const AttentionDims& d, const AttentionMask& mask, Packed q, Packed k, Packed v,
                        float* out, int64_t out_stride, float* weights) {
  const int64_t B = d.batch, Tq = d.q_len, Tk = d.kv_len, H = d.num_heads, Hkv = d.num_kv_heads,
                G = d.group_size(), dk = d.head_dim;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const kernels::TileKernels* tiles = nullptr;  // the first kernels whose vector width divides d_k
  for (const kernels::TileKernels* candidate : tile_kernels_) {
    if (dk % candidate->lanes == 0) {
      tiles = candidate;
      break;
    }
  }
  const int64_t query_blocks = (Tq + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = B * H * query_blocks;
  const int64_t row_block = std::min(kQueryBlock, Tq);
  // Rows per panel: the tile kernels take a few rows at a time so that each panel's scores stay in L1 from the
  // score matmul through the softmax to the value matmul; sgemm takes the whole block.
  const int64_t panel = tiles != nullptr ? std::min<int64_t>(tiles->panel_rows, row_block) : row_block;
  const int64_t key_block = std::min(tiles != nullptr ? kTileKeyBlock : kKeyBlock, Tk);
  // The tile kernels take scores in log2 units when they can (folding log2 e into the query scale saves two of the
  // thirteen operations of each exp), but not with an additive mask or a scale above FLT_MAX / log2 e: a finite
  // mask value such as the lowest float (PyTorch's usual mask) would overflow to -inf in log2 units, and a row
  // masked by it alone would get zero weights instead of the reference's (and PyTorch's) uniform ones.
  const bool log2_units =
      tiles != nullptr && mask.additive == nullptr && std::isfinite(d.scale * kernels::kLog2e);
  const float q_scale = log2_units ? d.scale * kernels::kLog2e : d.scale;

  // The tile kernels read K^T and V packed in panels (tile_kernels.h). Each thread packs the (batch, kv head) of its
  // current item into its own buffers, in its L2, and keeps it for the following items of the same kv head (every
  // query head of the group, every query block): items are ordered so, and handed out in runs. Read in place
  // through the head-packed row stride instead, consecutive rows would fall into a handful of L1 sets (rows
  // 3 * 512 floats apart all map to two of them) and evict each other.
  int64_t kt_size = 0, v_panel_stride = 0, v_size = 0;
  if (tiles != nullptr) {
    kt_size = (Tk + tiles->key_panel - 1) / tiles->key_panel * tiles->key_panel * dk;
    v_panel_stride = Tk * tiles->value_panel;
    v_size = (dk + tiles->value_panel - 1) / tiles->value_panel * v_panel_stride;
  }
  const int64_t run = std::clamp<int64_t>(items / (4 * omp_get_max_threads()), 1, G * query_blocks);
  std::atomic<int64_t> next_run{0};
  // Prefetching pays only when the inputs are not already cached: under 1 MiB (a tiny request) it cost 5%.
  const bool prefetch_next = (B * Tq * H + 2 * B * Tk * Hkv) * dk * static_cast<int64_t>(sizeof(float)) > (1 << 20);
  std::atomic<bool> failed{false};

  // One parallel region over (batch, head, query block); each item runs on one thread, tiles stay in its cache.
#pragma omp parallel
  {
    // Sized to the problem, not the tile constants, so a short sequence with a huge head_dim stays small.
    TileScratch& t = ThreadTileScratch();
    float* const row_max = Grown(t.row_max, panel);
    float* const row_sum = Grown(t.row_sum, panel);
    float* const row_factor = Grown(t.row_factor, panel);
    int64_t* const visible = Grown(t.visible, panel);  // keys each row of the panel sees
    int64_t* const block_visible = Grown(t.block_visible, panel);
    float* const queries = tiles != nullptr ? Grown(t.queries, row_block * dk) : nullptr;
    float* const keys_t = tiles != nullptr ? Grown(t.keys_t, kt_size) : nullptr;
    float* const values = tiles != nullptr ? Grown(t.values, v_size) : nullptr;
    float* const scores = weights == nullptr ? Grown(t.scores, panel * key_block) : nullptr;
    float* const acc = weights == nullptr ? Grown(t.accumulator, panel * dk) : nullptr;
    int64_t packed_kv = -1;  // the (batch, kv head) in keys_t and values
    // Runs of `run` consecutive items are claimed from a shared counter, as schedule(dynamic) would (another
    // tenant's load can slow one thread). A thread claims one run ahead, so that while it computes a run it knows
    // the next one and prefetches its inputs: each item the next item's queries and output rows, and a share of
    // the next run's K and V.
    int64_t first = next_run.fetch_add(1) * run, item = first, end = std::min(first + run, items);
    int64_t ahead = next_run.fetch_add(1) * run;
    while (item < end) {
      const int64_t next = item + 1 < end ? item + 1 : ahead;
      const int64_t b = item / (H * query_blocks), h = (item / query_blocks) % H;
      const int64_t i0 = (item % query_blocks) * kQueryBlock, rows = std::min(kQueryBlock, Tq - i0);
      RowPrefetch prefetch;
      if (prefetch_next && next < items) {
        const int64_t nb = next / (H * query_blocks), nh = (next / query_blocks) % H;
        const int64_t ni0 = (next % query_blocks) * kQueryBlock, nrows = std::min(kQueryBlock, Tq - ni0);
        prefetch.Add(q.data + (nb * Tq + ni0) * q.row_stride + nh * dk, nrows, q.row_stride, dk);
        prefetch.Add(out + (nb * Tq + ni0) * out_stride + nh * dk, nrows, out_stride, dk, /*write=*/true);
      }
      if (prefetch_next && ahead < items) {
        const int64_t ab = ahead / (H * query_blocks), ah = (ahead / query_blocks) % H;
        if (ab * Hkv + ah / G != b * Hkv + h / G) {
          const int64_t share = end - first, j = item - first;
          const int64_t k0 = Tk * j / share, k1 = Tk * (j + 1) / share;
          prefetch.Add(k.data + (ab * Tk + k0) * k.row_stride + (ah / G) * dk, k1 - k0, k.row_stride, dk);
          prefetch.Add(v.data + (ab * Tk + k0) * v.row_stride + (ah / G) * dk, k1 - k0, v.row_stride, dk);
        }
      }
      const int64_t panels = (rows + panel - 1) / panel;
      const float* q_tile = q.data + (b * Tq + i0) * q.row_stride + h * dk;
      float* out_tile = out + (b * Tq + i0) * out_stride + h * dk;
      const float* additive =
          mask.additive == nullptr ? nullptr
                                   : mask.additive + (mask.additive_per_batch ? b * Tq * Tk : 0) + i0 * Tk;
      ItemKernels mm{tiles, dk, d.scale, log2_units};
      if (tiles != nullptr) {
        tiles->copy_scaled(rows, dk, q_scale, q_tile, q.row_stride, queries, dk);  // dense and scaled
        const int64_t kv = b * Hkv + h / G;
        if (kv != packed_kv) {
          tiles->pack_keys(Tk, dk, k.data + b * Tk * k.row_stride + (h / G) * dk, k.row_stride, keys_t);
          tiles->pack_values(Tk, dk, v.data + b * Tk * v.row_stride + (h / G) * dk, v.row_stride, values,
                             v_panel_stride);
          packed_kv = kv;
        }
        mm.q = queries;
        mm.q_stride = dk;
        mm.k = keys_t;
        mm.v = values;
        mm.v_stride = v_panel_stride;
      } else {
        mm.q = q_tile;
        mm.q_stride = q.row_stride;
        mm.k = k.data + b * Tk * k.row_stride + (h / G) * dk;
        mm.k_stride = k.row_stride;
        mm.v = v.data + b * Tk * v.row_stride + (h / G) * dk;
        mm.v_stride = v.row_stride;
      }

      for (int64_t p0 = 0; p0 < rows; p0 += panel) {
        const int64_t panel_rows = std::min(panel, rows - p0);
        prefetch.Until(p0 / panel + 1, panels);
        for (int64_t r = 0; r < panel_rows; ++r) visible[r] = VisibleKeyCount(d, mask, b, i0 + p0 + r);
        // Keys at or past `keys` are invisible to every row of the panel (visible counts grow with the row).
        const int64_t keys = *std::max_element(visible, visible + panel_rows);
        float* out_panel = out_tile + p0 * out_stride;
        if (weights != nullptr) {
          // Exact softmax over whole rows, computed in place in the returned weights [B, H, Tq, Tk].
          float* p = weights + ((b * H + h) * Tq + i0 + p0) * Tk;
          if (keys > 0) mm.Scores(p0, panel_rows, 0, keys, p, Tk);
          if (additive != nullptr) {
            for (int64_t r = 0; r < panel_rows; ++r) kernels::Add(p + r * Tk, additive + (p0 + r) * Tk, visible[r]);
          }
          mm.Softmax(panel_rows, Tk, visible, p, Tk);
          if (keys > 0) {
            mm.Values(panel_rows, 0, keys, p, Tk, /*o_scale=*/nullptr, out_panel, out_stride);
          } else {
            for (int64_t r = 0; r < panel_rows; ++r) std::fill_n(out_panel + r * out_stride, dk, 0.0f);
          }
          continue;
        }
        // Online softmax over key blocks (FlashAttention's recurrence): running max m, running sum l, and the
        // output accumulator rescaled by exp(m_old - m_new) whenever a row's max grows.
        std::fill_n(row_max, panel_rows, kNegInf);
        std::fill_n(row_sum, panel_rows, 0.0f);
        for (int64_t j0 = 0; j0 < keys; j0 += key_block) {
          const int64_t n = std::min(key_block, keys - j0);
          float* s = scores;
          mm.Scores(p0, panel_rows, j0, n, s, key_block);
          for (int64_t r = 0; r < panel_rows; ++r) {
            block_visible[r] = std::clamp<int64_t>(visible[r] - j0, 0, n);
            if (additive != nullptr) kernels::Add(s + r * key_block, additive + (p0 + r) * Tk + j0, block_visible[r]);
          }
          mm.OnlineSoftmax(panel_rows, n, block_visible, s, key_block, row_max, row_sum, row_factor);
          // The first block writes the accumulator; later ones rescale it by each row's factor and add.
          mm.Values(panel_rows, j0, n, s, key_block, j0 == 0 ? nullptr : row_factor, acc, dk);
        }
        for (int64_t r = 0; r < panel_rows; ++r) {
          float* dst = out_panel + r * out_stride;
          const float sum = row_sum[r];
          if (sum > 0.0f) {
            mm.CopyScaled(dk, 1.0f / sum, acc + r * dk, dst);
          } else {
            std::fill_n(dst, dk, 0.0f);  // every key masked: zero output, never NaN
          }
        }
      }
      if (!mm.ok) failed = true;
      if (++item == end) {
        first = item = ahead;
        end = std::min(ahead + run, items);
        ahead = next_run.fetch_add(1) * run;
      }
    }
  }
  if (failed) throw dnnl::error(dnnl_runtime_error, "dnnl_sgemm failed in the attention kernel");
}

absl::Status CpuBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionDims& d = a.dims;
  const double flops = RequestFlops(d, /*d_model=*/0, 0, 0);
  ScopedOmpThreads threads(flops < kSerialFlops ? 1 : omp_get_max_threads());
  try {
    Attend(d, a.mask, {a.q, d.num_heads * d.head_dim}, {a.k, d.num_kv_heads * d.head_dim},
           {a.v, d.num_kv_heads * d.head_dim}, a.out, d.num_heads * d.head_dim, a.weights);
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, "scaled dot-product attention");
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionDims& d = a.dims;
  const LayerWeights& w = a.weights;
  const int64_t q_width = d.num_heads * d.head_dim, kv_width = d.num_kv_heads * d.head_dim;
  const int64_t q_rows = d.batch * d.q_len, kv_rows = d.batch * d.kv_len;
  const double flops = RequestFlops(d, w.d_model, w.d_kv_in, w.d_v_in);
  ScopedOmpThreads threads(flops < kSerialFlops ? 1 : omp_get_max_threads());
  CallScratch& scratch = ThreadScratch();
  try {
    Packed q, k, v;
    if (a.self_attention) {
      // One matmul projects Q|K|V; each is then read in place through the row stride of the fused output.
      const int64_t width = q_width + 2 * kv_width;
      const float* w_qkv = w.w_qkv;
      const float* b_qkv = w.b_qkv;
      if (w_qkv == nullptr) {
        FuseQkvProjection(w, q_width, kv_width, &scratch.fused_w, &scratch.fused_b);
        w_qkv = scratch.fused_w.data();
        b_qkv = scratch.fused_b.empty() ? nullptr : scratch.fused_b.data();
      }
      if (static_cast<int64_t>(scratch.projected.size()) < q_rows * width) scratch.projected.resize(q_rows * width);
      Linear(a.query, q_rows, w.d_model, w.d_model, w_qkv, b_qkv, width, scratch.projected.data(), width);
      q = {scratch.projected.data(), width};
      k = {scratch.projected.data() + q_width, width};
      v = {scratch.projected.data() + q_width + kv_width, width};
    } else {
      const int64_t total = q_rows * q_width + 2 * kv_rows * kv_width;
      if (static_cast<int64_t>(scratch.projected.size()) < total) scratch.projected.resize(total);
      float* qp = scratch.projected.data();
      float* kp = qp + q_rows * q_width;
      float* vp = kp + kv_rows * kv_width;
      Linear(a.query, q_rows, w.d_model, w.d_model, w.w_q, w.b_q, q_width, qp, q_width);
      Linear(a.key, kv_rows, w.d_kv_in, w.d_kv_in, w.w_k, w.b_k, kv_width, kp, kv_width);
      Linear(a.value, kv_rows, w.d_v_in, w.d_v_in, w.w_v, w.b_v, kv_width, vp, kv_width);
      q = {qp, q_width};
      k = {kp, kv_width};
      v = {vp, kv_width};
    }

    if (static_cast<int64_t>(scratch.heads.size()) < q_rows * q_width) scratch.heads.resize(q_rows * q_width);
    Attend(d, a.mask, q, k, v, scratch.heads.data(), q_width, a.attention_weights);

    if (!a.head_mask.empty()) {
      float* heads = scratch.heads.data();
      const int64_t H = d.num_heads, dk = d.head_dim;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < q_rows; ++r) {
        for (int64_t h = 0; h < H; ++h) {
          const float factor = a.head_mask[h];
          for (int64_t c = 0; c < dk; ++c) heads[r * q_width + h * dk + c] *= factor;
        }
      }
    }
    Linear(scratch.heads.data(), q_rows, q_width, q_width, w.w_o, w.b_o, w.d_model, a.out, w.d_model);
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, "multi-head attention");
  }
  return absl::OkStatus();
}

}  // namespace mha
