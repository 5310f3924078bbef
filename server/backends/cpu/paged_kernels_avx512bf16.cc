// The decode kernels for bf16 caches, and for FP8 caches read as bf16 as they are loaded (Fp8 below), on
// AVX512-BF16's dot products (compiled with -mavx512f -mavx512bw -mavx512dq -mavx512bf16; used by the avx512bf16 and
// amx sets, whose CPUs have the instructions).
//
// Why: a bf16 cache carries twice the elements per byte of an fp32 one, and widening each to fp32 for an FMA made
// the decode compute-bound before it was memory-bound (G = 4 query rows per KV head: four FMA lanes per element).
// vdpbf16ps adds two products to each fp32 lane, so one instruction covers two elements per lane, read as they are
// stored. The operands it pairs must lie in one 32-bit lane: two adjacent rows of a block's K^T (two depths of one
// key) or of its V (two keys of one column) are interleaved word by word (vpunpck{l,h}wd), which orders the lanes
// [0-3 8-11 16-19 24-27] and [4-7 12-15 20-23 28-31] of the 32 keys or columns; the accumulators are put back in
// order once per register block. The cache's layout is the fp32 kernels' (backend.h's KvCacheLayout).
//
// Precision: q (already scaled) and the weights p are rounded to bf16 (to nearest even), as the avx512bf16 set's
// stateless bf16 products round theirs; the sums stay fp32. Depths or keys beyond kMaxElements take the
// avx512 set's kernels, which widen to fp32 exactly.
#include <immintrin.h>

#include <cstdint>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels {
namespace avx512 {
extern const PagedKernels kPagedKernels[kPagedDtypes];
}

