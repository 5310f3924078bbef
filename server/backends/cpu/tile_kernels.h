// Hand-written kernels for the attention core's in-cache tiles: scores S = scale * Q K^T, values O (+)= P V, and
// the softmax between them. Register-blocked: the whole output block stays in registers for the full reduction,
// and K^T and V are read packed in panels (contiguous streams that the prefetchers follow). One body
// (tile_kernels_impl.h) is compiled once per instruction set, each in its own translation unit and namespace, so
// nothing built for AVX-512 can leak into code that runs on an AVX2 CPU; the portable set (GCC vector types,
// baseline x86-64) runs anywhere.
//
// All matrices are row-major fp32 with explicit row strides (in floats). Thread-safe: no state.
//
// The two bf16 sets, "amx" (tile_kernels_amx.cc: AMX-BF16's tile unit) and "avx512bf16"
// (tile_kernels_avx512bf16.cc: AVX512-BF16's dot products, for CPUs without AMX), round their products' operands to
// bf16 (fp32 accumulation), and their packed K^T and V hold bf16 in their own layout (tile_kernels_bf16.h), two per
// float of the buffers below; they are for bf16 requests, whose operands are bf16 on the wire, and only for depths
// and widths that are multiples of their `lanes` (32).
#ifndef MHA_SERVER_BACKENDS_CPU_TILE_KERNELS_H_
#define MHA_SERVER_BACKENDS_CPU_TILE_KERNELS_H_

#include <cstdint>

namespace mha::kernels {

// log2(e): natural-log scores times this are scores in log2 units.
inline constexpr float kLog2e = 1.44269504088896341f;

// The sessions' decode kernels (paged_attention.h), over one KV head's part of a cache block in its layout
// (backend.h's KvCacheLayout) with elements of one cache dtype, into fp32. Register-blocked like the tile kernels,
// with the cache's fp16 or bf16 elements widened to fp32 as they are loaded, so a block is read once from memory.
//
// Each also prefetches `ahead` (the next block's part it will read, `ahead_bytes` of it; null for none) a cache line
// or two per step of its loop, so that the next block streams in from memory while this one computes: a burst of
// prefetches at once fills the line-fill buffers and stalls the core instead.
struct PagedKernels {
  // s[r, j] (row stride lds) = sum over c < depth of q[r, c] (fp32, row stride ldq) * kt[c, j] for r < rows and
  // j < keys, kt a block's K^T (depth rows of ldk elements); keys a multiple of 16. An 8-bit cache's kt is its K
  // part's codes (quantized_cache.h) and key_scales its bf16 scales per channel (null for the other dtypes); its
  // rows at most kQuantizedMaxRows, depth and keys at most kQuantizedMaxElements.
  void (*scores)(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt,
                 int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead,
                 int64_t ahead_bytes);
  // o[r, c] (row stride ldo) = o_scale[r] * o[r, c] + sum over j < keys of p[r, j] (row stride ldp) * v[j, c] for
  // r < rows and c < width, v a block's V (keys rows of width elements); an 8-bit cache's V codes and bf16 scales
  // per token, as for scores.
  void (*values)(int64_t rows, int64_t keys, int64_t width, const float* p, int64_t ldp, const void* v,
                 const uint16_t* value_scales, const float* o_scale, float* o, int64_t ldo, const void* ahead,
                 int64_t ahead_bytes);
  // The same for a prefill tile's many rows (paged_prefill.h): register blocks that serve more rows from each
  // vector of K^T or V they load, as the tile kernels' do (a decode's few rows take the ones above, which keep more
  // chains of accumulation in flight for them).
  void (*prefill_scores)(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt,
                         int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead,
                         int64_t ahead_bytes);
  // prefill_values reads several blocks' V at once (v[b] for b < blocks, each of block_keys keys but the last, of
  // last_keys; key j of block b is p's column b block_keys + j), so that each row's outputs stay in registers
  // across them; an 8-bit cache's value_scales[b] are block b's (null for the other dtypes). The 8-bit caches' take
  // their decode kernels over groups of kQuantizedMaxRows rows, a part at a time.
  void (*prefill_values)(int64_t rows, const void* const* v, const uint16_t* const* value_scales, int64_t blocks,
                         int64_t block_keys, int64_t last_keys, int64_t width, const float* p, int64_t ldp,
                         const float* o_scale, float* o, int64_t ldo, const void* ahead, int64_t ahead_bytes);
};

// Kernel sets per cache dtype, indexed by dtype - 1: FP32, FP16, BF16, INT8, FP8_E4M3, FP8_E5M2.
inline constexpr int kPagedDtypes = 6;
// The 8-bit caches' decode kernels keep per-row buffers on the stack: rows, and depth or block keys, up to these.
inline constexpr int64_t kQuantizedMaxRows = 16, kQuantizedMaxElements = 256;

// The softmax statistics (attention.proto's HeadStats) that online_softmax_stats and softmax_stats keep beside each
// row's max and sum, in the scores' units (natural or log2) and rescaled with the sum, kStatsPerRow floats per row
// r at acc + r * kStatsPerRow, for the weights w_j = weight(s_j - max) of key first_key + j:
//   [0] sum_j w_j (s_j - max)                  (entropy = log(sum) - [0] / sum, in the scores' units)
//   [1] sum_j w_j |query_pos[r] - first_key - j|  (distance = [1] / sum)
//   [2] sum of w_j over keys first_key + j < sink_tokens  (sink mass = [2] / sum)
inline constexpr int kStatsPerRow = 3;
struct SoftmaxStatsBlock {
  int64_t first_key = 0;             // the block's first key, as an index of the whole row
  const float* query_pos = nullptr;  // per row: its query's position among the keys (bottom-right aligned)
  int64_t sink_tokens = 0;
  float* acc = nullptr;  // kStatsPerRow per row
  bool masked = false;   // scores may hold -inf (an additive mask) before each row's visible count
};

struct TileKernels {
  const char* isa;    // "amx", "avx512bf16", "avx512", "avx2" or "portable"
  int lanes;          // floats per vector register
  int key_panel;      // columns per panel of packed K^T
  int value_panel;    // columns per panel of packed V
  int panel_rows;     // rows one register block of either kernel covers: the natural panel height for callers
  int elements_per_float;  // packed K^T and V elements per float of their buffers: 1 (fp32) or 2 (bf16)
  int key_multiple;        // packed V's keys are padded with zero rows up to a multiple of this
  // Keys per block of the online softmax: a panel's scores for one block stay in L1 (512 keys for the panels of up
  // to 12 rows of the fp32 and avx512bf16 sets, 256 for amx's 32), and the block's packed K^T and V in L2. A
  // multiple of key_panel and key_multiple.
  int key_block;

