#include "server/validate.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/status_macros.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view a, absl::string_view b = "", absl::string_view c = "",
                     absl::string_view d = "") {
  return absl::InvalidArgumentError(absl::StrCat(a, b, c, d));
}

// Checks a present tensor's encoding and rank; `what` describes the expected shape, e.g. "[B, Tq, d_model]".
absl::Status CheckRanked(const v1::Tensor& t, absl::string_view field, int rank, absl::string_view what) {
  if (t.shape_size() != rank) {
    return Invalid(field, absl::StrCat(" must have rank ", rank, " ", what, ", got shape "),
                   ShapeString(t.shape()));
  }
  return CheckTensor(t, field).status();
}

absl::Status CheckDim(const v1::Tensor& t, absl::string_view field, int axis, absl::string_view name,
                      int64_t want, absl::string_view because) {
  if (t.shape(axis) != want) {
    return Invalid(absl::StrCat(field, ".shape[", axis, "] (", name, ") must be ", want, " ", because, ", got "),
                   absl::StrCat(t.shape(axis), " (shape ", ShapeString(t.shape()), ")"));
  }
  return absl::OkStatus();
}

// a * b * ... in double: exact enough to compare against limits, and cannot overflow.
double Product(std::initializer_list<int64_t> factors) {
  double p = 1.0;
  for (int64_t f : factors) p *= static_cast<double>(f);
  return p;
}