namespace avx512bf16 {
namespace {

#include "server/backends/cpu/bf16_convert.h"          // Mask, ToBf16
#include "server/backends/cpu/paged_kernels_common.h"  // Ahead, WithRows

#define MHA_UNROLL _Pragma("GCC unroll 16")

// q's depths or p's keys in bf16, held in a stack buffer per row: head_dim or block keys up to 1024.
constexpr int64_t kMaxElements = 1024;
// Register blocks: up to 8 rows of 32 keys (16 accumulators) for scores; up to 4 rows of 64 columns for values.
constexpr int kScoreRows = 8, kValueRows = 4, kValueChunks = 2;
constexpr int64_t kPanel = 32 * kValueChunks;  // the columns of a values register block

__m512bh AsPairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// An FP8 cache's codes (E4M3 or E5M2), which the kernels below read as bf16: a code's exponent and mantissa bits
// placed in bf16's read 2^-120 (E4M3) or 2^-112 (E5M2) of its value (the callers fold that into the scales). Exact
// but for FP8's subnormal codes, which vdpbf16ps reads as zero: under 2^-6 of a code unit, a 28672th of the
// channel's or token's largest value (E4M3). Where that factor would carry q or the weights past fp32's range (E4M3:
// keys of thousands against a large q, values from 57344), the block takes the widening kernels (ScaledRowsFit).
template <bool kE4m3>
struct Fp8 {
  uint8_t bits;
};

// 32 elements as bf16 words (the first `mask` of them; the rest zero).
inline __m512i Words32(const uint16_t* p, __mmask32 mask) { return _mm512_maskz_loadu_epi16(mask, p); }
// Sign-extended to 16 bits and shifted, a code's sign lands in bf16's sign and the bits above its exponent, which
// one mask clears: three instructions per 32 codes.
template <bool kE4m3>
inline __m512i Words32(const Fp8<kE4m3>* p, __mmask32 mask) {
  const __m256i codes = mask == 0xffffffffu ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                            : _mm512_castsi512_si256(_mm512_maskz_loadu_epi8(mask, p));
  const __m512i x = _mm512_slli_epi16(_mm512_cvtepi8_epi16(codes), kE4m3 ? 4 : 5);
  return _mm512_and_si512(x, _mm512_set1_epi16(static_cast<int16_t>(kE4m3 ? 0x87f0 : 0x8fe0)));
}

// Two rows of 32 elements (the first `mask` of each; `b` null: zero) interleaved into 16 bf16 pairs each.
template <typename E>
inline void LoadPairs(const E* a, const E* b, __mmask32 mask, __m512i* lo, __m512i* hi) {
  const __m512i x = Words32(a, mask);
  const __m512i y = b == nullptr ? _mm512_setzero_si512() : Words32(b, mask);
  *lo = _mm512_unpacklo_epi16(x, y);
  *hi = _mm512_unpackhi_epi16(x, y);
}

// The unpacked order back to the memory's: 32 fp32 sums, lanes of `lo` and `hi` as LoadPairs leaves them, into
// elements 0..15 (*first) and 16..31 (*second).
inline void InOrder(__m512 lo, __m512 hi, __m512* first, __m512* second) {
  // Element e of 0..31 sits in 128-bit lane e / 8 of lo (e % 8 < 4) or hi, at position e % 4 of that lane.
  const __m512i to_first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i to_second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  *first = _mm512_permutex2var_ps(lo, to_first, hi);
  *second = _mm512_permutex2var_ps(lo, to_second, hi);
}

inline __mmask32 Words(int64_t n) {
  return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : static_cast<__mmask32>((1ull << n) - 1);
}

// Pair m of a row ToBf16 wrote: its elements 2m (low half) and 2m + 1, broadcast to every lane.
inline __m512bh PairAt(const uint16_t* row, int64_t m) {
  int32_t pair;
  __builtin_memcpy(&pair, row + 2 * m, sizeof(pair));
  return AsPairs(_mm512_set1_epi32(pair));
}

// Depth pairs apart in this many sets of accumulators: independent chains, 16 accumulators in all.
constexpr int SetsFor(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

// kRows rows of scores for the (up to) 32 keys at kt, from the rows' q in bf16 (qb, kMaxElements apart).
template <int kRows, typename E>
void ScoreBlock(int64_t depth, const uint16_t* qb, const E* kt, int64_t ldk, int64_t keys, float* s, int64_t lds,
                Ahead& ahead) {
  constexpr int kSets = SetsFor(kRows);
  __m512 acc[kSets][kRows][2];
  MHA_UNROLL for (int h = 0; h < kSets; ++h) {
    MHA_UNROLL for (int r = 0; r < kRows; ++r) acc[h][r][0] = acc[h][r][1] = _mm512_setzero_ps();
  }
  const __mmask32 mask = Words(keys);
  const int64_t pairs = (depth + 1) / 2;
  int64_t m = 0;
  for (; m + kSets <= pairs; m += kSets) {
    ahead.Step();
    MHA_UNROLL for (int h = 0; h < kSets; ++h) {
      const int64_t c = 2 * (m + h);
      __m512i lo, hi;
      LoadPairs(kt + c * ldk, c + 1 < depth ? kt + (c + 1) * ldk : nullptr, mask, &lo, &hi);
      MHA_UNROLL for (int r = 0; r < kRows; ++r) {
        const __m512bh q = PairAt(qb + r * kMaxElements, m + h);
        acc[h][r][0] = _mm512_dpbf16_ps(acc[h][r][0], q, AsPairs(lo));
        acc[h][r][1] = _mm512_dpbf16_ps(acc[h][r][1], q, AsPairs(hi));
      }
    }
  }
  for (; m < pairs; ++m) {
    const int64_t c = 2 * m;
    __m512i lo, hi;
    LoadPairs(kt + c * ldk, c + 1 < depth ? kt + (c + 1) * ldk : nullptr, mask, &lo, &hi);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const __m512bh q = PairAt(qb + r * kMaxElements, m);
      acc[0][r][0] = _mm512_dpbf16_ps(acc[0][r][0], q, AsPairs(lo));
      acc[0][r][1] = _mm512_dpbf16_ps(acc[0][r][1], q, AsPairs(hi));
    }
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    __m512 lo = acc[0][r][0], hi = acc[0][r][1];
    MHA_UNROLL for (int h = 1; h < kSets; ++h) {
      lo = _mm512_add_ps(lo, acc[h][r][0]);
      hi = _mm512_add_ps(hi, acc[h][r][1]);
    }
    __m512 first, second;
    InOrder(lo, hi, &first, &second);
    _mm512_mask_storeu_ps(s + r * lds, Mask(keys), first);
    _mm512_mask_storeu_ps(s + r * lds + 16, Mask(keys - 16), second);
  }
}

// The AVX-512 set's kernels for the same cache (by cache dtype - 1: BF16, FP8_E4M3, FP8_E5M2), which widen to fp32
// exactly: where these kernels' stack buffers are too small.
constexpr int FallbackIndex(const uint16_t*) { return 2; }
constexpr int FallbackIndex(const Fp8<true>*) { return 4; }
constexpr int FallbackIndex(const Fp8<false>*) { return 5; }

// Scores of the (up to) kScoreRows rows at qb (bf16, kMaxElements apart) against the K^T at kt.
template <typename E>
void RowGroupScores(int64_t height, int64_t keys, int64_t depth, const uint16_t* qb, const E* kt, int64_t ldk,
                    float* s, int64_t lds, Ahead& ahead) {
  for (int64_t j = 0; j < keys; j += 32) {
    WithRows<kScoreRows>(height, [&](auto block) {
      ScoreBlock<decltype(block)::kValue>(depth, qb, kt + j, ldk, keys - j, s + j, lds, ahead);
    });
  }
}

// The prefetches of a scores kernel's `rows` rows over a K^T of `keys` x `depth` (at `here`, or null: none of it
// into L1): spread over its steps.
Ahead ScoresAhead(int64_t rows, int64_t keys, int64_t depth, const void* ahead_bytes, int64_t ahead_size,
                  const void* here = nullptr) {
  const int64_t row_blocks = (rows + kScoreRows - 1) / kScoreRows;
  const int64_t sets = SetsFor(rows < kScoreRows ? rows : kScoreRows);
  return Ahead(ahead_bytes, ahead_size, (keys + 31) / 32 * row_blocks * ((depth + 1) / 2) / sets, here);
}

// PagedKernels::scores for a K^T of bf16.
template <typename E>
void ScoresOf(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
              int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
              int64_t ahead_size) {
  const E* kt = static_cast<const E*>(kt_bytes);
  if (depth > kMaxElements) {
    avx512::kPagedKernels[FallbackIndex(kt)].scores(rows, keys, depth, q, ldq, kt_bytes, ldk, key_scales, s, lds,
                                                   ahead_bytes, ahead_size);
    return;
  }
  alignas(64) uint16_t qb[kScoreRows * kMaxElements];
  Ahead ahead = ScoresAhead(rows, keys, depth, ahead_bytes, ahead_size, kt_bytes);
  for (int64_t i = 0; i < rows; i += kScoreRows) {
    const int64_t height = rows - i < kScoreRows ? rows - i : kScoreRows;
    for (int64_t r = 0; r < height; ++r) {
      ToBf16(q + (i + r) * ldq, depth, (depth + 31) / 32 * 32, 1.0f, qb + r * kMaxElements);
    }
    RowGroupScores(height, keys, depth, qb, kt, ldk, s + i * lds, lds, ahead);
  }
}

// The V parts a values kernel reads (tile_kernels.h's prefill_values): `blocks` parts of block_keys keys each but the
// last, of last_keys; columns from `column` on.
template <typename E>
struct ValueParts {
  const void* const* parts;
  int64_t blocks, block_keys, last_keys, column;
  const E* Part(int64_t b) const { return static_cast<const E*>(parts[b]) + column; }
  int64_t Keys(int64_t b) const { return b + 1 < blocks ? block_keys : last_keys; }
};

// kRows rows of (up to) 64 columns of o (`width` left from the parts' column): o_scale o + p V over every part, from
// the rows' p in bf16 (pb, kMaxElements apart; part b's keys from column b block_keys), each part's rows of ldv.
template <int kRows, typename E>
void ValueBlock(const ValueParts<E>& v, const uint16_t* pb, int64_t ldv, int64_t width, const float* o_scale,
                float* o, int64_t ldo, Ahead& ahead) {
  __m512 acc[kRows][kValueChunks][2];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    MHA_UNROLL for (int x = 0; x < kValueChunks; ++x) acc[r][x][0] = acc[r][x][1] = _mm512_setzero_ps();
  }
  const __mmask32 masks[kValueChunks] = {Words(width), Words(width - 32)};
  for (int64_t part = 0; part < v.blocks; ++part) {
    const E* rows = v.Part(part);
    const int64_t keys = v.Keys(part), first_pair = part * v.block_keys / 2;  // block_keys is even
    for (int64_t m = 0; m < (keys + 1) / 2; ++m) {
      ahead.Step();
      const int64_t j = 2 * m;
      __m512i lo[kValueChunks], hi[kValueChunks];
      MHA_UNROLL for (int x = 0; x < kValueChunks; ++x) {
        LoadPairs(rows + j * ldv + 32 * x, j + 1 < keys ? rows + (j + 1) * ldv + 32 * x : nullptr, masks[x], &lo[x],
                  &hi[x]);
      }
      MHA_UNROLL for (int r = 0; r < kRows; ++r) {
        const __m512bh p = PairAt(pb + r * kMaxElements, first_pair + m);
        MHA_UNROLL for (int x = 0; x < kValueChunks; ++x) {
          acc[r][x][0] = _mm512_dpbf16_ps(acc[r][x][0], p, AsPairs(lo[x]));
          acc[r][x][1] = _mm512_dpbf16_ps(acc[r][x][1], p, AsPairs(hi[x]));
        }
      }
    }
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    const __m512 factor = _mm512_set1_ps(o_scale != nullptr ? o_scale[r] : 1.0f);
    MHA_UNROLL for (int x = 0; x < kValueChunks; ++x) {
      __m512 sums[2];
      InOrder(acc[r][x][0], acc[r][x][1], &sums[0], &sums[1]);
      MHA_UNROLL for (int half = 0; half < 2; ++half) {
        const int64_t column = 32 * x + 16 * half;
        const __mmask16 live = Mask(width - column);
        float* out = o + r * ldo + column;
        _mm512_mask_storeu_ps(out, live, _mm512_fmadd_ps(factor, _mm512_maskz_loadu_ps(live, out), sums[half]));
      }
    }
  }
}

// o = o_scale o + p V for the (up to) kValueRows rows at pb (bf16, kMaxElements apart), every panel of columns.
template <typename E>
void RowGroupValues(int64_t height, const void* const* parts, int64_t blocks, int64_t block_keys, int64_t last_keys,
                    int64_t width, const uint16_t* pb, const float* o_scale, float* o, int64_t ldo, Ahead& ahead) {
  for (int64_t c = 0; c < width; c += kPanel) {
    const ValueParts<E> v{parts, blocks, block_keys, last_keys, c};
    WithRows<kValueRows>(height, [&](auto block) {
      ValueBlock<decltype(block)::kValue>(v, pb, width, width - c, o_scale, o + c, ldo, ahead);
    });
  }
}

// The prefetches of a values kernel's `rows` rows over `keys` x `width` values (at `here`, as ScoresAhead's): spread
// over its steps.
Ahead ValuesAhead(int64_t rows, int64_t keys, int64_t width, const void* ahead_bytes, int64_t ahead_size,
                  const void* here = nullptr) {
  const int64_t row_blocks = (rows + kValueRows - 1) / kValueRows;
  return Ahead(ahead_bytes, ahead_size, (keys + 1) / 2 * ((width + kPanel - 1) / kPanel) * row_blocks, here);
}

// PagedKernels::prefill_values for bf16 V parts (and ::values, one part).
template <typename E>
void ValuesOverPartsOf(int64_t rows, const void* const* parts, const uint16_t* const* value_scales, int64_t blocks,
                       int64_t block_keys, int64_t last_keys, int64_t width, const float* p, int64_t ldp,
                       const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes, int64_t ahead_size) {
  const int64_t keys = (blocks - 1) * block_keys + last_keys;
  if (keys > kMaxElements || (blocks > 1 && block_keys % 2 != 0)) {
    avx512::kPagedKernels[FallbackIndex(static_cast<const E*>(nullptr))].prefill_values(
        rows, parts, value_scales, blocks, block_keys, last_keys, width, p, ldp, o_scale, o, ldo, ahead_bytes,
        ahead_size);
    return;
  }
  alignas(64) uint16_t pb[kValueRows * kMaxElements];
  Ahead ahead = ValuesAhead(rows, keys, width, ahead_bytes, ahead_size, blocks == 1 ? parts[0] : nullptr);
  for (int64_t i = 0; i < rows; i += kValueRows) {
    const int64_t height = rows - i < kValueRows ? rows - i : kValueRows;
    for (int64_t r = 0; r < height; ++r) {
      ToBf16(p + (i + r) * ldp, keys, (keys + 31) / 32 * 32, 1.0f, pb + r * kMaxElements);
    }
    RowGroupValues<E>(height, parts, blocks, block_keys, last_keys, width, pb,
                      o_scale == nullptr ? nullptr : o_scale + i, o + i * ldo, ldo, ahead);
  }
}

// PagedKernels::values for a bf16 V.
template <typename E>
void ValuesOf(int64_t rows, int64_t keys, int64_t width, const float* p, int64_t ldp, const void* v_bytes,
              const uint16_t* value_scales, const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes,
              int64_t ahead_size) {
  if (keys > kMaxElements) {
    avx512::kPagedKernels[FallbackIndex(static_cast<const E*>(nullptr))].values(
        rows, keys, width, p, ldp, v_bytes, value_scales, o_scale, o, ldo, ahead_bytes, ahead_size);
    return;
  }
  ValuesOverPartsOf<E>(rows, &v_bytes, nullptr, 1, keys, keys, width, p, ldp, o_scale, o, ldo, ahead_bytes,
                       ahead_size);
}

template <bool kE4m3>
constexpr float kFp8Unit = kE4m3 ? 0x1p120f : 0x1p112f;  // Fp8's codes read as bf16 are this much short

// out[c] = the bf16 scale[c] times `unit` as fp32 for c < n (then zeros up to a multiple of 16): a block's scales,
// widened once for all its rows.
void WidenScales(const uint16_t* scale, int64_t n, float unit, float* out) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = Mask(n - c);
    const __m512i words = _mm512_maskz_loadu_epi16(static_cast<__mmask32>(m), scale + c);
    const __m512i bits = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
    _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), _mm512_set1_ps(unit)));
  }
}

