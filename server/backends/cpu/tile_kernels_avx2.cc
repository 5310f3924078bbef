// The tile kernels for AVX2 with FMA and F16C (compiled with -mavx2 -mfma -mf16c; called only where the CPU has all three).
#include <immintrin.h>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::avx2 {

struct Isa {
  static constexpr const char* kName = "avx2";
  using V = __m256;
  static constexpr int kLanes = 8;
  // 16 ymm registers: 12 accumulators, two loaded vectors and a broadcast.
  static constexpr int kScoreRows = 6, kScoreVectors = 2;
  static constexpr int kValueRows = 6, kValueVectors = 2;
  // The sessions' decode kernels (paged_kernels_impl.h): 8 accumulators of scores (4 rows of 16 keys), 8 of values
  // (4 rows of 16 columns).
  static constexpr int kPagedVectors = 2, kPagedMaxVectors = 2, kPagedAccumulators = 8;
  static constexpr int kPagedValueRows = 4, kPagedValueVectors = 2;
  // A prefill tile's (many rows): the tile kernels' 12 accumulators, each loaded vector serving 6 rows.
  static constexpr int kPrefillScoreRows = 6, kPrefillScoreVectors = 2;
  static constexpr int kPrefillValueRows = 6, kPrefillValueVectors = 2;
  static constexpr int kPrefillValueParts = 1;  // blocks one pass of the values keeps in registers
  static V Zero() { return _mm256_setzero_ps(); }
  // F16C's conversion: every AVX2 CPU has it (TileKernelsFor checks).
  static V LoadHalf(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V LoadBf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V Splat(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256i FirstLanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // The first n < kLanes floats at p, the other lanes `fill`.
  static V LoadPartial(const float* p, int n, float fill) {
    const __m256i mask = FirstLanes(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask));
  }
  static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V Max(V a, V b) { return _mm256_max_ps(a, b); }
  static float ReduceMax(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static float ReduceAdd(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void StorePartial(float* p, V x, int n) { _mm256_maskstore_ps(p, FirstLanes(n), x); }
  // A non-temporal store to a 32-byte aligned p (avx512's StoreStream), and the fence that orders such stores.
  static void StoreStream(float* p, V x) { _mm256_stream_ps(p, x); }
  static void StreamFence() { _mm_sfence(); }
  static V Fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V RoundNearest(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n, 2^n built in the exponent bits, and 0 in the lanes where x < lowest or x is -inf (where
  // p and n are NaN or out of range; the mask clears whatever they hold): the last step of Exp and Exp2.
  static V Pow2Live(V p, V n, V x, float lowest) {
    const V live = _mm256_cmp_ps(x, _mm256_set1_ps(lowest), _CMP_GE_OQ);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
  }
};

#include "server/backends/cpu/tile_kernels_impl.h"  // defines kKernels

}  // namespace mha::kernels::avx2
