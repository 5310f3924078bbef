#include "server/layer.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/status_macros.h"

namespace mha {
namespace {

// Checks that `tensor` (named field.name) is a valid tensor of exactly `shape`.
absl::Status CheckWeight(const v1::Tensor& tensor, absl::string_view field, absl::string_view name,
                         std::vector<int64_t> shape) {
  const std::string full = absl::StrCat(field, ".", name);
  RETURN_IF_ERROR(CheckTensor(tensor, full).status());
  const std::vector<int64_t> given(tensor.shape().begin(), tensor.shape().end());
  if (given != shape) {
    return absl::InvalidArgumentError(absl::StrCat(full, ".shape must be ", ShapeString(shape), ", got ",
                                                   ShapeString(given)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HeadSpec> ResolveHeads(const v1::HeadConfig& c, int64_t d_model, absl::string_view field) {
  HeadSpec h;
  if (c.num_heads() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".num_heads must be >= 1, got ", c.num_heads()));
  }
  h.num_heads = c.num_heads();
  if (c.num_kv_heads() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".num_kv_heads must be >= 0 (0 means num_heads), got ", c.num_kv_heads()));
  }
  h.num_kv_heads = c.num_kv_heads() == 0 ? h.num_heads : c.num_kv_heads();
  if (h.num_kv_heads > h.num_heads || h.num_heads % h.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".num_kv_heads (", h.num_kv_heads,
                                                   ") must divide num_heads (", h.num_heads, ")"));
  }
  if (c.head_dim() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".head_dim must be >= 0 (0 means d_model / num_heads), got ", c.head_dim()));
  }
  if (c.head_dim() == 0) {
    if (d_model % h.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".head_dim is 0, so d_model (", d_model,
                                                     ") must be divisible by num_heads (", h.num_heads,
                                                     "); set head_dim explicitly otherwise"));
    }
    h.head_dim = d_model / h.num_heads;
  } else {
    h.head_dim = c.head_dim();
  }
  if (!std::isfinite(c.scale())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".scale must be finite, got ", c.scale()));
  }
  h.scale = c.scale() == 0.0f ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(h.head_dim))) : c.scale();
  h.causal = c.causal();
  return h;
}

absl::StatusOr<std::shared_ptr<const Layer>> BuildLayer(absl::string_view name, absl::string_view source,
                                                        const v1::AttentionWeights& w,
                                                        const v1::HeadConfig& heads, absl::string_view field) {
  for (const auto& [tensor, tname] : {std::pair{&w.w_q(), "w_q"}, std::pair{&w.w_k(), "w_k"},
                                      std::pair{&w.w_v(), "w_v"}, std::pair{&w.w_o(), "w_o"}}) {
    if (tensor->shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", tname, " must be a 2-d tensor [in, out], got shape ",
                                                     ShapeString(tensor->shape())));
    }
  }
  auto layer = std::make_shared<Layer>();
  layer->name = std::string(name);
  layer->source = std::string(source);
  layer->d_model = w.w_q().shape(0);
  layer->d_kv_in = w.w_k().shape(0);
  layer->d_v_in = w.w_v().shape(0);
  ASSIGN_OR_RETURN(layer->heads, ResolveHeads(heads, layer->d_model, "heads"));
  const HeadSpec& h = layer->heads;
  const int64_t q_width = h.num_heads * h.head_dim, kv_width = h.num_kv_heads * h.head_dim;
  RETURN_IF_ERROR(CheckWeight(w.w_q(), field, "w_q", {layer->d_model, q_width}));
  RETURN_IF_ERROR(CheckWeight(w.w_k(), field, "w_k", {layer->d_kv_in, kv_width}));
  RETURN_IF_ERROR(CheckWeight(w.w_v(), field, "w_v", {layer->d_v_in, kv_width}));
  RETURN_IF_ERROR(CheckWeight(w.w_o(), field, "w_o", {q_width, layer->d_model}));
  if (w.has_b_q()) RETURN_IF_ERROR(CheckWeight(w.b_q(), field, "b_q", {q_width}));
  if (w.has_b_k()) RETURN_IF_ERROR(CheckWeight(w.b_k(), field, "b_k", {kv_width}));
  if (w.has_b_v()) RETURN_IF_ERROR(CheckWeight(w.b_v(), field, "b_v", {kv_width}));
  if (w.has_b_o()) RETURN_IF_ERROR(CheckWeight(w.b_o(), field, "b_o", {layer->d_model}));

  layer->w_q = TensorToFloats(w.w_q());
  layer->w_k = TensorToFloats(w.w_k());
  layer->w_v = TensorToFloats(w.w_v());
  layer->w_o = TensorToFloats(w.w_o());
  if (w.has_b_q()) layer->b_q = TensorToFloats(w.b_q());
  if (w.has_b_k()) layer->b_k = TensorToFloats(w.b_k());
  if (w.has_b_v()) layer->b_v = TensorToFloats(w.b_v());
  if (w.has_b_o()) layer->b_o = TensorToFloats(w.b_o());

  // Precompute [w_q | w_k | w_v] for the fused self-attention projection of registered layers (inline weights
  // serve one request: the backend fuses them itself if it wants to).
  if (source != "inline" && layer->d_kv_in == layer->d_model && layer->d_v_in == layer->d_model) {
    FuseQkvProjection(layer->Weights(), q_width, kv_width, &layer->w_qkv, &layer->b_qkv);
  }
  return std::shared_ptr<const Layer>(std::move(layer));
}

