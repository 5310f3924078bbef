// The attention core's two products on AVX512-BF16's dot products (compiled with -mavx512f -mavx512bw
// -mavx512bf16; called only where the CPU has them): for bf16 calls on CPUs without AMX (Zen 4 and 5; Cooper Lake).
//
// Operands are rounded to bf16 (round to nearest even) and multiplied with vdpbf16ps, which adds the products of
// one pair of bf16 to each fp32 lane: twice the multiply-adds of an fp32 FMA per instruction. Q (times the scale)
// and P are rounded when each call reads them, K and V once when packed, in tile_kernels_bf16.h's layouts (those of
// the amx set): one K^T vector holds one depth pair for 16 keys, one V vector one key pair for 16 columns. The
// softmax between the products stays fp32 (the AVX-512 set's).
//
// Register blocks as the fp32 AVX-512 set's: 12 rows by two vectors (32 keys or 32 columns), 24 accumulators, each
// step loading two vectors and broadcasting one bf16 pair per row. Rows past a block's edge are zero and not stored.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::avx512bf16 {
namespace {

#include "server/backends/cpu/tile_kernels_bf16.h"  // the packed layouts, bf16 conversions, scratch

#define MHA_UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kRows = 12;  // rows of a register block

__m512bh Pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

template <int kN>
struct BlockRows {
  static constexpr int kRows = kN;
};

// Calls f(BlockRows<n>{}) with the shortest register block, 4, 8 or 12 rows, that covers r <= kRows rows: the rows
// past r are computed from zeros and dropped.
template <typename F>
void WithBlockRows(int64_t r, F f) {
  if (r > 8) {
    f(BlockRows<12>{});
  } else if (r > 4) {
    f(BlockRows<8>{});
  } else {
    f(BlockRows<4>{});
  }
}

// Rows [0, rows) of s[., cols] (row stride lds) = qb[kRows, 2 pairs] * K^T for one 32-key panel (from its start),
// qb holding each row's depth as `pairs` bf16 pairs. Columns at or past `cols` are not written.
template <int kBlockRows>
void ScoreBlock(int64_t rows, int64_t cols, int64_t pairs, const uint32_t* qb, const uint32_t* panel, float* s,
                int64_t lds) {
  __m512 acc[kBlockRows][2];
  MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pairs / 16; ++c) {
    const uint32_t* lo = panel + c * 512;  // keys 0-15 of this chunk's 16 depth pairs; keys 16-31 256 further
    MHA_UNROLL for (int d = 0; d < 16; ++d) {
      const __m512bh b0 = Pairs(_mm512_loadu_si512(lo + d * 16));
      const __m512bh b1 = Pairs(_mm512_loadu_si512(lo + 256 + d * 16));
      MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) {
        const __m512bh a = Pairs(_mm512_set1_epi32(static_cast<int>(qb[r * pairs + c * 16 + d])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
  }
  const __mmask16 m0 = Mask(cols), m1 = Mask(cols - 16);
  MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) {
    if (r >= rows) break;
    _mm512_mask_storeu_ps(s + r * lds, m0, acc[r][0]);
    _mm512_mask_storeu_ps(s + r * lds + 16, m1, acc[r][1]);
  }
}

void Scores(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
            const float* kt_floats, float* s, int64_t lds) {
  const uint32_t* kt = reinterpret_cast<const uint32_t*>(kt_floats);
  const int64_t pairs = depth / 2;
  uint16_t* qb = static_cast<uint16_t*>(ThreadScratch().a.Get(kRows * depth * 2));
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(qb);
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const int64_t r = Min(kRows, rows - i0);
    for (int64_t i = 0; i < r; ++i) ToBf16(q + (i0 + i) * ldq, depth, depth, scale, qb + i * depth);
    std::memset(qb + r * depth, 0, (kRows - r) * depth * sizeof(uint16_t));
    for (int64_t j0 = 0; j0 < cols; j0 += kKeyPanel) {
      const uint32_t* panel = kt + j0 * pairs;
      float* out = s + i0 * lds + j0;
      const int64_t n = cols - j0;
      WithBlockRows(r, [&](auto block) { ScoreBlock<decltype(block)::kRows>(r, n, pairs, qp, panel, out, lds); });
    }
  }
}

// Rows [0, rows) of o[., 32 columns] (row stride ldo) = pb[kRows, pairs] * V for two 16-column panels v0 and v1
// (from their first key pair), plus o_scale[r] * o[r, .] when o_scale is not null.
template <int kBlockRows>
void ValueBlock(int64_t rows, int64_t pairs, const uint32_t* pb, int64_t ldp, const uint32_t* v0,
                const uint32_t* v1, const float* o_scale, float* o, int64_t ldo) {
  __m512 acc[kBlockRows][2];
  MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) {
    if (o_scale != nullptr && r < rows) {
      const __m512 f = _mm512_set1_ps(o_scale[r]);
      acc[r][0] = _mm512_mul_ps(f, _mm512_loadu_ps(o + r * ldo));
      acc[r][1] = _mm512_mul_ps(f, _mm512_loadu_ps(o + r * ldo + 16));
    } else {
      acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
  }
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh b0 = Pairs(_mm512_loadu_si512(v0 + j * 16));
    const __m512bh b1 = Pairs(_mm512_loadu_si512(v1 + j * 16));
    MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) {
      const __m512bh a = Pairs(_mm512_set1_epi32(static_cast<int>(pb[r * ldp + j])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  MHA_UNROLL for (int r = 0; r < kBlockRows; ++r) {
    if (r >= rows) break;
    _mm512_storeu_ps(o + r * ldo, acc[r][0]);
    _mm512_storeu_ps(o + r * ldo + 16, acc[r][1]);
  }
}

void Values(int64_t rows, int64_t n, int64_t width, const float* p, int64_t ldp, const float* vp_floats,
            int64_t panel_stride, const float* o_scale, float* o, int64_t ldo) {
  const uint32_t* vp = reinterpret_cast<const uint32_t*>(vp_floats);  // one bf16 pair per element
  const int64_t padded = (n + 31) / 32 * 32, pairs = (n + 1) / 2;
  uint16_t* pb = static_cast<uint16_t*>(ThreadScratch().a.Get(kRows * padded * 2));
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(pb);
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const int64_t r = Min(kRows, rows - i0);
    // Keys past n are zero in P (and in V up to the next multiple of 32), so the last pair may be half a pair.
    for (int64_t i = 0; i < r; ++i) ToBf16(p + (i0 + i) * ldp, n, padded, 1.0f, pb + i * padded);
    std::memset(pb + r * padded, 0, (kRows - r) * padded * sizeof(uint16_t));
    const float* scale = o_scale != nullptr ? o_scale + i0 : nullptr;
    for (int64_t w = 0; w < width; w += 2 * kValuePanel) {
      const uint32_t* v0 = vp + (w / kValuePanel) * panel_stride;
      const uint32_t* v1 = v0 + panel_stride;
      float* out = o + i0 * ldo + w;
      WithBlockRows(r, [&](auto block) {
        ValueBlock<decltype(block)::kRows>(r, pairs, pp, padded / 2, v0, v1, scale, out, ldo);
      });
    }
  }
}

}  // namespace

// The AVX-512 set with the packing and the two products replaced. Key blocks of 512: a 12-row panel's scores, 24 KiB,
// stay in L1 as the fp32 sets' do (256 measured slower).
TileKernels MakeKernels(const TileKernels& avx512) {
  return Bf16Kernels(avx512, "avx512bf16", kRows, 512, Scores, Values);
}

}  // namespace mha::kernels::avx512bf16