  // Operands packed in panels, so that each register block streams one contiguous run of memory (sizes and
  // offsets below in elements; divide by elements_per_float for floats):
  //  - K^T of n keys k[n, depth] (row stride ldk): ceil(n / key_panel) panels of [depth, key_panel] elements one
  //    after another; columns past n are zero. Panel p starts at kt + p * key_panel * depth.
  //  - V of n keys v[n, width] (row stride ldv): ceil(width / value_panel) panels, panel_stride floats apart, each
  //    [n rounded up to key_multiple, value_panel] elements; columns past width and rows past n are zero. Row j of
  //    panel 0 is at vp + j * value_panel (j a multiple of key_multiple for the bf16 sets).
  void (*pack_keys)(int64_t n, int64_t depth, const float* k, int64_t ldk, float* kt);
  void (*pack_values)(int64_t n, int64_t width, const float* v, int64_t ldv, float* vp, int64_t panel_stride);

  // s[rows, cols] (row stride lds) = scale * q[rows, depth] (stride ldq) * K^T[depth, cols], kt the packed K^T
  // from its first column (a panel start). Nothing at or past `cols` of s is written.
  void (*scores)(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
                 const float* kt, float* s, int64_t lds);

  // o[rows, width] (stride ldo) = p[rows, n] (stride ldp) * V[n, width], vp the packed V from its first row (panels
  // panel_stride floats apart), plus o_scale[r] * o[r, :] for each row r when o_scale is not null (the online
  // softmax's rescaling, fused). Nothing at or past `width` of o is read or written.
  void (*values)(int64_t rows, int64_t n, int64_t width, const float* p, int64_t ldp, const float* vp,
                 int64_t panel_stride, const float* o_scale, float* o, int64_t ldo);

