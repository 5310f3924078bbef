// The one seam between the service and the code that computes attention.
//
// Every backend computes the same math (see proto/mha/v1/attention.proto) on fp32 arrays the caller owns:
//   scores[b,h,i,j] = scale * <q[b,i,h,:], k[b,j,h/G,:]> + additive[(b,)i,j]     (G = H / Hkv)
//   key j is masked for query i when causal and j > i + (Tk - Tq), when j >= key_lengths[b], or when the
//   additive mask is -inf;
//   p = softmax_j(scores) over unmasked keys; a row with no unmasked key gets p = 0 (and so a zero output);
//   out[b,i,h,:] = sum_j p[b,h,i,j] v[b,j,h/G,:].
// The reference backend is the ground truth; every other backend is tested against it.
#ifndef MHA_SERVER_BACKEND_H_
#define MHA_SERVER_BACKEND_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace mha {

// Sizes and options of one attention computation, fully resolved (no zero-means-default left).
struct AttentionDims {
  int64_t batch = 0;         // B
  int64_t q_len = 0;         // Tq
  int64_t kv_len = 0;        // Tk
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // Hkv, divides H
  int64_t head_dim = 0;      // d_k
  bool causal = false;       // bottom-right aligned
  float scale = 0.0f;        // multiplies q.k

  int64_t group_size() const { return num_heads / num_kv_heads; }
};

// Masks beyond causal; all optional. Pointers are borrowed for the duration of one call.
struct AttentionMask {
  absl::Span<const int32_t> key_lengths;  // empty, or B values in [0, Tk]
  const float* additive = nullptr;        // nullptr, or [Tq, Tk] / [B, Tq, Tk] (additive_per_batch)
  bool additive_per_batch = false;
};

// Scaled dot-product attention on head-packed (BSHD) tensors.
struct SdpaArgs {
  AttentionDims dims;
  AttentionMask mask;
  const float* q = nullptr;  // [B, Tq, H, d_k]
  const float* k = nullptr;  // [B, Tk, Hkv, d_k]
  const float* v = nullptr;  // [B, Tk, Hkv, d_k]
  float* out = nullptr;      // [B, Tq, H, d_k], written
  float* weights = nullptr;  // [B, H, Tq, Tk], written when non-null
};

// fp32 projection weights, Y = X W convention (W is [in, out] row-major). Borrowed.
struct LayerWeights {
  int64_t d_model = 0;  // query features, also the output features
  int64_t d_kv_in = 0;  // key features
  int64_t d_v_in = 0;   // value features
  const float* w_q = nullptr;  // [d_model, H * d_k]
  const float* w_k = nullptr;  // [d_kv_in, Hkv * d_k]
  const float* w_v = nullptr;  // [d_v_in, Hkv * d_k]
  const float* w_o = nullptr;  // [H * d_k, d_model]
  const float* b_q = nullptr;  // [H * d_k] or nullptr (zero)
  const float* b_k = nullptr;  // [Hkv * d_k] or nullptr
  const float* b_v = nullptr;  // [Hkv * d_k] or nullptr
  const float* b_o = nullptr;  // [d_model] or nullptr
  // Optional precomputed [w_q | w_k | w_v] as [d_model, (H + 2 Hkv) d_k] and its bias [(H + 2 Hkv) d_k] (nullptr
  // when no bias), for a fused self-attention projection; backends that want it build it when absent.
  const float* w_qkv = nullptr;
  const float* b_qkv = nullptr;
};

// A whole multi-head attention layer: project, attend, (head mask), concatenate, project.
struct MhaArgs {
  AttentionDims dims;
  AttentionMask mask;
  LayerWeights weights;
  const float* query = nullptr;  // [B, Tq, d_model]
  const float* key = nullptr;    // [B, Tk, d_kv_in]; equals query when self_attention
  const float* value = nullptr;  // [B, Tk, d_v_in]; equals query when self_attention
  bool self_attention = false;   // key and value are the query itself (allows one fused Q|K|V projection)
  absl::Span<const float> head_mask;  // empty, or H factors applied to each head's attention output
  float* out = nullptr;               // [B, Tq, d_model], written
  float* attention_weights = nullptr;  // [B, H, Tq, Tk], written when non-null
};

