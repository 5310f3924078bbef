// Vectorised row kernels for the attention softmax on in-cache tiles: max, exp-and-sum, scale. Each is compiled
// for AVX-512, AVX2 and baseline x86-64 and picks the best at load time (GCC target_clones), so the binary still
// runs on any x86-64 CPU.
#ifndef MHA_SERVER_SOFTMAX_KERNELS_H_
#define MHA_SERVER_SOFTMAX_KERNELS_H_

#include <cstdint>

namespace mha::kernels {

// max(x[0..n)); -inf for n == 0.
float RowMax(const float* x, int64_t n);

// x[j] = exp(x[j] - shift) for j in [0, n), returns the sum of the results. -inf inputs give exactly 0.
// `shift` must be finite. Relative error of each exp below 2e-7.
float ExpShiftSum(float* x, int64_t n, float shift);

// x[j] *= factor.
void Scale(float* x, int64_t n, float factor);

// x[j] += add[j].
void Add(float* x, const float* add, int64_t n);

}  // namespace mha::kernels

#endif  // MHA_SERVER_SOFTMAX_KERNELS_H_