// Each row of x[rows, n] (stride ldx) times the widened scales (WidenScales), rounded to bf16 into out (rows
// kMaxElements apart, zero from n to the next multiple of 32); whether every product stays below 2^127, so that its
// products with the codes stay finite. With kFp8Unit folded in, q times a key scale (or a weight times a value
// scale) of 2^7 or more (E4M3; 2^15, E5M2) does not: for E4M3 a channel's keys of 57344 / q and more, a token's
// values of 57344 and more. Such blocks take the widening kernels instead. NaN products are not counted.
bool ScaledRowsFit(int64_t rows, const float* x, int64_t ldx, const float* scale, int64_t n, uint16_t* out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < n; c += 32) {
      // Both factors loaded under the mask: past n, zero times zero.
      const __mmask16 m0 = Mask(n - c), m1 = Mask(n - c - 16);
      const float* row = x + r * ldx + c;
      const __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, row), _mm512_maskz_loadu_ps(m0, scale + c));
      const __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, row + 16), _mm512_maskz_loadu_ps(m1, scale + c + 16));
      amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_max_ps(_mm512_abs_ps(hi), amax));
      _mm512_storeu_si512(out + r * kMaxElements + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  // Every lane against the bound (_mm512_reduce_max_ps here drew GCC 12's false "used uninitialized" warning).
  return _mm512_cmp_ps_mask(amax, _mm512_set1_ps(0x1p127f), _CMP_LT_OQ) == 0xffff;
}