// A way to compute attention. Implementations need not be thread-safe: the server's scheduler runs one
// computation at a time. Errors from third-party libraries are converted to Status inside.
class Backend {
 public:
  Backend() = default;
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // Short stable name: "reference", "cpu", "cuda".
  virtual absl::string_view name() const = 0;
  // Human-readable device, e.g. the CPU model.
  virtual std::string device() const = 0;
  // True when the backend is thread-safe and quick enough on tiny problems (tens of microseconds, one thread)
  // that the server may run requests under --inline_max_mflop on the gRPC thread that received them.
  virtual bool serves_inline() const { return false; }

  // Ask before computing: OK if this backend can run a problem of these dims; UNIMPLEMENTED otherwise.
  virtual absl::Status Supports(const AttentionDims& dims) const { return absl::OkStatus(); }

  virtual absl::Status ScaledDotProductAttention(const SdpaArgs& args) = 0;
  virtual absl::Status MultiHeadAttention(const MhaArgs& args) = 0;
};

// Number of leading keys that causal (bottom-right aligned: key j is hidden from query i when
// j > i + Tk - Tq) and key_lengths leave visible to query i of batch item b: keys [0, n) may be visible (the
// additive mask can still hide some), keys >= n are not. Between 0 and Tk. Shared by every backend so the rule
// lives in one place.
inline int64_t VisibleKeyCount(const AttentionDims& dims, const AttentionMask& mask, int64_t b, int64_t i) {
  int64_t n = dims.kv_len;
  if (dims.causal) n = std::min<int64_t>(n, std::max<int64_t>(0, i + (dims.kv_len - dims.q_len) + 1));
  if (!mask.key_lengths.empty()) n = std::min<int64_t>(n, mask.key_lengths[b]);
  return n;
}

// True when key j is visible to query i under causal and key_lengths (see VisibleKeyCount).
inline bool KeyVisible(const AttentionDims& dims, const AttentionMask& mask, int64_t b, int64_t i, int64_t j) {
  return j < VisibleKeyCount(dims, mask, b, i);
}

// FLOPs of one request on these dims (multiply and add counted separately): the Q and output projections
// 2 B Tq d_model H d_k each, the K and V projections 2 B Tk (d_kv_in + d_v_in) Hkv d_k, and attention
// 4 B H Tq Tk d_k, not halved for causal (what a request may ask for). d_model 0 counts attention alone (SDPA).
inline double RequestFlops(const AttentionDims& d, int64_t d_model, int64_t d_kv_in, int64_t d_v_in) {
  const double B = static_cast<double>(d.batch), Tq = static_cast<double>(d.q_len),
               Tk = static_cast<double>(d.kv_len), H = static_cast<double>(d.num_heads),
               Hkv = static_cast<double>(d.num_kv_heads), dk = static_cast<double>(d.head_dim);
  return 4.0 * B * Tq * static_cast<double>(d_model) * H * dk +
         2.0 * B * Tk * static_cast<double>(d_kv_in + d_v_in) * Hkv * dk + 4.0 * B * H * Tq * Tk * dk;
}

// [w_q | w_k | w_v] as weights [d_model, q_width + 2 kv_width] and, when any of b_q, b_k, b_v is set, their
// concatenation as bias (absent ones as zeros; bias is left empty otherwise): the operands of a fused
// self-attention projection. Requires d_kv_in == d_v_in == d_model.
inline void FuseQkvProjection(const LayerWeights& w, int64_t q_width, int64_t kv_width, std::vector<float>* weights,
                              std::vector<float>* bias) {
  const int64_t width = q_width + 2 * kv_width;
  weights->resize(w.d_model * width);
  for (int64_t r = 0; r < w.d_model; ++r) {
    float* row = weights->data() + r * width;
    std::copy_n(w.w_q + r * q_width, q_width, row);
    std::copy_n(w.w_k + r * kv_width, kv_width, row + q_width);
    std::copy_n(w.w_v + r * kv_width, kv_width, row + q_width + kv_width);
  }
  bias->clear();
  if (w.b_q == nullptr && w.b_k == nullptr && w.b_v == nullptr) return;
  bias->assign(width, 0.0f);
  if (w.b_q) std::copy_n(w.b_q, q_width, bias->data());
  if (w.b_k) std::copy_n(w.b_k, kv_width, bias->data() + q_width);
  if (w.b_v) std::copy_n(w.b_v, kv_width, bias->data() + q_width + kv_width);
}

}  // namespace mha

#endif  // MHA_SERVER_BACKEND_H_
