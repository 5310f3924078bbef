#include "client/attention_shape.h"

#include "absl/strings/str_cat.h"

namespace mha {

double AttentionFlops(const AttentionShape& s) {
  const double b = static_cast<double>(s.batch), tq = static_cast<double>(s.query_len),
               tk = static_cast<double>(s.key_len), h = static_cast<double>(s.num_heads),
               hkv = static_cast<double>(s.num_kv_heads), dk = static_cast<double>(s.head_dim),
               d = static_cast<double>(s.d_model);
  const double q_projection = 2 * b * tq * d * h * dk;
  const double kv_projection = 2 * b * tk * static_cast<double>(s.d_kv_in + s.d_v_in) * hkv * dk;
  const double out_projection = 2 * b * tq * h * dk * d;
  const double attention = 4 * b * h * tq * tk * dk * (s.causal ? 0.5 : 1.0);
  return q_projection + kv_projection + out_projection + attention;
}

std::string AttentionShapeString(const AttentionShape& s) {
  return absl::StrCat("B=", s.batch, " Tq=", s.query_len, " Tk=", s.key_len, " d_model=", s.d_model,
                      s.d_kv_in != s.d_model ? absl::StrCat(" d_kv=", s.d_kv_in) : "",
                      s.d_v_in != s.d_kv_in ? absl::StrCat(" d_v=", s.d_v_in) : "", " H=", s.num_heads,
                      " Hkv=", s.num_kv_heads, " d_k=", s.head_dim, s.causal ? " causal" : "");
}

}  // namespace mha
