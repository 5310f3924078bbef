#include "server/layers/layer.h"

#include <atomic>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

// Checks that `tensor` (named field.name) is a valid tensor of exactly `shape` with finite values; `why` says where
// the expected sizes come from.
absl::Status CheckWeight(const v1::Tensor& tensor, absl::string_view field, absl::string_view name,
                         std::vector<int64_t> shape, absl::string_view why) {
  const std::string full = absl::StrCat(field, ".", name);
  RETURN_IF_ERROR(CheckTensor(tensor, full).status());
  const std::vector<int64_t> given(tensor.shape().begin(), tensor.shape().end());
  if (given != shape) {
    // Rows that are the expected columns, and columns that are not: most likely a PyTorch nn.Linear weight, which
    // is stored [out, in] (y = x W^T); say so, since square ones pass unnoticed.
    const bool transposed = given.size() == 2 && shape.size() == 2 && given[0] == shape[1] && given[1] != shape[1];
    return absl::InvalidArgumentError(absl::StrCat(
        full, ".shape must be ", ShapeString(shape), " (", why, "), got ", ShapeString(given),
        transposed ? absl::StrCat("; its rows are the ", shape[1],
                                  " columns expected: an nn.Linear weight is stored [out, in] (y = x W^T), and the "
                                  "layer takes W [in, out] (Y = X W): send every weight matrix transposed")
                   : ""));
  }
  return CheckFinite(tensor, full);
}

// Decodes the [rows, cols] tensor `t` into rows of `dst` that are `ld` floats apart.
void DecodeRows(const v1::Tensor& t, int64_t rows, int64_t cols, float* dst, int64_t ld) {
  const size_t size = DTypeSize(t.dtype());
  for (int64_t r = 0; r < rows; ++r) DecodeToFloat(t.dtype(), t.data().data() + r * cols * size, cols, dst + r * ld);
}

}  // namespace

absl::StatusOr<LayerShape> CheckLayerWeights(const v1::AttentionWeights& w, const v1::HeadConfig& heads,
                                             absl::string_view field, const InputWidths* inputs) {
  for (const auto& [tensor, tname] : {std::pair{&w.w_q(), "w_q"}, std::pair{&w.w_k(), "w_k"},
                                      std::pair{&w.w_v(), "w_v"}, std::pair{&w.w_o(), "w_o"}}) {
    if (tensor->shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", tname, " must be a 2-d tensor [in, out], got shape ",
                                                     ShapeString(tensor->shape())));
    }
  }
  LayerShape s;
  s.d_model = inputs != nullptr ? inputs->d_model : w.w_q().shape(0);
  s.d_kv_in = inputs != nullptr ? inputs->d_kv_in : w.w_k().shape(0);
  s.d_v_in = inputs != nullptr ? inputs->d_v_in : w.w_v().shape(0);
  const std::string d_model_from =
      absl::StrCat(inputs != nullptr ? "the query's d_model, " : "d_model from w_q, ", s.d_model);
  const std::string d_kv_from =
      absl::StrCat(inputs != nullptr ? "the key's features, " : "d_kv_in from w_k, ", s.d_kv_in);
  const std::string d_v_from =
      absl::StrCat(inputs != nullptr ? "the value's features, " : "d_v_in from w_v, ", s.d_v_in);
  // H x d_k need not be d_model: with head_dim unset, w_q's columns tell d_k when they divide by num_heads.
  v1::HeadConfig resolved = heads;
  const int64_t q_columns = w.w_q().shape(1);
  const bool inferred = heads.head_dim() == 0 && heads.num_heads() > 0 && q_columns != s.d_model &&
                        q_columns % heads.num_heads() == 0 && q_columns / heads.num_heads() <= (1 << 20);
  if (inferred) resolved.set_head_dim(static_cast<int32_t>(q_columns / heads.num_heads()));
  ASSIGN_OR_RETURN(s.heads, ResolveHeads(resolved, HeadSpec(), "", s.d_model, "heads"));
  const int64_t q_width = s.heads.q_width(), kv_width = s.heads.kv_width();
  const char* head_dim_from = inferred                ? "inferred from w_q's columns"
                              : heads.head_dim() != 0 ? "from heads.head_dim"
                                                      : "d_model / num_heads; set heads.head_dim for another";
  const std::string q_cols = absl::StrCat("num_heads x head_dim = ", s.heads.num_heads, " x ", s.heads.head_dim,
                                          ", head_dim ", head_dim_from);
  const std::string kv_cols =
      absl::StrCat("num_kv_heads x head_dim = ", s.heads.num_kv_heads, " x ", s.heads.head_dim);
  RETURN_IF_ERROR(CheckWeight(w.w_q(), field, "w_q", {s.d_model, q_width},
                              absl::StrCat("rows: ", d_model_from, "; columns: ", q_cols)));
  RETURN_IF_ERROR(CheckWeight(w.w_k(), field, "w_k", {s.d_kv_in, kv_width},
                              absl::StrCat("rows: ", d_kv_from, "; columns: ", kv_cols)));
  RETURN_IF_ERROR(CheckWeight(w.w_v(), field, "w_v", {s.d_v_in, kv_width},
                              absl::StrCat("rows: ", d_v_from, "; columns: ", kv_cols)));
  RETURN_IF_ERROR(CheckWeight(w.w_o(), field, "w_o", {q_width, s.d_model},
                              absl::StrCat("rows: ", q_cols, "; columns: ", d_model_from)));
  if (w.has_b_q()) RETURN_IF_ERROR(CheckWeight(w.b_q(), field, "b_q", {q_width}, q_cols));
  if (w.has_b_k()) RETURN_IF_ERROR(CheckWeight(w.b_k(), field, "b_k", {kv_width}, kv_cols));
  if (w.has_b_v()) RETURN_IF_ERROR(CheckWeight(w.b_v(), field, "b_v", {kv_width}, kv_cols));
  if (w.has_b_o()) RETURN_IF_ERROR(CheckWeight(w.b_o(), field, "b_o", {s.d_model}, d_model_from));
  s.input_bias = w.has_b_q() || w.has_b_k() || w.has_b_v();
  s.output_bias = w.has_b_o();
  return s;
}

