#include "server/softmax_kernels.h"

#include <cmath>
#include <cstring>
#include <limits>

// One body, several instruction sets (GCC target_clones; each string is one clone, so the AVX2 clone is named
// "arch=haswell" to get FMA as well). The helpers below are always_inline: a plain inline helper is compiled once
// for the baseline target and the AVX2 clone called it out of line, 16-lane vectors through memory.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define MHA_MULTIVERSION
#endif

namespace mha::kernels {
namespace {

// 16 lanes in GCC's generic vector types: the compiler lowers them to one zmm register in the AVX-512 clone, two
// ymm in the AVX2 clone and four xmm in the baseline one, so one body serves every target.
typedef float F16x __attribute__((vector_size(64)));
typedef int32_t I16x __attribute__((vector_size(64)));
constexpr int kLanes = 16;

__attribute__((always_inline)) inline F16x Splat(float x) { return F16x{} + x; }

__attribute__((always_inline)) inline F16x Load(const float* p) {
  F16x v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((always_inline)) inline void Store(float* p, F16x v) { std::memcpy(p, &v, sizeof(v)); }

// exp(x) as 2^n * p(f): n = round(x log2 e), f = x - n ln 2 in [-ln2/2, ln2/2], p the Cephes expf polynomial
// (relative error below 2e-7). Inputs below about -87.3, -inf included, give exactly 0; x must not be +inf or NaN.
__attribute__((always_inline)) inline F16x FastExp(F16x x) {
  const F16x lo = Splat(-87.33654f), hi = Splat(88.3762626647949f);
  const I16x underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F16x round = Splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const F16x n = (x * 1.44269504088896341f + round) - round;
  const F16x f = x - n * 0.693359375f - n * -2.12194440e-4f;
  F16x p = Splat(1.9875691500e-4f);
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const I16x bits = (__builtin_convertvector(n, I16x) + 127) << 23;
  const F16x result = p * __builtin_bit_cast(F16x, bits);
  return underflow ? Splat(0.0f) : result;
}

__attribute__((always_inline)) inline float Sum(F16x v) {
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

}  // namespace

MHA_MULTIVERSION float RowMax(const float* x, int64_t n) {
  F16x m = Splat(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F16x v = Load(x + j);
    m = v > m ? v : m;
  }
  float result = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < kLanes; ++i) result = m[i] > result ? m[i] : result;
  for (; j < n; ++j) result = x[j] > result ? x[j] : result;
  return result;
}

MHA_MULTIVERSION float ExpShiftSum(float* x, int64_t n, float shift) {
  F16x sum = Splat(0.0f);
  const F16x s = Splat(shift);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F16x e = FastExp(Load(x + j) - s);
    Store(x + j, e);
    sum += e;
  }
  if (j < n) {  // the tail through a padded copy; the padding is -inf, whose exp is 0
    float tail[kLanes];
    for (int i = 0; i < kLanes; ++i) tail[i] = j + i < n ? x[j + i] : -std::numeric_limits<float>::infinity();
    const F16x e = FastExp(Load(tail) - s);
    Store(tail, e);
    sum += e;
    for (int64_t i = 0; j + i < n; ++i) x[j + i] = tail[i];
  }
  return Sum(sum);
}

MHA_MULTIVERSION void Scale(float* x, int64_t n, float factor) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(x + j, Load(x + j) * factor);
  for (; j < n; ++j) x[j] *= factor;
}

MHA_MULTIVERSION void Add(float* x, const float* add, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(x + j, Load(x + j) + Load(add + j));
  for (; j < n; ++j) x[j] += add[j];
}

}  // namespace mha::kernels
