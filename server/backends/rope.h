// Rotary position embeddings (HeadSpec's rope fields) for the host backends that compute in fp32: the angles of a
// range of positions, computed once per call in double precision (an fp32 product of position and frequency is off
// by 1e-3 rad at position 8192, more than the fp32 tolerances), and the rotation of head-packed rows with them.
// The reference backend rotates with its own double loops.
#ifndef MHA_SERVER_BACKENDS_ROPE_H_
#define MHA_SERVER_BACKENDS_ROPE_H_

#include <cstdint>
#include <vector>

#include "proto/mha/v1/attention_shape.h"

namespace mha {

class RopeAngles {
 public:
  // cos and sin of position * inv_freq[i] for i < rope_dim / 2, times the attention factor (rope_frequencies.h, for
  // a sequence of first + count tokens), for positions first..first + count - 1 (first may be negative: bottom-right
  // aligned queries of a call with Tq > Tk). heads.has_rope() must hold. Parallel over the calling thread's OpenMP
  // team for long ranges.
  RopeAngles(const HeadSpec& heads, int64_t first, int64_t count);

  // Rotates rows of `heads_per_row` heads of head_dim values each, row r (stride `row_stride` elements) at
  // position `first_position + r`, which must lie in this object's range. fp32 rows, or bf16 ones (rotated in fp32
  // and rounded back to nearest even). Parallel over rows for many of them.
  void RotateRows(int64_t rows, int64_t first_position, int64_t heads_per_row, float* x, int64_t row_stride) const;
  void RotateRows(int64_t rows, int64_t first_position, int64_t heads_per_row, uint16_t* bf16,
                  int64_t row_stride) const;

 private:
  template <typename T>
  void Rotate(int64_t rows, int64_t first_position, int64_t heads_per_row, T* x, int64_t row_stride) const;

  const HeadSpec heads_;
  const int64_t first_;
  const int64_t pairs_;    // rope_dim / 2
  std::vector<float> cos_, sin_;  // [count, pairs_]
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_ROPE_H_
