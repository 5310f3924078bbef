// The tile kernels on GCC's generic vector types, compiled for baseline x86-64 (SSE2): the fallback on CPUs without
// AVX2, and the one set every machine can test. Eight lanes, each vector lowered to two SSE registers.
#include <cstdint>
#include <cstring>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::portable {

struct Isa {
  static constexpr const char* kName = "portable";
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  static constexpr int kLanes = 8;
  // 16 xmm registers, two per vector: 6 accumulators, a loaded vector and a broadcast.
  static constexpr int kScoreRows = 6, kScoreVectors = 1;
  static constexpr int kValueRows = 6, kValueVectors = 1;
  // The sessions' decode kernels (paged_kernels_impl.h): 4 accumulators of scores (2 rows of 16 keys), 3 of values.
  static constexpr int kPagedVectors = 2, kPagedMaxVectors = 2, kPagedAccumulators = 4;
  static constexpr int kPagedValueRows = 3, kPagedValueVectors = 1;
  static constexpr int kPrefillScoreRows = 6, kPrefillScoreVectors = 1;  // a prefill tile's: the tile kernels'
  static constexpr int kPrefillValueRows = 6, kPrefillValueVectors = 1;
  static constexpr int kPrefillValueParts = 1;  // blocks one pass of the values keeps in registers
  static V Zero() { return V{}; }
  static V LoadHalf(const uint16_t* p) {
    V v;
    for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(p[i]);
    return v;
  }
  static V LoadBf16(const uint16_t* p) {
    I bits;
    for (int i = 0; i < kLanes; ++i) bits[i] = static_cast<int32_t>(static_cast<uint32_t>(p[i]) << 16);
    return __builtin_bit_cast(V, bits);
  }
  static V Splat(float x) { return V{} + x; }
  static V Load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  // The first n < kLanes floats at p, the other lanes `fill`.
  static V LoadPartial(const float* p, int n, float fill) {
    V v = Splat(fill);
    for (int i = 0; i < n; ++i) v[i] = p[i];
    return v;
  }
  static V Broadcast(const float* p) { return Splat(*p); }
  static V Fma(V a, V b, V c) { return a * b + c; }
  static V Mul(V a, V b) { return a * b; }
  static V Add(V a, V b) { return a + b; }
  static V Sub(V a, V b) { return a - b; }
  static V Max(V a, V b) { return a > b ? a : b; }
  static float ReduceMax(V x) {
    float m = x[0];
    for (int i = 1; i < kLanes; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  static float ReduceAdd(V x) {
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += x[i];
    return s;
  }
  static void Store(float* p, V x) { std::memcpy(p, &x, sizeof(x)); }
  static void StorePartial(float* p, V x, int n) {
    for (int i = 0; i < n; ++i) p[i] = x[i];
  }
  // Plain stores where avx512's StoreStream streams: the portable set keeps to what every x86-64 compiler has.
  static void StoreStream(float* p, V x) { Store(p, x); }
  static void StreamFence() {}
  static V Fnmadd(V a, V b, V c) { return c - a * b; }
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer for |x| < 2^22; larger values are integers
  // already or lie in lanes Pow2Live clears.
  static V RoundNearest(V x) {
    const V round = Splat(12582912.0f);
    return (x + round) - round;
  }
  // p * 2^n for integral n, 2^n built in the exponent bits, and 0 in the lanes where x < lowest or x is -inf; n is
  // zeroed in those lanes first, so that no out-of-range value is converted to an integer.
  static V Pow2Live(V p, V n, V x, float lowest) {
    const I live = x >= Splat(lowest);
    const V safe_n = live ? n : Zero();
    const I bits = (__builtin_convertvector(safe_n, I) + 127) << 23;
    return live ? p * __builtin_bit_cast(V, bits) : Zero();
  }
};

#include "server/backends/cpu/tile_kernels_impl.h"  // defines kKernels

}  // namespace mha::kernels::portable
