// The tile kernels for AVX-512 (compiled with -mavx512f -mavx512bw -mfma; called only where the CPU has AVX-512F and
// -BW, which every AVX-512 server CPU since Skylake-SP has).
#include <immintrin.h>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::avx512 {

struct Isa {
  static constexpr const char* kName = "avx512";
  using V = __m512;
  static constexpr int kLanes = 16;
  // 32 zmm registers: 24 accumulators, two loaded vectors and a broadcast. Two vectors wide rather than four:
  // each K^T or V row streamed from L2 then feeds twice as many FMAs.
  static constexpr int kScoreRows = 12, kScoreVectors = 2;
  static constexpr int kValueRows = 12, kValueVectors = 2;
  // The sessions' decode kernels (paged_kernels_impl.h): 16 accumulators of scores (8 rows of 16 keys, even and
  // odd depths apart), 16 of values (4 rows of 64 columns).
  static constexpr int kPagedVectors = 1, kPagedMaxVectors = 4, kPagedAccumulators = 16;
  static constexpr int kPagedValueRows = 4, kPagedValueVectors = 4;
  // A prefill tile's: the same blocks (12 rows of 32 keys and of 32 columns, the tile kernels', measured 9% slower).
  static constexpr int kPrefillScoreRows = 8, kPrefillScoreVectors = 2;
  static constexpr int kPrefillValueRows = 4, kPrefillValueVectors = 4;
  static constexpr int kPrefillValueParts = 8;  // blocks one pass of the values keeps in registers
  static V Zero() { return _mm512_setzero_ps(); }
  static V LoadHalf(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // 16 bf16 -> fp32 in one shuffle (vpermw placing word i at word 2i + 1, the even words zeroed) where widening
  // and shifting took two: the decode kernels convert every cache element they read, on the FMAs' ports.
  static V LoadBf16(const uint16_t* p) {
    const __m512i words = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i spread = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0,
                                            4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, spread, words));
  }
  static V Splat(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  // The first n < kLanes floats at p, the other lanes `fill`.
  static V LoadPartial(const float* p, int n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), p);
  }
  static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V Max(V a, V b) { return _mm512_max_ps(a, b); }
  static float ReduceMax(V x) { return _mm512_reduce_max_ps(x); }
  static float ReduceAdd(V x) { return _mm512_reduce_add_ps(x); }
  static void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void StorePartial(float* p, V x, int n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), x);
  }
  // A non-temporal store to a 64-byte aligned p: the line is written without being read first, and not cached.
  static void StoreStream(float* p, V x) { _mm512_stream_ps(p, x); }
  // Orders the non-temporal stores before every later store (another thread may read what they wrote).
  static void StreamFence() { _mm_sfence(); }
  static V Fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V RoundNearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n (vscalefps), and 0 in the lanes where x < lowest or x is -inf (where p and n are NaN or
  // out of range): the last step of Exp and Exp2.
  static V Pow2Live(V p, V n, V x, float lowest) {
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lowest), _CMP_GE_OQ), p, n);
  }
};

#include "server/backends/cpu/tile_kernels_impl.h"  // defines kKernels

}  // namespace mha::kernels::avx512