int64_t LayerShape::HeldBytes() const {
  const int64_t q_width = heads.q_width(), kv_width = heads.kv_width();
  const int64_t floats = d_model * q_width + (d_kv_in + d_v_in) * kv_width + q_width * d_model +
                         (input_bias ? q_width + 2 * kv_width : 0) + (output_bias ? d_model : 0);
  return floats * static_cast<int64_t>(sizeof(float));
}

std::shared_ptr<const Layer> DecodeLayer(absl::string_view name, absl::string_view source,
                                         const v1::AttentionWeights& w, const LayerShape& shape) {
  auto layer = std::make_shared<Layer>();
  layer->name = std::string(name);
  layer->source = std::string(source);
  static std::atomic<uint64_t> next_id{1};
  layer->id = source == "inline" ? 0 : next_id.fetch_add(1, std::memory_order_relaxed);
  layer->shape = shape;
  const int64_t q_width = shape.heads.q_width(), kv_width = shape.heads.kv_width();
  const int64_t width = q_width + 2 * kv_width;
  if (shape.fused_qkv()) {
    layer->w_in.resize(shape.d_model * width);
    DecodeRows(w.w_q(), shape.d_model, q_width, layer->w_in.data(), width);
    DecodeRows(w.w_k(), shape.d_model, kv_width, layer->w_in.data() + q_width, width);
    DecodeRows(w.w_v(), shape.d_model, kv_width, layer->w_in.data() + q_width + kv_width, width);
  } else {
    layer->w_in.resize(shape.d_model * q_width + (shape.d_kv_in + shape.d_v_in) * kv_width);
    float* dst = layer->w_in.data();
    DecodeRows(w.w_q(), shape.d_model, q_width, dst, q_width);
    dst += shape.d_model * q_width;
    DecodeRows(w.w_k(), shape.d_kv_in, kv_width, dst, kv_width);
    DecodeRows(w.w_v(), shape.d_v_in, kv_width, dst + shape.d_kv_in * kv_width, kv_width);
  }
  if (w.has_b_q() || w.has_b_k() || w.has_b_v()) {
    layer->b_in.assign(width, 0.0f);
    if (w.has_b_q()) DecodeToFloat(w.b_q().dtype(), w.b_q().data().data(), q_width, layer->b_in.data());
    if (w.has_b_k()) DecodeToFloat(w.b_k().dtype(), w.b_k().data().data(), kv_width, layer->b_in.data() + q_width);
    if (w.has_b_v()) {
      DecodeToFloat(w.b_v().dtype(), w.b_v().data().data(), kv_width, layer->b_in.data() + q_width + kv_width);
    }
  }
  layer->w_o = TensorToFloats(w.w_o());
  if (w.has_b_o()) layer->b_o = TensorToFloats(w.b_o());
  layer->has_bias = w.has_b_q() || w.has_b_k() || w.has_b_v() || w.has_b_o();
  return layer;
}

absl::StatusOr<std::shared_ptr<const Layer>> BuildLayer(absl::string_view name, absl::string_view source,
                                                        const v1::AttentionWeights& weights,
                                                        const v1::HeadConfig& heads, absl::string_view field) {
  ASSIGN_OR_RETURN(const LayerShape shape, CheckLayerWeights(weights, heads, field));
  return DecodeLayer(name, source, weights, shape);
}

LayerWeights Layer::Weights() const {
  const int64_t q_width = shape.heads.q_width(), kv_width = shape.heads.kv_width();
  LayerWeights w;
  w.fused_qkv = shape.fused_qkv();
  w.w_q = w_in.data();
  if (w.fused_qkv) {
    w.w_k = w.w_q + q_width;
    w.w_v = w.w_k + kv_width;
    w.ld_q = w.ld_k = w.ld_v = q_width + 2 * kv_width;
  } else {
    w.w_k = w.w_q + shape.d_model * q_width;
    w.w_v = w.w_k + shape.d_kv_in * kv_width;
    w.ld_q = q_width;
    w.ld_k = w.ld_v = kv_width;
  }
  if (!b_in.empty()) {
    w.b_q = b_in.data();
    w.b_k = w.b_q + q_width;
    w.b_v = w.b_k + kv_width;
  }
  w.w_o = w_o.data();
  w.b_o = b_o.empty() ? nullptr : b_o.data();
  w.resident_id = id;
  return w;
}

int64_t Layer::SizeBytes() const {
  return static_cast<int64_t>(w_in.size() + b_in.size() + w_o.size() + b_o.size()) *
         static_cast<int64_t>(sizeof(float));
}

v1::LayerInfo Layer::Info() const {
  v1::LayerInfo info;
  info.set_name(name);
  *info.mutable_heads() = HeadConfigOf(shape.heads);
  info.set_d_model(shape.d_model);
  info.set_d_kv_in(shape.d_kv_in);
  info.set_d_v_in(shape.d_v_in);
  info.set_has_bias(has_bias);
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