// Masks, dtypes, backend and the response size: the parts MHA and SDPA share.
template <typename Request>
absl::Status ValidateCommon(const Request& request, const ValidationContext& context, int input_dtype,
                            int64_t output_elements, double flops, AttentionPlan* plan) {
  const AttentionDims& d = plan->dims;

  if (request.key_lengths_size() != 0) {
    if (request.key_lengths_size() != d.batch) {
      return Invalid("key_lengths must have one entry per batch item (", absl::StrCat(d.batch), "), got ",
                     absl::StrCat(request.key_lengths_size()));
    }
    for (int b = 0; b < request.key_lengths_size(); ++b) {
      const int32_t len = request.key_lengths(b);
      if (len < 0 || len > d.kv_len) {
        return Invalid(absl::StrCat("key_lengths[", b, "] must be in [0, ", d.kv_len, "] (Tk), got ", len));
      }
    }
    plan->key_lengths = absl::MakeConstSpan(request.key_lengths().data(), request.key_lengths_size());
  }

  if (request.has_attn_mask()) {
    const v1::Tensor& mask = request.attn_mask();
    RETURN_IF_ERROR(CheckTensor(mask, "attn_mask").status());
    const std::vector<int64_t> shape(mask.shape().begin(), mask.shape().end());
    const std::vector<int64_t> shared = {d.q_len, d.kv_len}, per_batch = {d.batch, d.q_len, d.kv_len};
    if (shape != shared && shape != per_batch) {
      return Invalid("attn_mask.shape must be ", ShapeString(shared), " [Tq, Tk] or ",
                     absl::StrCat(ShapeString(per_batch), " [B, Tq, Tk], got ", ShapeString(shape)));
    }
    // -inf masks a key; NaN and +inf have no meaning as an additive mask.
    const size_t size = DTypeSize(mask.dtype());
    const size_t n = mask.data().size() / size;
    for (size_t i = 0; i < n; ++i) {
      float value;
      DecodeToFloat(mask.dtype(), mask.data().data() + i * size, 1, &value);
      if (std::isnan(value) || value == std::numeric_limits<float>::infinity()) {
        return Invalid(absl::StrCat("attn_mask element ", i, " is ", value,
                                    "; only finite values and -inf are allowed"));
      }
    }
    plan->attn_mask = &mask;
    plan->mask_per_batch = shape.size() == 3;
  }

  if (!v1::DataType_IsValid(request.output_dtype())) {
    return Invalid("output_dtype must be DATA_TYPE_UNSPECIFIED, FP32, FP16 or BF16, got ",
                   absl::StrCat(request.output_dtype()));
  }
  plan->output_dtype = request.output_dtype() == v1::DATA_TYPE_UNSPECIFIED
                           ? static_cast<v1::DataType>(input_dtype)
                           : request.output_dtype();
  plan->return_weights = request.return_attention_weights();

  if (!v1::Backend_IsValid(request.backend())) {
    return Invalid("backend must be BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA or BACKEND_REFERENCE, got ",
                   absl::StrCat(request.backend()));
  }
  std::string backend_name;
  switch (request.backend()) {
    case v1::BACKEND_CPU:
      backend_name = "cpu";
      break;
    case v1::BACKEND_CUDA:
      backend_name = "cuda";
      break;
    case v1::BACKEND_REFERENCE:
      backend_name = "reference";
      break;
    default:
      backend_name = context.default_backend;
  }
  ASSIGN_OR_RETURN(plan->backend, context.backends->Find(backend_name, "backend"));
  absl::Status supported = plan->backend->Supports(d);
  if (!supported.ok()) return absl::UnimplementedError(absl::StrCat("backend ", backend_name, ": ",
                                                                     supported.message()));

  // The response must fit the message limit; say so before computing anything.
  const double out_size = static_cast<double>(DTypeSize(plan->output_dtype));
  double response_bytes = out_size * static_cast<double>(output_elements);
  if (plan->return_weights) response_bytes += out_size * Product({d.batch, d.num_heads, d.q_len, d.kv_len});
  response_bytes += 4096;  // message framing, backend name, timing
  if (response_bytes > static_cast<double>(context.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would be about ", static_cast<int64_t>(response_bytes), " bytes, over the server's ",
        context.max_message_bytes, "-byte message limit (--max_message_mb); ask for output_dtype FP16",
        plan->return_weights ? ", return_attention_weights=false" : "", " or fewer tokens"));
  }
  plan->flops = flops;
  if (flops > context.max_request_flops) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs about ", flops / 1e9, " GFLOP, over the server's per-request limit of ",
        context.max_request_flops / 1e9, " GFLOP (--max_request_gflop); send fewer tokens or a smaller batch"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadMask(const v1::MultiHeadAttentionRequest& request, MhaPlan* plan) {
  if (request.head_mask_size() == 0) return absl::OkStatus();
  if (request.head_mask_size() != plan->dims.num_heads) {
    return Invalid("head_mask must have num_heads (", absl::StrCat(plan->dims.num_heads), ") values, got ",
                   absl::StrCat(request.head_mask_size()));
  }
  for (int h = 0; h < request.head_mask_size(); ++h) {
    if (!std::isfinite(request.head_mask(h))) {
      return Invalid(absl::StrCat("head_mask[", h, "] must be finite, got ", request.head_mask(h)));
    }
  }
  plan->head_mask = absl::MakeConstSpan(request.head_mask().data(), request.head_mask_size());
  return absl::OkStatus();
}

