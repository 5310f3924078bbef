#include "server/backends/synthetic.h"

#include <cmath>
#include <vector>

namespace mha {

absl::StatusOr<double> RunSyntheticLayer(Backend& backend, int64_t tokens, int64_t d_model, int64_t heads) {
  AttentionShape s;
  s.batch = 1;
  s.q_len = s.kv_len = tokens;
  s.d_model = s.d_kv_in = s.d_v_in = d_model;
  s.heads.num_heads = s.heads.num_kv_heads = heads;
  s.heads.head_dim = d_model / heads;
  s.heads.scale = 1.0f / std::sqrt(static_cast<float>(s.heads.head_dim));
  const float weight = 1.0f / static_cast<float>(d_model);
  const std::vector<float> x(tokens * d_model, 0.5f), w_qkv(d_model * 3 * d_model, weight),
      w_o(d_model * d_model, weight);
  std::vector<float> out(x.size());
  MhaArgs args;
  args.shape = s;
  args.weights.w_q = w_qkv.data();
  args.weights.w_k = w_qkv.data() + d_model;
  args.weights.w_v = w_qkv.data() + 2 * d_model;
  args.weights.ld_q = args.weights.ld_k = args.weights.ld_v = 3 * d_model;
  args.weights.w_o = w_o.data();
  args.weights.fused_qkv = true;
  args.kv_source = KvSource::kQuery;
  args.query = args.key = args.value = {x.data(), v1::FP32};
  args.out = {out.data(), v1::FP32};
  if (absl::Status status = backend.MultiHeadAttention(args); !status.ok()) return status;
  return AttentionFlops(s);
}

}  // namespace mha