// ScaledRowsFit for n = 32 kChunks, the bf16 scales times `unit` widened into registers once for all rows (a part's
// q or weights, scaled once per part: through the loops above this cost an FP8 part about a tenth of its time). The
// largest product by vrangeps (the larger magnitude of two in one instruction). A NaN product drops its pair from the
// check, as ScaledRowsFit drops it alone: its row's results are NaN either way.
template <int kChunks>
bool ScaledRowsFixed(int64_t rows, const float* x, int64_t ldx, const uint16_t* scales, float unit, uint16_t* out) {
  __m512 s[2 * kChunks];
  MHA_UNROLL for (int i = 0; i < 2 * kChunks; ++i) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 16 * i)));
    s[i] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)), _mm512_set1_ps(unit));
  }
  __m512 amax = _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ldx;
    MHA_UNROLL for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row + 32 * c), s[2 * c]);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(row + 32 * c + 16), s[2 * c + 1]);
      amax = _mm512_max_ps(_mm512_range_ps(lo, hi, 0x0b), amax);  // 0x0b: the larger |.|, its sign cleared
      _mm512_storeu_si512(out + r * kMaxElements + 32 * c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  return _mm512_cmp_ps_mask(amax, _mm512_set1_ps(0x1p127f), _CMP_LT_OQ) == 0xffff;
}

