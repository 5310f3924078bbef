#include "server/backends/reference/reference_backend.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"

#include "server/backends/float_io.h"
#include "server/backends/synthetic.h"

namespace mha {
namespace {

// OK, or why `stop` (may be null) says to stop.
absl::Status Poll(const StopSignal* stop) { return stop == nullptr ? absl::OkStatus() : stop->Check(); }

// y[rows, out] = x[rows, in] W[in, out] (row stride ldw) + bias[out] (bias may be null), accumulated in double.
// Polls `stop` before each row.
absl::StatusOr<std::vector<double>> Linear(const double* x, int64_t rows, int64_t in, const float* w, int64_t ldw,
                                           const float* bias, int64_t out, const StopSignal* stop) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    if (absl::Status status = Poll(stop); !status.ok()) return status;
    for (int64_t o = 0; o < out; ++o) {
      double sum = bias ? bias[o] : 0.0;
      for (int64_t c = 0; c < in; ++c) sum += x[r * in + c] * static_cast<double>(w[c * ldw + o]);
      y[r * out + o] = sum;
    }
  }
  return y;
}

// `count` elements of `tensor` widened to double.
std::vector<double> ToDouble(const ConstTensor& tensor, int64_t count) {
  const FloatInput input(tensor, count);
  return std::vector<double>(input.data(), input.data() + count);
}

// Writes `values` into `tensor` in its dtype.
void Store(const std::vector<double>& values, const MutableTensor& tensor) {
  FloatOutput output(tensor, static_cast<int64_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) output.data()[i] = static_cast<float>(values[i]);
  output.Finish();
}

// The attention core on head-packed double tensors: q [B,Tq,H,dk], k/v [B,Tk,Hkv,dk] -> out [B,Tq,H,dk].
// weights [B,H,Tq,Tk] is written when non-null. Polls `stop` before each query row.
absl::Status Attend(const AttentionShape& s, const AttentionMask& mask, const double* q, const double* k,
                    const double* v, double* out, double* weights, const StopSignal* stop) {
  const HeadSpec& heads = s.heads;
  const int64_t H = heads.num_heads, Hkv = heads.num_kv_heads, dk = heads.head_dim, Tq = s.q_len, Tk = s.kv_len;
  std::vector<double> scores(Tk);
  std::vector<bool> visible(Tk);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kv_head = h / heads.group_size();
      for (int64_t i = 0; i < Tq; ++i) {
        if (absl::Status status = Poll(stop); !status.ok()) return status;
        const double* qi = q + ((b * Tq + i) * H + h) * dk;
        const int64_t visible_keys = VisibleKeyCount(s, mask, b, i);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Tk; ++j) {
          visible[j] = j < visible_keys;
          if (!visible[j]) continue;
          const double* kj = k + ((b * Tk + j) * Hkv + kv_head) * dk;
          double dot = 0.0;
          for (int64_t c = 0; c < dk; ++c) dot += qi[c] * kj[c];
          double score = dot * heads.scale;
          if (mask.additive != nullptr) {
            const int64_t base = mask.additive_per_batch ? b * Tq * Tk : 0;
            score += mask.additive[base + i * Tk + j];
          }
          if (score == -std::numeric_limits<double>::infinity()) visible[j] = false;
          scores[j] = score;
          if (visible[j] && score > max_score) max_score = score;
        }
        // Softmax over visible keys; a row with none stays all-zero (never NaN). A NaN score (from an overflow;
        // inputs are finite) makes the row NaN, as in PyTorch, rather than being taken for a masked row.
        double sum = 0.0;
        bool any_visible = false;
        for (int64_t j = 0; j < Tk; ++j) {
          scores[j] = visible[j] ? std::exp(scores[j] - max_score) : 0.0;
          sum += scores[j];
          any_visible |= visible[j];
        }
        double* oi = out + ((b * Tq + i) * H + h) * dk;
        for (int64_t c = 0; c < dk; ++c) oi[c] = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          const double p = any_visible ? scores[j] / sum : 0.0;
          if (weights != nullptr) weights[((b * H + h) * Tq + i) * Tk + j] = p;
          if (p == 0.0) continue;
          const double* vj = v + ((b * Tk + j) * Hkv + kv_head) * dk;
          for (int64_t c = 0; c < dk; ++c) oi[c] += p * vj[c];
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t ReferenceBackend::WorkspaceBytes(const AttentionProblem& problem) const {
  const AttentionShape& s = problem.shape;
  const HeadSpec& h = s.heads;
  const int64_t d_in = s.has_projections() ? s.d_model + s.d_kv_in + s.d_v_in : 0;
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const int64_t doubles = q_rows * (2 * h.q_width() + s.d_model) + kv_rows * 2 * h.kv_width() +
                          (q_rows + kv_rows) * d_in +
                          (problem.return_weights ? s.batch * h.num_heads * s.q_len * s.kv_len : 0);
  return doubles * static_cast<int64_t>(sizeof(double));
}

absl::StatusOr<double> ReferenceBackend::WarmUp() { return RunSyntheticLayer(*this, 16, 64, 4); }

absl::Status ReferenceBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t q_n = s.batch * s.q_len * s.heads.q_width(), kv_n = s.batch * s.kv_len * s.heads.kv_width();
  const std::vector<double> q = ToDouble(a.q, q_n), k = ToDouble(a.k, kv_n), v = ToDouble(a.v, kv_n);
  std::vector<double> out(q_n), weights;
  if (a.weights.requested()) weights.resize(s.batch * s.heads.num_heads * s.q_len * s.kv_len);
  absl::Status status =
      Attend(s, a.mask, q.data(), k.data(), v.data(), out.data(), weights.empty() ? nullptr : weights.data(), a.stop);
  if (!status.ok()) return status;
  Store(out, a.out);
  if (a.weights.requested()) Store(weights, a.weights);
  return absl::OkStatus();
}

