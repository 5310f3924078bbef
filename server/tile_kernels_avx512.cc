// The tile kernels for AVX-512 (compiled with -mavx512f; called only where the CPU has it).
#include <immintrin.h>

#include "server/tile_kernels.h"

namespace mha::kernels::avx512 {

struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  // 32 zmm registers: 24 accumulators, the loaded vectors and a broadcast.
  static constexpr int kScoreRows = 6, kScoreVectors = 4;
  static constexpr int kValueRows = 6, kValueVectors = 4;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void StorePartial(float* p, V x, int n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), x);
  }
};

#include "server/tile_kernels_impl.h"

extern const TileKernels kKernels = {"avx512", Isa::kLanes, Isa::kScoreVectors * Isa::kLanes,
                                      Isa::kScoreRows, &Scores, &Values};

}  // namespace mha::kernels::avx512