// x's rows times the block's bf16 `scales` times `unit` (widened once), rounded to bf16 into out as ScaledRowsFit
// does; false where they exceed the stack buffers (kQuantizedMaxRows rows of kQuantizedMaxElements) or fp32's range,
// and the caller takes the widening kernels.
bool ScaledRows(int64_t rows, const float* x, int64_t ldx, const uint16_t* scales, int64_t n, float unit,
                uint16_t* out) {
  if (n > kQuantizedMaxElements || rows > kQuantizedMaxRows) return false;
  // A decode's d_k of 128 or 64, a block of 32 or 64 keys.
  if (n == 128) return ScaledRowsFixed<4>(rows, x, ldx, scales, unit, out);
  if (n == 64) return ScaledRowsFixed<2>(rows, x, ldx, scales, unit, out);
  if (n == 32) return ScaledRowsFixed<1>(rows, x, ldx, scales, unit, out);
  alignas(64) float widened[kQuantizedMaxElements + 16];
  WidenScales(scales, n, unit, widened);
  return ScaledRowsFit(rows, x, ldx, widened, n, out);
}

// The FP8 caches on the same dot products, their codes read as bf16 as they are loaded (Fp8): q and the weights
// times the block's scales and rounded to bf16 first (on the stack: rows and depth or keys up to the 8-bit caches'
// limits).
template <bool kE4m3>
void Fp8Scores(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
               int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
               int64_t ahead_size) {
  alignas(64) uint16_t qb[kQuantizedMaxRows * kMaxElements];
  if (!ScaledRows(rows, q, ldq, key_scales, depth, kFp8Unit<kE4m3>, qb)) {
    avx512::kPagedKernels[FallbackIndex(static_cast<const Fp8<kE4m3>*>(nullptr))].scores(
        rows, keys, depth, q, ldq, kt_bytes, ldk, key_scales, s, lds, ahead_bytes, ahead_size);
    return;
  }
  const Fp8<kE4m3>* kt = static_cast<const Fp8<kE4m3>*>(kt_bytes);
  Ahead ahead = ScoresAhead(rows, keys, depth, ahead_bytes, ahead_size);
  for (int64_t i = 0; i < rows; i += kScoreRows) {
    const int64_t height = rows - i < kScoreRows ? rows - i : kScoreRows;
    RowGroupScores(height, keys, depth, qb + i * kMaxElements, kt, ldk, s + i * lds, lds, ahead);
  }
}

