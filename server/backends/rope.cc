#include "server/backends/rope.h"

#include <cmath>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/rope_frequencies.h"

namespace mha {
namespace {

// Below this many values a parallel region costs more than it saves.
constexpr int64_t kParallelValues = 1 << 14;

float Load(float x) { return x; }
float Load(uint16_t x) { return Bf16ToFloat(x); }
void Store(float value, float* to) { *to = value; }
void Store(float value, uint16_t* to) { *to = FloatToBf16(value); }

}  // namespace

RopeAngles::RopeAngles(const HeadSpec& heads, int64_t first, int64_t count)
    : heads_(heads), first_(first), pairs_(heads.rope_dim / 2), cos_(count * pairs_), sin_(count * pairs_) {
  // The call's sequence ends at its last position (what dynamic and longrope scaling read).
  const RopeFrequencies f = ComputeRopeFrequencies(heads, first + count);
  const std::vector<double>& frequency = f.inv_freq;
  const double factor = f.attention_factor;
#pragma omp parallel for schedule(static) if (count * pairs_ > kParallelValues)
  for (int64_t t = 0; t < count; ++t) {
    const double position = static_cast<double>(first + t);
    for (int64_t i = 0; i < pairs_; ++i) {
      const double angle = position * frequency[i];
      cos_[t * pairs_ + i] = static_cast<float>(std::cos(angle) * factor);
      sin_[t * pairs_ + i] = static_cast<float>(std::sin(angle) * factor);
    }
  }
}

template <typename T>
void RopeAngles::Rotate(int64_t rows, int64_t first_position, int64_t heads_per_row, T* x, int64_t row_stride) const {
  const int64_t dk = heads_.head_dim, half = pairs_;
  // Pair i is (i, i + half) in the rotate-half convention, (2i, 2i + 1) interleaved.
  const int64_t step = heads_.rope_interleaved ? 2 : 1, partner = heads_.rope_interleaved ? 1 : half;
#pragma omp parallel for schedule(static) if (rows * heads_per_row * dk > kParallelValues)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_.data() + (first_position + r - first_) * pairs_;
    const float* s = sin_.data() + (first_position + r - first_) * pairs_;
    for (int64_t h = 0; h < heads_per_row; ++h) {
      T* head = x + r * row_stride + h * dk;
      for (int64_t i = 0; i < half; ++i) {
        T* a = head + i * step;
        T* b = a + partner;
        const float x0 = Load(*a), x1 = Load(*b);
        Store(x0 * c[i] - x1 * s[i], a);
        Store(x1 * c[i] + x0 * s[i], b);
      }
    }
  }
}

void RopeAngles::RotateRows(int64_t rows, int64_t first_position, int64_t heads_per_row, float* x,
                            int64_t row_stride) const {
  Rotate(rows, first_position, heads_per_row, x, row_stride);
}

void RopeAngles::RotateRows(int64_t rows, int64_t first_position, int64_t heads_per_row, uint16_t* bf16,
                            int64_t row_stride) const {
  Rotate(rows, first_position, heads_per_row, bf16, row_stride);
}

}  // namespace mha
