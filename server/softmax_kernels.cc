#include "server/softmax_kernels.h"

#include <cmath>
#include <limits>

// One body, three instruction sets; the loops below are written so that GCC vectorises them (no calls, no
// branches that cannot become blends).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MHA_MULTIVERSION
#endif

namespace mha::kernels {
namespace {

// exp(x) as 2^n * p(f): n = round(x log2 e), f = x - n ln 2 in [-ln2/2, ln2/2], p a degree-6 Taylor/minimax
// polynomial. Inputs below about -87.3 (including -inf) give 0; x must not be +inf or NaN.
inline float FastExp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kMin = -87.33654f, kMax = 88.3762626647949f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const bool underflow = x < kMin;
  x = x < kMin ? kMin : x;
  x = x > kMax ? kMax : x;
  const float n = (x * kLog2e + kRound) - kRound;
  const float f = x - n * kLn2Hi - n * kLn2Lo;
  // Cephes expf coefficients.
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * two_n;
}

}  // namespace

MHA_MULTIVERSION float RowMax(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

MHA_MULTIVERSION float ExpShiftSum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = FastExp(x[j] - shift);
    x[j] = e;
    sum += e;
  }
  return sum;
}

MHA_MULTIVERSION void Scale(float* x, int64_t n, float factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

MHA_MULTIVERSION void Add(float* x, const float* add, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] += add[j];
}

}  // namespace mha::kernels
