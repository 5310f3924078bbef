#include "server/backends/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/float_io.h"
#include "server/backends/quantized_cache.h"
#include "server/backends/rope_frequencies.h"
#include "server/backends/synthetic.h"
#include "server/base/status_macros.h"

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

// RoPE on head-packed rows x [rows, heads, d_k] in double, row r at position first + r: pair i of the first rope_dim
// dims, (i, i + rope_dim / 2) or (2i, 2i + 1) when interleaved, turns by position * inv_freq[i] and is multiplied by
// the attention factor (rope_frequencies.h; the sequence ends at first + rows).
void Rotate(const HeadSpec& h, int64_t rows, int64_t heads, int64_t first, double* x) {
  if (!h.has_rope()) return;
  const int64_t half = h.rope_dim / 2;
  const RopeFrequencies f = ComputeRopeFrequencies(h, first + rows);
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(first + r);
    for (int64_t head = 0; head < heads; ++head) {
      double* v = x + (r * heads + head) * h.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = position * f.inv_freq[i];
        const double c = std::cos(angle) * f.attention_factor, s = std::sin(angle) * f.attention_factor;
        const int64_t a = h.rope_interleaved ? 2 * i : i, b = h.rope_interleaved ? 2 * i + 1 : i + half;
        const double x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x1 * c + x0 * s;
      }
    }
  }
}

// RoPE on a stateless call's q [B, Tq, H, d_k] and k [B, Tk, Hkv, d_k]: keys at 0..Tk-1, queries bottom-right
// aligned at Tk-Tq..Tk-1.
void RotateStateless(const AttentionShape& s, double* q, double* k) {
  const HeadSpec& h = s.heads;
  for (int64_t b = 0; b < s.batch; ++b) {
    Rotate(h, s.q_len, h.num_heads, s.kv_len - s.q_len, q + b * s.q_len * h.q_width());
    Rotate(h, s.kv_len, h.num_kv_heads, 0, k + b * s.kv_len * h.kv_width());
  }
}

// Row `row` of `stats` (not contribution) from the row's weights p[0, Tk) as the definitions in backend.h's RowStats
// read, the query at position `pos`; `sum` and `max` are the softmax's (sum 0: nothing visible).
void RowStatsFromWeights(const RowStats& stats, int64_t row, const std::vector<double>& p, double max, double sum,
                         double pos) {
  const auto put = [row](float* array, double value) {
    if (array != nullptr) array[row] = static_cast<float>(value);
  };
  if (std::isnan(sum) || sum == 0) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    put(stats.lse, std::isnan(sum) ? nan : -std::numeric_limits<double>::infinity());
    for (float* a : {stats.entropy, stats.confidence, stats.distance, stats.sink}) put(a, std::isnan(sum) ? nan : 0.0);
    return;
  }
  double entropy = 0, confidence = 0, distance = 0, sink = 0;
  for (size_t j = 0; j < p.size(); ++j) {
    if (p[j] == 0) continue;
    entropy -= p[j] * std::log(p[j]);
    confidence = std::max(confidence, p[j]);
    distance += p[j] * std::abs(pos - static_cast<double>(j));
    if (static_cast<int64_t>(j) < stats.sink_tokens) sink += p[j];
  }
  put(stats.lse, max + std::log(sum));
  put(stats.entropy, entropy);
  put(stats.confidence, confidence);
  put(stats.distance, distance);
  put(stats.sink, sink);
}

