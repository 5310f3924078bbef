// The rotary frequencies of a head configuration with RoPE (HeadSpec's rope fields, rope_scaling included), as
// transformers' rope init functions compute them (modeling_rope_utils.py: default, linear, dynamic, yarn, longrope,
// llama3), in double precision where transformers computes in fp32. Every backend rotates with these: one
// definition of the math, tested against float64 formulas (tests/rope_frequencies_test.cc) and against transformers
// itself (tests/models/test_rope_scaling.py).
#ifndef MHA_SERVER_BACKENDS_ROPE_FREQUENCIES_H_
#define MHA_SERVER_BACKENDS_ROPE_FREQUENCIES_H_

#include <cstdint>
#include <vector>

#include "proto/mha/v1/attention_shape.h"

namespace mha {

struct RopeFrequencies {
  std::vector<double> inv_freq;   // rope_dim / 2: pair i turns by position * inv_freq[i] radians
  double attention_factor = 1.0;  // multiplies cos and sin (so the rotated dims' q.k by its square)
};

// The frequencies for a sequence whose largest rotated position is seq_len - 1 (dynamic and longrope depend on
// it, RopeScaling::length_dependent; the others do not). heads.has_rope() must hold.
RopeFrequencies ComputeRopeFrequencies(const HeadSpec& heads, int64_t seq_len);

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_ROPE_FREQUENCIES_H_
