// The tile kernels for AVX2 with FMA (compiled with -mavx2 -mfma; called only where the CPU has both).
#include <immintrin.h>

#include "server/tile_kernels.h"

namespace mha::kernels::avx2 {

struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8;
  // 16 ymm registers: 12 accumulators, the loaded vectors and a broadcast.
  static constexpr int kScoreRows = 6, kScoreVectors = 2;
  static constexpr int kValueRows = 3, kValueVectors = 4;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void StorePartial(float* p, V x, int n) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, mask, x);
  }
};

#include "server/tile_kernels_impl.h"

extern const TileKernels kKernels = {"avx2", Isa::kLanes, Isa::kScoreVectors * Isa::kLanes,
                                      Isa::kScoreRows, &Scores, &Values};

}  // namespace mha::kernels::avx2