// With a named layer, a request's non-zero head fields must match the layer's.
absl::Status CheckHeadsAgree(const v1::HeadConfig& given, const Layer& layer) {
  const HeadSpec& h = layer.heads;
  auto mismatch = [&](absl::string_view field, auto given_value, auto layer_value) {
    return Invalid(absl::StrCat("heads.", field, " is ", given_value, " but layer '", layer.name, "' has ",
                                layer_value, "; leave it 0 to use the layer's"));
  };
  if (given.num_heads() != 0 && given.num_heads() != h.num_heads) {
    return mismatch("num_heads", given.num_heads(), h.num_heads);
  }
  if (given.num_kv_heads() != 0 && given.num_kv_heads() != h.num_kv_heads) {
    return mismatch("num_kv_heads", given.num_kv_heads(), h.num_kv_heads);
  }
  if (given.head_dim() != 0 && given.head_dim() != h.head_dim) {
    return mismatch("head_dim", given.head_dim(), h.head_dim);
  }
  if (given.scale() != 0.0f && given.scale() != h.scale) return mismatch("scale", given.scale(), h.scale);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MhaPlan> ValidateMultiHeadAttention(const v1::MultiHeadAttentionRequest& request,
                                                   const ValidationContext& context) {
  MhaPlan plan;
  if (!request.has_query()) return Invalid("query is required: [B, Tq, d_model]");
  const v1::Tensor& query = request.query();
  RETURN_IF_ERROR(CheckRanked(query, "query", 3, "[B, Tq, d_model]"));
  const int64_t batch = query.shape(0), q_len = query.shape(1), d_model = query.shape(2);

  switch (request.weights_case()) {
    case v1::MultiHeadAttentionRequest::kLayer: {
      ASSIGN_OR_RETURN(plan.layer, context.layers->Get(request.layer()));
      if (request.has_heads()) RETURN_IF_ERROR(CheckHeadsAgree(request.heads(), *plan.layer));
      break;
    }
    case v1::MultiHeadAttentionRequest::kInlineWeights: {
      if (!request.has_heads()) return Invalid("heads is required with inline_weights (heads.num_heads >= 1)");
      ASSIGN_OR_RETURN(plan.layer, BuildLayer("inline", "inline", request.inline_weights(), request.heads(),
                                              "inline_weights"));
      break;
    }
    case v1::MultiHeadAttentionRequest::WEIGHTS_NOT_SET:
      return Invalid("weights: set either layer (a registered layer's name) or inline_weights");
  }
  const Layer& layer = *plan.layer;
  if (d_model != layer.d_model) {
    return Invalid(absl::StrCat("query.shape[2] (d_model) must be ", layer.d_model, " for layer '", layer.name,
                                "', got ", d_model));
  }

  // Key and value default to the query (self-attention) and to the key.
  const v1::Tensor* key = &query;
  if (request.has_key()) {
    key = &request.key();
    RETURN_IF_ERROR(CheckRanked(*key, "key", 3, "[B, Tk, d_kv_in]"));
    RETURN_IF_ERROR(CheckDim(*key, "key", 0, "B", batch, "(query's batch)"));
  }
  if (key->shape(2) != layer.d_kv_in) {
    return Invalid(absl::StrCat(request.has_key() ? "key.shape[2] (d_kv_in)" : "key (absent, so the query)",
                                " must have ", layer.d_kv_in, " features for w_k, got ", key->shape(2)));
  }
  const v1::Tensor* value = key;
  if (request.has_value()) {
    value = &request.value();
    RETURN_IF_ERROR(CheckRanked(*value, "value", 3, "[B, Tk, d_v_in]"));
    RETURN_IF_ERROR(CheckDim(*value, "value", 0, "B", batch, "(query's batch)"));
    RETURN_IF_ERROR(CheckDim(*value, "value", 1, "Tk", key->shape(1), "(key's length)"));
  }
  if (value->shape(2) != layer.d_v_in) {
    return Invalid(absl::StrCat(request.has_value() ? "value.shape[2] (d_v_in)" : "value (absent, so the key)",
                                " must have ", layer.d_v_in, " features for w_v, got ", value->shape(2)));
  }
  plan.query = &query;
  plan.key = key;
  plan.value = value;
  plan.self_attention = key == &query && value == &query;

  AttentionDims& d = plan.dims;
  d.batch = batch;
  d.q_len = q_len;
  d.kv_len = key->shape(1);
  d.num_heads = layer.heads.num_heads;
  d.num_kv_heads = layer.heads.num_kv_heads;
  d.head_dim = layer.heads.head_dim;
  d.scale = layer.heads.scale;
  d.causal = layer.heads.causal || (request.has_heads() && request.heads().causal());

  // Working memory beyond the request and response: projections and concatenated heads, and the K^T and V
  // copies the CPU backend's tile kernels read.
  const double scratch = 4.0 * (Product({batch, q_len, 2 * d.num_heads, d.head_dim}) +
                                Product({batch, d.kv_len, 4 * d.num_kv_heads, d.head_dim}));
  if (scratch > static_cast<double>(context.max_scratch_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "projections would need about ", static_cast<int64_t>(scratch), " bytes of working memory, over the ",
        context.max_scratch_bytes, "-byte limit (--max_scratch_mb); send fewer tokens or a smaller batch"));
  }
  RETURN_IF_ERROR(ValidateHeadMask(request, &plan));
  RETURN_IF_ERROR(ValidateCommon(request, context, query.dtype(), batch * q_len * d_model,
                                 RequestFlops(d, d_model, layer.d_kv_in, layer.d_v_in), &plan));
  plan.shapes = absl::StrCat("query", ShapeString(query.shape()),
                             request.has_key() ? absl::StrCat(" key", ShapeString(key->shape())) : " self",
                             " layer=", layer.name, " H=", d.num_heads, " Hkv=", d.num_kv_heads,
                             d.causal ? " causal" : "");
  return plan;
}

