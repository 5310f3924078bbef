#include "server/reference_backend.h"

#include <cmath>
#include <limits>
#include <vector>

namespace mha {
namespace {

// y[rows, out] = x[rows, in] W[in, out] + bias[out] (bias may be null), accumulated in double.
std::vector<double> Linear(const double* x, int64_t rows, int64_t in, const float* w, const float* bias,
                           int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double sum = bias ? bias[o] : 0.0;
      for (int64_t c = 0; c < in; ++c) sum += x[r * in + c] * static_cast<double>(w[c * out + o]);
      y[r * out + o] = sum;
    }
  }
  return y;
}

std::vector<double> ToDouble(const float* x, int64_t n) { return std::vector<double>(x, x + n); }

// The attention core on head-packed double tensors: q [B,Tq,H,dk], k/v [B,Tk,Hkv,dk] -> out [B,Tq,H,dk].
// weights [B,H,Tq,Tk] is written when non-null.
void Attend(const AttentionDims& d, const AttentionMask& mask, const double* q, const double* k, const double* v,
            double* out, float* weights) {
  const int64_t H = d.num_heads, Hkv = d.num_kv_heads, dk = d.head_dim, Tq = d.q_len, Tk = d.kv_len;
  std::vector<double> scores(Tk);
  std::vector<bool> visible(Tk);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kv_head = h / d.group_size();
      for (int64_t i = 0; i < Tq; ++i) {
        const double* qi = q + ((b * Tq + i) * H + h) * dk;
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Tk; ++j) {
          visible[j] = KeyVisible(d, mask, b, i, j);
          if (!visible[j]) continue;
          const double* kj = k + ((b * Tk + j) * Hkv + kv_head) * dk;
          double dot = 0.0;
          for (int64_t c = 0; c < dk; ++c) dot += qi[c] * kj[c];
          double s = dot * d.scale;
          if (mask.additive != nullptr) {
            const int64_t base = mask.additive_per_batch ? b * Tq * Tk : 0;
            s += mask.additive[base + i * Tk + j];
          }
          if (s == -std::numeric_limits<double>::infinity()) visible[j] = false;
          scores[j] = s;
          if (visible[j] && s > max_score) max_score = s;
        }
        // Softmax over visible keys; a row with none stays all-zero (never NaN).
        double sum = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          scores[j] = visible[j] ? std::exp(scores[j] - max_score) : 0.0;
          sum += scores[j];
        }
        double* oi = out + ((b * Tq + i) * H + h) * dk;
        for (int64_t c = 0; c < dk; ++c) oi[c] = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          const double p = sum > 0.0 ? scores[j] / sum : 0.0;
          if (weights != nullptr) weights[((b * H + h) * Tq + i) * Tk + j] = static_cast<float>(p);
          if (p == 0.0) continue;
          const double* vj = v + ((b * Tk + j) * Hkv + kv_head) * dk;
          for (int64_t c = 0; c < dk; ++c) oi[c] += p * vj[c];
        }
      }
    }
  }
}

}  // namespace

absl::Status ReferenceBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionDims& d = a.dims;
  const int64_t q_n = d.batch * d.q_len * d.num_heads * d.head_dim;
  const int64_t kv_n = d.batch * d.kv_len * d.num_kv_heads * d.head_dim;
  std::vector<double> q = ToDouble(a.q, q_n), k = ToDouble(a.k, kv_n), v = ToDouble(a.v, kv_n);
  std::vector<double> out(q_n);
  Attend(d, a.mask, q.data(), k.data(), v.data(), out.data(), a.weights);
  for (int64_t i = 0; i < q_n; ++i) a.out[i] = static_cast<float>(out[i]);
  return absl::OkStatus();
}

absl::Status ReferenceBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionDims& d = a.dims;
  const LayerWeights& w = a.weights;
  const int64_t q_width = d.num_heads * d.head_dim, kv_width = d.num_kv_heads * d.head_dim;
  const int64_t q_rows = d.batch * d.q_len, kv_rows = d.batch * d.kv_len;

  // Fan out: project into the head-packed layout [B, T, H, d_k] (head h owns columns [h*d_k, (h+1)*d_k)).
  std::vector<double> x = ToDouble(a.query, q_rows * w.d_model);
  std::vector<double> key_in = ToDouble(a.key, kv_rows * w.d_kv_in);
  std::vector<double> value_in = ToDouble(a.value, kv_rows * w.d_v_in);
  std::vector<double> q = Linear(x.data(), q_rows, w.d_model, w.w_q, w.b_q, q_width);
  std::vector<double> k = Linear(key_in.data(), kv_rows, w.d_kv_in, w.w_k, w.b_k, kv_width);
  std::vector<double> v = Linear(value_in.data(), kv_rows, w.d_v_in, w.w_v, w.b_v, kv_width);

  // Attend with all heads.
  std::vector<double> heads(q_rows * q_width);
  Attend(d, a.mask, q.data(), k.data(), v.data(), heads.data(), a.attention_weights);

  // Head ablation, then fan in: concat(heads) W_O + b_O.
  if (!a.head_mask.empty()) {
    for (int64_t r = 0; r < q_rows; ++r) {
      for (int64_t h = 0; h < d.num_heads; ++h) {
        for (int64_t c = 0; c < d.head_dim; ++c) heads[(r * d.num_heads + h) * d.head_dim + c] *= a.head_mask[h];
      }
    }
  }
  std::vector<double> y = Linear(heads.data(), q_rows, q_width, w.w_o, w.b_o, w.d_model);
  for (int64_t i = 0; i < q_rows * w.d_model; ++i) a.out[i] = static_cast<float>(y[i]);
  return absl::OkStatus();
}

}  // namespace mha
