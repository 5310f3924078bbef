// The INT8 caches' decode kernels on AVX512-VNNI (compiled with -mavx512f -mavx512bw -mavx512dq -mavx512vnni; used in
// place of the AVX-512 set's where the CPU has the instructions: Ice Lake and later, Zen 4 and later). vpdpwssd and
// vpdpbusd fold the AVX-512 set's multiply, widening add and accumulate into one instruction each: an INT8 decode step
// at G = 4 query rows per KV head runs out of arithmetic before memory without them (docs/PERFORMANCE.md).
#include <immintrin.h>

#include <cstdint>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::avx512vnni {
namespace {

#define MHA_UNROLL _Pragma("GCC unroll 16")

// The float operations paged_kernels_int8.h's per-row scaling uses.
struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Splat(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V LoadBf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V Max(V a, V b) { return _mm512_max_ps(a, b); }
  static float ReduceMax(V x) { return _mm512_reduce_max_ps(x); }
  static void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
};

#include "server/backends/cpu/paged_kernels_common.h"  // Ahead, WithRows, the 8-bit prefill
#include "server/backends/cpu/paged_kernels_int8.h"    // Int8Scores, Int8Values (VNNI's I8)

}  // namespace

extern const PagedKernels kInt8PagedKernels = {&Int8Scores, &Int8Values, &ScoresInRowGroups<&Int8Scores>,
                                               &ValuesPartByPart<&Int8Values>};

#undef MHA_UNROLL

}  // namespace mha::kernels::avx512vnni