// The attention core on head-packed double tensors: q [B,Tq,H,dk], k/v [B,Tk,Hkv,dk] -> out [B,Tq,H,dk].
// weights [B,H,Tq,Tk] is written when non-null, `stats` ([B,H,Tq]) when asked for, query i at position
// i + Tk - Tq + position_shift. Polls `stop` before each query row.
absl::Status Attend(const AttentionShape& s, const AttentionMask& mask, const double* q, const double* k,
                    const double* v, double* out, double* weights, const StopSignal* stop,
                    const RowStats& stats = {}, int64_t position_shift = 0) {
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
        if (stats.softmax()) {
          std::vector<double> p(Tk);
          for (int64_t j = 0; j < Tk; ++j) p[j] = any_visible ? scores[j] / sum : 0.0;
          RowStatsFromWeights(stats, (b * H + h) * Tq + i, p, max_score, any_visible ? sum : 0.0,
                              static_cast<double>(i + Tk - Tq + position_shift));
        }
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

// contribution[(b H + h) Tq + i] = ||heads[b Tq + i, h] W_O[h]|| / ||y[b Tq + i]|| (0 for a zero row of y), in
// double: heads [B Tq, H d_k] after the head mask, y the layer's output [B Tq, d_model].
void Contributions(const HeadSpec& h, int64_t batch, int64_t q_len, int64_t d_model, const double* heads,
                   const float* w_o, const double* y, float* contribution) {
  const int64_t dk = h.head_dim;
  std::vector<double> term(d_model);
  for (int64_t r = 0; r < batch * q_len; ++r) {
    double out_norm = 0;
    for (int64_t c = 0; c < d_model; ++c) out_norm += y[r * d_model + c] * y[r * d_model + c];
    out_norm = std::sqrt(out_norm);
    for (int64_t head = 0; head < h.num_heads; ++head) {
      std::fill(term.begin(), term.end(), 0.0);
      for (int64_t c = 0; c < dk; ++c) {
        const double x = heads[r * h.q_width() + head * dk + c];
        const float* w_row = w_o + (head * dk + c) * d_model;
        for (int64_t o = 0; o < d_model; ++o) term[o] += x * w_row[o];
      }
      double norm = 0;
      for (double t : term) norm += t * t;
      contribution[((r / q_len) * h.num_heads + head) * q_len + r % q_len] =
          out_norm > 0 ? static_cast<float>(std::sqrt(norm) / out_norm) : 0.0f;
    }
  }
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
  std::vector<double> q = ToDouble(a.q, q_n), k = ToDouble(a.k, kv_n);
  const std::vector<double> v = ToDouble(a.v, kv_n);
  RotateStateless(s, q.data(), k.data());
  std::vector<double> out(q_n), weights;
  if (a.weights.requested()) weights.resize(s.batch * s.heads.num_heads * s.q_len * s.kv_len);
  absl::Status status = Attend(s, a.mask, q.data(), k.data(), v.data(), out.data(),
                               weights.empty() ? nullptr : weights.data(), a.stop, a.stats);
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
  RotateStateless(s, q->data(), k->data());

  // Attend with all heads.
  std::vector<double> head_out(q_rows * q_width), weights;
  if (a.attention_weights.requested()) weights.resize(s.batch * heads.num_heads * s.q_len * s.kv_len);
  absl::Status status = Attend(s, a.mask, q->data(), k->data(), v->data(), head_out.data(),
                               weights.empty() ? nullptr : weights.data(), a.stop, a.stats);
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
  if (a.stats.contribution != nullptr) {
    Contributions(heads, s.batch, s.q_len, s.d_model, head_out.data(), w.w_o, y->data(), a.stats.contribution);
  }
  if (a.attention_weights.requested()) Store(weights, a.attention_weights);
  return absl::OkStatus();
}

namespace {

// Element `index` of a cache block, as double.
double CacheElement(const KvCacheLayout& c, const char* block, int64_t index) {
  float value = 0;
  DecodeToFloat(c.dtype, block + index * DTypeSize(c.dtype), 1, &value);
  return value;
}

void SetCacheElement(const KvCacheLayout& c, char* block, int64_t index, double value) {
  const float narrowed = static_cast<float>(value);
  EncodeFromFloat(c.dtype, &narrowed, 1, block + index * DTypeSize(c.dtype));
}

// An 8-bit cache's new tokens, block by block (each block's tokens in one write, as every backend writes them, so
// that its scales grow alike), through fp32 as the other backends' projections arrive.
void WriteQuantized(const KvCacheLayout& c, const PagedSequence& seq, const double* k, const double* v) {
  const int64_t dk = c.head_dim, tb = c.block_tokens, Hkv = c.num_kv_heads;
  const std::vector<float> kf(k, k + seq.new_tokens * Hkv * dk), vf(v, v + seq.new_tokens * Hkv * dk);
  for (int64_t t0 = seq.length; t0 < seq.length + seq.new_tokens;) {
    const int64_t t1 = std::min(seq.length + seq.new_tokens, (t0 / tb + 1) * tb), i = t0 - seq.length;
    for (int64_t g = 0; g < Hkv; ++g) {
      quant::WriteTokens(c, seq.blocks[t0 / tb], g, t0 % tb, t1 - t0, &kf[(i * Hkv + g) * dk], Hkv * dk,
                         &vf[(i * Hkv + g) * dk], Hkv * dk);
    }
    t0 = t1;
  }
}

// Writes the new tokens' k and v [n, Hkv, d_k] into their slots, positions length.., rounded to the cache's dtype.
void WriteTokens(const KvCacheLayout& c, const PagedSequence& seq, const double* k, const double* v) {
  if (c.Quantized()) {
    WriteQuantized(c, seq, k, v);
    return;
  }
  const int64_t dk = c.head_dim, tb = c.block_tokens;
  for (int64_t i = 0; i < seq.new_tokens; ++i) {
    const int64_t t = seq.length + i;
    char* block = seq.blocks[t / tb];
    for (int64_t g = 0; g < c.num_kv_heads; ++g) {
      for (int64_t d = 0; d < dk; ++d) {
        SetCacheElement(c, block, c.KeyOffset(g) + d * tb + t % tb, k[(i * c.num_kv_heads + g) * dk + d]);
        SetCacheElement(c, block, c.ValueOffset(g) + (t % tb) * dk + d, v[(i * c.num_kv_heads + g) * dk + d]);
      }
    }
  }
}

// The whole cache of `seq` (tokens 0..length+n-1) as head-packed double k and v [T, Hkv, d_k].
void ReadCache(const KvCacheLayout& c, const PagedSequence& seq, std::vector<double>* k, std::vector<double>* v) {
  const int64_t dk = c.head_dim, tb = c.block_tokens, tokens = seq.Keys();
  k->resize(tokens * c.num_kv_heads * dk);
  v->resize(k->size());
  for (int64_t t = 0; t < tokens; ++t) {
    const char* block = seq.blocks[t / tb];
    for (int64_t g = 0; g < c.num_kv_heads; ++g) {
      for (int64_t d = 0; d < dk && c.Quantized(); ++d) {
        (*k)[(t * c.num_kv_heads + g) * dk + d] = quant::KeyAt(c, block, g, t % tb, d);
        (*v)[(t * c.num_kv_heads + g) * dk + d] = quant::ValueAt(c, block, g, t % tb, d);
      }
      for (int64_t d = 0; d < dk && !c.Quantized(); ++d) {
        (*k)[(t * c.num_kv_heads + g) * dk + d] = CacheElement(c, block, c.KeyOffset(g) + d * tb + t % tb);
        (*v)[(t * c.num_kv_heads + g) * dk + d] = CacheElement(c, block, c.ValueOffset(g) + (t % tb) * dk + d);
      }
    }
  }
}

// One sequence of a paged call: q, k, v of the new tokens (projected from x with a layer), RoPE at their cache
// positions, k and v into the cache, then the stateless causal attention over the whole cache and W_O.
absl::Status PagedSequenceAttention(const PagedArgs& a, const PagedSequence& seq) {
  const PagedProblem& p = a.problem;
  const HeadSpec& h = p.heads;
  const LayerWeights& w = a.weights;
  const int64_t n = seq.new_tokens;
  std::vector<double> q, k, v;
  if (p.d_model > 0) {
    const std::vector<double> x = ToDouble(seq.x, n * p.d_model);
    absl::StatusOr<std::vector<double>> projected[3] = {
        Linear(x.data(), n, p.d_model, w.w_q, w.ld_q, w.b_q, h.q_width(), a.stop),
        Linear(x.data(), n, p.d_model, w.w_k, w.ld_k, w.b_k, h.kv_width(), a.stop),
        Linear(x.data(), n, p.d_model, w.w_v, w.ld_v, w.b_v, h.kv_width(), a.stop)};
    for (const auto& y : projected) {
      if (!y.ok()) return y.status();
    }
    q = *std::move(projected[0]);
    k = *std::move(projected[1]);
    v = *std::move(projected[2]);
  } else {
    q = ToDouble(seq.q, n * h.q_width());
    if (seq.append) {
      k = ToDouble(seq.k, n * h.kv_width());
      v = ToDouble(seq.v, n * h.kv_width());
    }
  }
  Rotate(h, n, h.num_heads, seq.length, q.data());
  if (seq.append) {
    Rotate(h, n, h.num_kv_heads, seq.length, k.data());
    WriteTokens(p.cache, seq, k.data(), v.data());
  }

  // Without append the new tokens, at positions length.., see the whole cache and nothing of their own.
  AttentionShape s;
  s.batch = 1;
  s.q_len = n;
  s.kv_len = seq.Keys();
  s.heads = h;
  s.heads.causal = seq.append;
  ReadCache(p.cache, seq, &k, &v);
  std::vector<double> heads(n * h.q_width()), weights;
  if (seq.weights.requested()) weights.resize(h.num_heads * n * s.kv_len);
  RETURN_IF_ERROR(Attend(s, AttentionMask(), q.data(), k.data(), v.data(), heads.data(),
                         weights.empty() ? nullptr : weights.data(), a.stop, seq.stats, seq.append ? 0 : n));
  if (seq.weights.requested()) Store(weights, seq.weights);
  if (p.d_model == 0) {
    Store(heads, seq.out);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<double>> y = Linear(heads.data(), n, h.q_width(), w.w_o, p.d_model, w.b_o, p.d_model, a.stop);
  if (!y.ok()) return y.status();
  Store(*y, seq.out);
  if (seq.stats.contribution != nullptr) {
    Contributions(h, 1, n, p.d_model, heads.data(), w.w_o, y->data(), seq.stats.contribution);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t ReferenceBackend::PagedWorkspaceBytes(const PagedProblem& p) const {
  const HeadSpec& h = p.heads;
  // One sequence at a time: its new tokens' projections and heads, its whole cache in double, its weights.
  const int64_t n = p.max_new_tokens, tokens = p.max_length;
  const int64_t doubles = n * (p.d_model + 2 * h.q_width() + 2 * h.kv_width() + p.d_model) +
                          2 * tokens * h.kv_width() + (p.return_weights ? h.num_heads * n * tokens : 0);
  return doubles * static_cast<int64_t>(sizeof(double));
}

absl::Status ReferenceBackend::PagedAttention(const PagedArgs& a) {
  RETURN_IF_ERROR(CheckPagedArgs(a));
  for (const PagedSequence& seq : a.sequences) RETURN_IF_ERROR(PagedSequenceAttention(a, seq));
  return absl::OkStatus();
}

}  // namespace mha
