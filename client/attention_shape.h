// The dimensions of one MultiHeadAttention call and the arithmetic work it asks for.
#ifndef MHA_CLIENT_ATTENTION_SHAPE_H_
#define MHA_CLIENT_ATTENTION_SHAPE_H_

#include <cstdint>
#include <string>

namespace mha {

struct AttentionShape {
  int64_t batch = 0;        // B
  int64_t query_len = 0;    // Tq
  int64_t key_len = 0;      // Tk (== Tq for self-attention)
  int64_t d_model = 0;      // query features, and the output's
  int64_t d_kv_in = 0;      // key features
  int64_t d_v_in = 0;       // value features
  int64_t num_heads = 0;    // H
  int64_t num_kv_heads = 0; // Hkv (divides H)
  int64_t head_dim = 0;     // d_k
  bool causal = false;      // bottom-right aligned causal mask in force
};

// Floating-point operations of one call (multiply and add counted separately):
//   Q projection 2 B Tq d_model H d_k, K and V projections 2 B Tk (d_kv_in + d_v_in) Hkv d_k,
//   output projection 2 B Tq H d_k d_model, and attention 4 B H Tq Tk d_k (QK^T and PV), halved when causal.
// With d_v_in == d_kv_in this is 2BTq d H dk + 4BTk dkv Hkv dk + 2BTq H dk d + 4BH Tq Tk dk.
double AttentionFlops(const AttentionShape& shape);

// "B=1 Tq=16 Tk=16 d_model=512 H=8 Hkv=8 d_k=64" plus " causal" when causal.
std::string AttentionShapeString(const AttentionShape& shape);

}  // namespace mha

#endif  // MHA_CLIENT_ATTENTION_SHAPE_H_