absl::StatusOr<SdpaPlan> ValidateScaledDotProductAttention(const v1::ScaledDotProductAttentionRequest& request,
                                                           const ValidationContext& context) {
  SdpaPlan plan;
  if (!request.has_q()) return Invalid("q is required: [B, Tq, H, d_k]");
  if (!request.has_k()) return Invalid("k is required: [B, Tk, Hkv, d_k]");
  if (!request.has_v()) return Invalid("v is required: [B, Tk, Hkv, d_k]");
  const v1::Tensor &q = request.q(), &k = request.k(), &v = request.v();
  RETURN_IF_ERROR(CheckRanked(q, "q", 4, "[B, Tq, H, d_k]"));
  RETURN_IF_ERROR(CheckRanked(k, "k", 4, "[B, Tk, Hkv, d_k]"));
  RETURN_IF_ERROR(CheckDim(k, "k", 0, "B", q.shape(0), "(q's batch)"));
  RETURN_IF_ERROR(CheckDim(k, "k", 3, "d_k", q.shape(3), "(q's head_dim)"));
  if (q.shape(2) % k.shape(2) != 0) {
    return Invalid(absl::StrCat("k.shape[2] (Hkv = ", k.shape(2), ") must divide q.shape[2] (H = ", q.shape(2),
                                ")"));
  }
  RETURN_IF_ERROR(CheckRanked(v, "v", 4, "[B, Tk, Hkv, d_k]"));
  const std::vector<int64_t> k_shape(k.shape().begin(), k.shape().end());
  const std::vector<int64_t> v_shape(v.shape().begin(), v.shape().end());
  if (k_shape != v_shape) {
    return Invalid("v.shape must equal k.shape ", ShapeString(k_shape), ", got ", ShapeString(v_shape));
  }

  AttentionDims& d = plan.dims;
  d.batch = q.shape(0);
  d.q_len = q.shape(1);
  d.num_heads = q.shape(2);
  d.head_dim = q.shape(3);
  d.kv_len = k.shape(1);
  d.num_kv_heads = k.shape(2);
  const v1::HeadConfig& heads = request.heads();
  if (heads.num_heads() != 0 && heads.num_heads() != d.num_heads) {
    return Invalid(absl::StrCat("heads.num_heads is ", heads.num_heads(), " but q.shape[2] is ", d.num_heads));
  }
  if (heads.num_kv_heads() != 0 && heads.num_kv_heads() != d.num_kv_heads) {
    return Invalid(
        absl::StrCat("heads.num_kv_heads is ", heads.num_kv_heads(), " but k.shape[2] is ", d.num_kv_heads));
  }
  if (heads.head_dim() != 0 && heads.head_dim() != d.head_dim) {
    return Invalid(absl::StrCat("heads.head_dim is ", heads.head_dim(), " but q.shape[3] is ", d.head_dim));
  }
  if (!std::isfinite(heads.scale())) {
    return Invalid(absl::StrCat("heads.scale must be finite, got ", heads.scale()));
  }
  d.scale = heads.scale() != 0.0f ? heads.scale()
                                  : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.head_dim)));
  d.causal = heads.causal();
  plan.q = &q;
  plan.k = &k;
  plan.v = &v;
  RETURN_IF_ERROR(ValidateCommon(request, context, q.dtype(), d.batch * d.q_len * d.num_heads * d.head_dim,
                                 RequestFlops(d, /*d_model=*/0, 0, 0), &plan));
  plan.shapes = absl::StrCat("q", ShapeString(q.shape()), " k", ShapeString(k.shape()), d.causal ? " causal" : "");
  return plan;
}

}  // namespace mha