absl::Status ReferenceBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionShape& s = a.shape;
  const HeadSpec& heads = s.heads;
  const LayerWeights& w = a.weights;
  const int64_t q_width = heads.q_width(), kv_width = heads.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;

  // Fan out: project into the head-packed layout [B, T, H, d_k] (head h owns columns [h*d_k, (h+1)*d_k)).
  const std::vector<double> x = ToDouble(a.query, q_rows * s.d_model);
  const std::vector<double> key_in = ToDouble(a.key, kv_rows * s.d_kv_in);
  const std::vector<double> value_in = ToDouble(a.value, kv_rows * s.d_v_in);
  absl::StatusOr<std::vector<double>> q = Linear(x.data(), q_rows, s.d_model, w.w_q, w.ld_q, w.b_q, q_width, a.stop);
  if (!q.ok()) return q.status();
  absl::StatusOr<std::vector<double>> k =
      Linear(key_in.data(), kv_rows, s.d_kv_in, w.w_k, w.ld_k, w.b_k, kv_width, a.stop);
  if (!k.ok()) return k.status();
  absl::StatusOr<std::vector<double>> v =
      Linear(value_in.data(), kv_rows, s.d_v_in, w.w_v, w.ld_v, w.b_v, kv_width, a.stop);
  if (!v.ok()) return v.status();

  // Attend with all heads.
  std::vector<double> head_out(q_rows * q_width), weights;
  if (a.attention_weights.requested()) weights.resize(s.batch * heads.num_heads * s.q_len * s.kv_len);
  absl::Status status = Attend(s, a.mask, q->data(), k->data(), v->data(), head_out.data(),
                               weights.empty() ? nullptr : weights.data(), a.stop);
  if (!status.ok()) return status;

  // Head ablation, then fan in: concat(heads) W_O + b_O.
  if (!a.head_mask.empty()) {
    for (int64_t r = 0; r < q_rows; ++r) {
      for (int64_t h = 0; h < heads.num_heads; ++h) {
        for (int64_t c = 0; c < heads.head_dim; ++c) head_out[(r * heads.num_heads + h) * heads.head_dim + c] *= a.head_mask[h];
      }
    }
  }
  absl::StatusOr<std::vector<double>> y =
      Linear(head_out.data(), q_rows, q_width, w.w_o, s.d_model, w.b_o, s.d_model, a.stop);
  if (!y.ok()) return y.status();
  Store(*y, a.out);
  if (a.attention_weights.requested()) Store(weights, a.attention_weights);
  return absl::OkStatus();
}

}  // namespace mha