  // Both softmaxes take scores in natural units, or with `log2` in log2 units (kLog2e times the natural ones, the
  // factor folded into the query scale), where each weight is 2^(s - max): FlashAttention 2's trick, which saves
  // two of the thirteen vector operations of a natural exp. Below, weight(x) is e^x or 2^x accordingly.
  //
  // One key block of FlashAttention's online softmax on `rows` rows of scores s[rows, n] (row stride lds): only
  // keys [0, visible[r]) count for row r, the rest of the row is zeroed. row_max and row_sum carry across blocks
  // (start them at -inf and 0); s becomes weight(s - new max) and factor[r] = weight(old max - new max) (0 on a
  // row's first visible block, 1 while nothing is visible), by which the caller rescales that row's output.
  void (*online_softmax)(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, float* row_max,
                         float* row_sum, float* factor, bool log2);

  // Exact softmax of each row of s[rows, n] over keys [0, visible[r]), the rest zeroed (long zero runs with
  // non-temporal stores, so they are not left in the caches); a row with nothing visible (or only -inf) becomes all
  // zeros, never NaN.
  void (*softmax)(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, bool log2);

  // online_softmax, also accumulating `stats` (SoftmaxStatsBlock) for rows whose accumulators start at zero: each
  // row's statistics over all its blocks once the last one is done.
  void (*online_softmax_stats)(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds,
                               float* row_max, float* row_sum, float* factor, bool log2,
                               const SoftmaxStatsBlock& stats);
  // softmax, also writing each row's max, its sum of weights before normalising (0 when nothing is visible) and
  // `stats` over the whole row.
  void (*softmax_stats)(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, bool log2,
                        const SoftmaxStatsBlock& stats, float* row_max, float* row_sum);

  // dst[r, c] = scale * src[r, c] for r < rows and c < cols.
  void (*copy_scaled)(int64_t rows, int64_t cols, float scale, const float* src, int64_t lds, float* dst,
                      int64_t ldd);

  // x[j] += y[j] for j < n (an additive mask onto a row of scores).
  void (*add)(int64_t n, const float* y, float* x);

  // dst[j] = src[j] rounded to bf16 (to nearest even; NaN stays NaN, subnormals become zero) for j < n; null in the
  // sets without bf16 instructions (the bf16 sets have it).
  void (*to_bf16)(int64_t n, const float* src, uint16_t* dst);

  // pack_keys, pack_values and copy_scaled from bf16 sources (strides in elements): a bf16 request's projections
  // and wire tensors, read as they are instead of through an fp32 copy twice their size. Null in the fp32 sets.
  void (*pack_keys_bf16)(int64_t n, int64_t depth, const uint16_t* k, int64_t ldk, float* kt);
  void (*pack_values_bf16)(int64_t n, int64_t width, const uint16_t* v, int64_t ldv, float* vp, int64_t panel_stride);
  void (*copy_scaled_bf16)(int64_t rows, int64_t cols, float scale, const uint16_t* src, int64_t lds, float* dst,
                           int64_t ldd);
  // copy_scaled into bf16 (rounded as to_bf16 rounds): the attention core's output for a bf16 consumer. Null in the
  // fp32 sets.
  void (*copy_scaled_to_bf16)(int64_t rows, int64_t cols, float scale, const float* src, int64_t lds, uint16_t* dst,
                              int64_t ldd);

  // The decode kernels for caches of fp32, fp16 and bf16 (index DataType - 1); the bf16 sets use their fp32 set's
  // for fp32 and fp16, and AVX512-BF16's dot products for bf16 (paged_kernels_avx512bf16.cc).
  const PagedKernels* paged;
};

// The kernels for `isa` ("amx", "avx512bf16", "avx512", "avx2", "portable") if this CPU runs them, else nullptr.
// "avx512bf16" needs AVX512-F, -BW and -BF16; "amx" those and AMX-BF16, and the kernel's permission for this process
// to use the tile state (asked for once).
const TileKernels* TileKernelsFor(const char* isa);

}  // namespace mha::kernels

#endif  // MHA_SERVER_BACKENDS_CPU_TILE_KERNELS_H_