template <bool kE4m3>
void Fp8Values(int64_t rows, int64_t keys, int64_t width, const float* p, int64_t ldp, const void* v_bytes,
               const uint16_t* value_scales, const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes,
               int64_t ahead_size) {
  alignas(64) uint16_t pb[kQuantizedMaxRows * kMaxElements];
  if (!ScaledRows(rows, p, ldp, value_scales, keys, kFp8Unit<kE4m3>, pb)) {
    avx512::kPagedKernels[FallbackIndex(static_cast<const Fp8<kE4m3>*>(nullptr))].values(
        rows, keys, width, p, ldp, v_bytes, value_scales, o_scale, o, ldo, ahead_bytes, ahead_size);
    return;
  }
  Ahead ahead = ValuesAhead(rows, keys, width, ahead_bytes, ahead_size);
  for (int64_t i = 0; i < rows; i += kValueRows) {
    const int64_t height = rows - i < kValueRows ? rows - i : kValueRows;
    RowGroupValues<Fp8<kE4m3>>(height, &v_bytes, 1, keys, keys, width, pb + i * kMaxElements,
                               o_scale == nullptr ? nullptr : o_scale + i, o + i * ldo, ldo, ahead);
  }
}

}  // namespace

// The fp32 and fp16 caches' kernels are the avx512 set's; tile_kernels.cc puts this one beside them.
// Its register blocks serve many rows as well as few: a prefill tile takes the same ones.
extern const PagedKernels kBf16PagedKernels = {&ScoresOf<uint16_t>, &ValuesOf<uint16_t>, &ScoresOf<uint16_t>,
                                               &ValuesOverPartsOf<uint16_t>};
// The FP8 caches' (E4M3, E5M2), whose prefill runs them over groups of rows (paged_kernels_common.h).
extern const PagedKernels kFp8PagedKernels[2] = {
    {&Fp8Scores<true>, &Fp8Values<true>, &ScoresInRowGroups<&Fp8Scores<true>>,
     &ValuesPartByPart<&Fp8Values<true>>},
    {&Fp8Scores<false>, &Fp8Values<false>, &ScoresInRowGroups<&Fp8Scores<false>>,
     &ValuesPartByPart<&Fp8Values<false>>}};

}  // namespace avx512bf16
}  // namespace mha::kernels