LayerWeights Layer::Weights() const {
  auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  LayerWeights w;
  w.d_model = d_model;
  w.d_kv_in = d_kv_in;
  w.d_v_in = d_v_in;
  w.w_q = w_q.data();
  w.w_k = w_k.data();
  w.w_v = w_v.data();
  w.w_o = w_o.data();
  w.b_q = ptr(b_q);
  w.b_k = ptr(b_k);
  w.b_v = ptr(b_v);
  w.b_o = ptr(b_o);
  w.w_qkv = ptr(w_qkv);
  w.b_qkv = ptr(b_qkv);
  return w;
}

int64_t Layer::SizeBytes() const {
  int64_t n = 0;
  for (const auto* v : {&w_q, &w_k, &w_v, &w_o, &b_q, &b_k, &b_v, &b_o, &w_qkv, &b_qkv}) n += v->size();
  return n * static_cast<int64_t>(sizeof(float));
}

v1::LayerInfo Layer::Info() const {
  v1::LayerInfo info;
  info.set_name(name);
  v1::HeadConfig* h = info.mutable_heads();
  h->set_num_heads(static_cast<int32_t>(heads.num_heads));
  h->set_num_kv_heads(static_cast<int32_t>(heads.num_kv_heads));
  h->set_head_dim(static_cast<int32_t>(heads.head_dim));
  h->set_causal(heads.causal);
  h->set_scale(heads.scale);
  info.set_d_model(d_model);
  info.set_d_kv_in(d_kv_in);
  info.set_d_v_in(d_v_in);
  info.set_has_bias(!b_q.empty() || !b_k.empty() || !b_v.empty() || !b_o.empty());
  info.set_source(source);
  info.set_size_bytes(SizeBytes());
  return info;
}

std::shared_ptr<const Layer> MakeDemoLayer() {
  constexpr int64_t kDModel = 512, kHeads = 8;
  std::mt19937 rng(20261129);
  const float bound = 1.0f / std::sqrt(static_cast<float>(kDModel));
  std::uniform_real_distribution<float> uniform(-bound, bound);
  auto random_tensor = [&](int64_t rows, int64_t cols, v1::Tensor* t) {
    std::vector<float> values(rows * cols);
    for (float& x : values) x = uniform(rng);
    FloatsToTensor(values, {rows, cols}, v1::FP32, t);
  };
  v1::AttentionWeights w;
  random_tensor(kDModel, kDModel, w.mutable_w_q());
  random_tensor(kDModel, kDModel, w.mutable_w_k());
  random_tensor(kDModel, kDModel, w.mutable_w_v());
  random_tensor(kDModel, kDModel, w.mutable_w_o());
  v1::HeadConfig heads;
  heads.set_num_heads(kHeads);
  absl::StatusOr<std::shared_ptr<const Layer>> layer = BuildLayer("demo", "builtin", w, heads, "demo");
  return *layer;  // cannot fail: the shapes above are consistent by construction
}

}  // namespace mha
