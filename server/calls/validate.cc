#include "server/calls/validate.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/base/status_macros.h"
#include "server/transport/shared_memory.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view a, absl::string_view b = "", absl::string_view c = "",
                     absl::string_view d = "") {
  return absl::InvalidArgumentError(absl::StrCat(a, b, c, d));
}

// Where `bytes` bytes of `dtype_size`-byte elements at `ref` lie; the region joins plan->regions. `field` names
// the reference, e.g. "query.shared_memory".
absl::StatusOr<char*> ResolveShared(const v1::SharedMemoryRef& ref, size_t dtype_size, uint64_t bytes,
                                    absl::string_view field, const ValidationContext& context, AttentionPlan* plan) {
  if (context.shared_memory == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(field, ": this server does not accept shared memory"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const SharedMemoryRegion> region,
                   context.shared_memory->Find(ref.region(), absl::StrCat(field, ".region")));
  if (ref.offset() % dtype_size != 0) {
    return Invalid(field, absl::StrCat(".offset must be a multiple of ", dtype_size, " (the dtype's size), got ",
                                       ref.offset()));
  }
  if (ref.offset() > region->size() || bytes > region->size() - ref.offset()) {
    return Invalid(field, absl::StrCat(": offset ", ref.offset(), " + ", bytes, " bytes passes the end of region '",
                                       region->name(), "' (", region->size(), " bytes)"));
  }
  char* data = region->data() + ref.offset();
  plan->regions.push_back(std::move(region));
  EnsureSignalStack();  // this thread reads the region next (the finiteness scan)
  return data;
}

// A present activation in shared memory: its encoding, where it lies, and its values' finiteness.
absl::Status CheckShared(const v1::Tensor& t, absl::string_view field, const ValidationContext& context,
                         AttentionPlan* plan) {
  ASSIGN_OR_RETURN(const int64_t count, CheckTensorHeader(t, field));
  if (!t.data().empty()) {
    return Invalid(field, ".data must be empty when ", field, ".shared_memory is set");
  }
  const size_t size = DTypeSize(t.dtype());
  const uint64_t bytes = static_cast<uint64_t>(count) * size;
  ASSIGN_OR_RETURN(const char* data,
                   ResolveShared(t.shared_memory(), size, bytes, absl::StrCat(field, ".shared_memory"), context, plan));
  RETURN_IF_ERROR(NonFiniteError(t, field, FirstNonFinite(t.dtype(), data, count), data));
  RETURN_IF_ERROR(plan->RegionsIntact());
  plan->shared_inputs.push_back({&t, data, bytes, plan->regions.back().get()});
  return absl::OkStatus();
}

// Checks a present tensor's encoding, rank and finite values; `what` describes the expected shape, e.g.
// "[B, Tq, d_model]". A tensor in shared memory is resolved into plan->shared_inputs.
absl::Status CheckRanked(const v1::Tensor& t, absl::string_view field, int rank, absl::string_view what,
                         const ValidationContext& context, AttentionPlan* plan) {
  if (t.shape_size() != rank) {
    return Invalid(field, absl::StrCat(" must have rank ", rank, " ", what, ", got shape "),
                   ShapeString(t.shape()));
  }
  if (t.has_shared_memory()) return CheckShared(t, field, context, plan);
  RETURN_IF_ERROR(CheckTensor(t, field).status());
  for (const FiniteScan& scan : context.finite_scans) {
    if (scan.tensor == &t && scan.dtype == t.dtype()) return NonFiniteError(t, field, scan.first_non_finite);
  }
  return CheckFinite(t, field);
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

// The activations' dtype as a backend sizes its work by: FP32 when every one is, else the first that is not.
v1::DataType InputDtype(std::initializer_list<const v1::Tensor*> tensors) {
  for (const v1::Tensor* t : tensors) {
    if (t->dtype() != v1::FP32) return t->dtype();
  }
  return v1::FP32;
}

// Whether the activations come in more than one dtype (which not every backend computes).
bool MixedDtypes(std::initializer_list<const v1::Tensor*> tensors) {
  for (const v1::Tensor* t : tensors) {
    if (t->dtype() != (*tensors.begin())->dtype()) return true;
  }
  return false;
}

// Masks, output dtype, backend, response size, work and working memory: the parts MHA and SDPA share.
// plan->problem.shape and input_dtype are set.
template <typename Request>
absl::Status ValidateCommon(const Request& request, const ValidationContext& context, v1::DataType query_dtype,
                            int64_t output_elements, AttentionPlan* plan) {
  const AttentionShape& s = plan->problem.shape;

  if (request.key_lengths_size() != 0) {
    if (request.key_lengths_size() != s.batch) {
      return Invalid("key_lengths must have one entry per batch item (", absl::StrCat(s.batch), "), got ",
                     absl::StrCat(request.key_lengths_size()));
    }
    for (int b = 0; b < request.key_lengths_size(); ++b) {
      const int32_t len = request.key_lengths(b);
      if (len < 0 || len > s.kv_len) {
        return Invalid(absl::StrCat("key_lengths[", b, "] must be in [0, ", s.kv_len, "] (Tk), got ", len));
      }
    }
    plan->key_lengths = absl::MakeConstSpan(request.key_lengths().data(), request.key_lengths_size());
  }

  if (!v1::MaskType_IsValid(request.attn_mask_type())) {
    return Invalid("attn_mask_type must be MASK_ADDITIVE or MASK_KEEP, got ", absl::StrCat(request.attn_mask_type()));
  }
  if (request.has_attn_mask()) {
    const v1::Tensor& mask = request.attn_mask();
    RETURN_IF_ERROR(CheckTensor(mask, "attn_mask").status());
    const std::vector<int64_t> shape(mask.shape().begin(), mask.shape().end());
    const std::vector<int64_t> shared = {s.q_len, s.kv_len}, per_batch = {s.batch, s.q_len, s.kv_len};
    if (shape != shared && shape != per_batch) {
      return Invalid("attn_mask.shape must be ", ShapeString(shared), " [Tq, Tk] or ",
                     absl::StrCat(ShapeString(per_batch), " [B, Tq, Tk], got ", ShapeString(shape)));
    }
    plan->attn_mask = &mask;
    plan->attn_mask_keep = request.attn_mask_type() == v1::MASK_KEEP;
  }

  if (IsCacheOnlyDType(request.output_dtype())) {
    return Invalid("output_dtype ", DTypeName(request.output_dtype()),
                   " is for KV caches only (CreateSessionRequest.cache_dtype); outputs are FP32, FP16 or BF16");
  }
  if (!v1::DataType_IsValid(request.output_dtype())) {
    return Invalid("output_dtype must be DATA_TYPE_UNSPECIFIED, FP32, FP16 or BF16, got ",
                   absl::StrCat(request.output_dtype()));
  }
  plan->problem.output_dtype =
      request.output_dtype() == v1::DATA_TYPE_UNSPECIFIED ? query_dtype : request.output_dtype();
  plan->problem.return_weights = request.return_attention_weights();
  ASSIGN_OR_RETURN(plan->stats, ValidateStats(request.return_lse(), request.return_head_stats(),
                                              request.sink_tokens(), request.return_row_stats()));
  plan->problem.return_stats = plan->stats.any();

  ASSIGN_OR_RETURN(plan->backend,
                   ChooseBackend(request.backend(), context,
                                 [plan](const Backend& backend) { return backend.Supports(plan->problem); }));

  // The response must fit the message limit; say so before computing anything.
  const double out_size = static_cast<double>(DTypeSize(plan->problem.output_dtype));
  double response_bytes = out_size * static_cast<double>(output_elements);
  if (request.has_output_shared_memory()) {
    const uint64_t bytes = static_cast<uint64_t>(output_elements) * DTypeSize(plan->problem.output_dtype);
    ASSIGN_OR_RETURN(plan->output_to, ResolveShared(request.output_shared_memory(),
                                                    DTypeSize(plan->problem.output_dtype), bytes,
                                                    "output_shared_memory", context, plan));
    plan->output_ref = &request.output_shared_memory();
    // Compared as places in the objects, so that one object registered under two names is still one place.
    const SharedMemoryRegion& out_region = *plan->regions.back();
    const uint64_t out = request.output_shared_memory().offset();
    for (const AttentionPlan::SharedInput& input : plan->shared_inputs) {
      const uint64_t in = static_cast<uint64_t>(input.data - input.region->data());
      if (input.region->object() == out_region.object() && out < in + input.bytes && in < out + bytes) {
        return Invalid("output_shared_memory must not overlap the shared memory of an input");
      }
    }
    response_bytes = 0;  // the output's bytes do not travel in the response
  }
  if (plan->problem.return_weights) {
    response_bytes += out_size * Product({s.batch, s.heads.num_heads, s.q_len, s.kv_len});
  }
  response_bytes += static_cast<double>(s.batch) * plan->stats.ResponseBytes(s.heads.num_heads, s.q_len);
  response_bytes += 4096;  // message framing, backend name, timing
  plan->response_bytes = static_cast<int64_t>(std::min(response_bytes, 9e18));
  if (response_bytes > static_cast<double>(context.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would be about ", static_cast<int64_t>(response_bytes), " bytes, over the server's ",
        context.max_message_bytes, "-byte message limit (--max_message_mb); ask for output_dtype FP16",
        plan->problem.return_weights ? ", return_attention_weights=false" : "", " or fewer tokens"));
  }
  plan->flops = AttentionFlops(s);
  plan->workspace_bytes = plan->backend->WorkspaceBytes(plan->problem) +
                          plan->stats.WorkspaceBytes(s.heads.num_heads, s.batch * s.q_len);
  return CheckWorkLimits(*plan, context);
}

}  // namespace

absl::StatusOr<StatsRequest> ValidateStats(bool lse, bool head_stats, int32_t sink_tokens, bool row_stats) {
  constexpr int32_t kMaxSinkTokens = 1 << 20;
  if (sink_tokens < 0 || sink_tokens > kMaxSinkTokens) {
    return Invalid(absl::StrCat("sink_tokens must be in [0, ", kMaxSinkTokens, "] (0 means 4), got ", sink_tokens));
  }
  if (row_stats && !head_stats) return Invalid("return_row_stats needs return_head_stats");
  StatsRequest stats;
  stats.lse = lse;
  stats.head_stats = head_stats;
  stats.row_stats = row_stats;
  stats.sink_tokens = sink_tokens == 0 ? 4 : sink_tokens;
  return stats;
}

absl::StatusOr<Backend*> ChooseBackend(int requested, const ValidationContext& context,
                                       absl::FunctionRef<absl::Status(const Backend&)> supports) {
  if (!v1::Backend_IsValid(requested)) {
    return Invalid("backend must be BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA or BACKEND_REFERENCE, got ",
                   absl::StrCat(requested));
  }
  const v1::Backend wanted = static_cast<v1::Backend>(requested);
  const std::string name = context.backends->NameFor(wanted);
  ASSIGN_OR_RETURN(Backend * backend, context.backends->Find(name, "backend"));
  absl::Status supported = supports(*backend);
  if (supported.ok()) return backend;
  if (wanted == v1::BACKEND_AUTO && name != kCpuBackend) {
    // BACKEND_AUTO routes what the default backend cannot compute to the CPU.
    absl::StatusOr<Backend*> cpu = context.backends->Find(kCpuBackend, "backend");
    if (cpu.ok() && supports(**cpu).ok()) return *cpu;
  }
  return absl::UnimplementedError(absl::StrCat("backend ", name, ": ", supported.message()));
}

absl::Status CheckWorkLimits(const AttentionPlan& plan, const ValidationContext& context) {
  const std::string backend_name(plan.backend->name());
  const bool reference = backend_name == kReferenceBackend;
  const double max_flops = reference ? context.max_reference_flops : context.max_request_flops;
  if (plan.flops > max_flops) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs about ", plan.flops / 1e9, " GFLOP, over the server's per-request limit of ",
        max_flops / 1e9, " GFLOP on the ", backend_name, " backend (",
        reference ? "--max_reference_gflop" : "--max_request_gflop", "); send fewer tokens or a smaller batch"));
  }
  if (plan.workspace_bytes > context.max_scratch_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the ", backend_name, " backend would need about ", plan.workspace_bytes, " bytes of working memory, over the ",
        context.max_scratch_bytes, "-byte limit (--max_scratch_mb); send fewer tokens or a smaller batch"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidateHeadMask(const v1::MultiHeadAttentionRequest& request, MhaPlan* plan) {
  if (request.head_mask_size() == 0) return absl::OkStatus();
  const int64_t heads = plan->problem.shape.heads.num_heads;
  if (request.head_mask_size() != heads) {
    return Invalid("head_mask must have num_heads (", absl::StrCat(heads), ") values, got ",
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

// The weights a MultiHeadAttention request names: a registered layer (context.layer when its front door resolved it)
// with the request's heads resolved against the layer's, or inline weights checked against the inputs' widths.
// Sets *layer (what the weights fix), *layer_name (for errors) and the plan's layer or inline weights.
absl::Status ResolveWeights(const v1::MultiHeadAttentionRequest& request, const ValidationContext& context,
                            int64_t d_model, MhaPlan* plan, LayerShape* layer, std::string* layer_name) {
  switch (request.weights_case()) {
    case v1::MultiHeadAttentionRequest::kLayer: {
      if (context.layer != nullptr) {
        plan->layer = context.layer;
      } else {
        ASSIGN_OR_RETURN(plan->layer, context.layers->Get(request.layer()));
      }
      *layer = plan->layer->shape;
      *layer_name = plan->layer->name;
      // Non-zero request fields must agree with the layer's; causal = layer.causal OR heads.causal.
      if (request.has_heads()) {
        const std::string known_from = absl::StrCat("layer '", *layer_name, "'");
        ASSIGN_OR_RETURN(layer->heads,
                         ResolveHeads(request.heads(), layer->heads, known_from, layer->d_model, "heads"));
      }
      break;
    }
    case v1::MultiHeadAttentionRequest::kInlineWeights: {
      if (!request.has_heads()) return Invalid("heads is required with inline_weights (heads.num_heads >= 1)");
      // The inputs set the widths the weights must have: the query's d_model, the key's and the value's features.
      InputWidths inputs;
      inputs.d_model = d_model;
      inputs.d_kv_in = request.has_key() && request.key().shape_size() == 3 ? request.key().shape(2) : d_model;
      inputs.d_v_in = request.has_value() && request.value().shape_size() == 3 ? request.value().shape(2)
                                                                                 : inputs.d_kv_in;
      ASSIGN_OR_RETURN(*layer,
                       CheckLayerWeights(request.inline_weights(), request.heads(), "inline_weights", &inputs));
      plan->inline_weights = &request.inline_weights();
      plan->inline_shape = *layer;
      *layer_name = "inline";
      break;
    }
    case v1::MultiHeadAttentionRequest::WEIGHTS_NOT_SET:
      return Invalid("weights: set either layer (a registered layer's name) or inline_weights");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MhaPlan> ValidateMultiHeadAttention(const v1::MultiHeadAttentionRequest& request,
                                                   const ValidationContext& context) {
  MhaPlan plan;
  if (!request.has_query()) return Invalid("query is required: [B, Tq, d_model]");
  const v1::Tensor& query = request.query();
  RETURN_IF_ERROR(CheckRanked(query, "query", 3, "[B, Tq, d_model]", context, &plan));
  const int64_t batch = query.shape(0), q_len = query.shape(1), d_model = query.shape(2);

  LayerShape layer;
  std::string layer_name;
  RETURN_IF_ERROR(ResolveWeights(request, context, d_model, &plan, &layer, &layer_name));
  if (d_model != layer.d_model) {
    return Invalid(absl::StrCat("query.shape[2] (d_model) must be ", layer.d_model, " for layer '", layer_name,
                                "', got ", d_model));
  }

  // Key and value default to the query (self-attention) and to the key.
  const v1::Tensor* key = &query;
  if (request.has_key()) {
    key = &request.key();
    RETURN_IF_ERROR(CheckRanked(*key, "key", 3, "[B, Tk, d_kv_in]", context, &plan));
    RETURN_IF_ERROR(CheckDim(*key, "key", 0, "B", batch, "(query's batch)"));
  }
  if (key->shape(2) != layer.d_kv_in) {
    return Invalid(absl::StrCat(request.has_key() ? "key.shape[2] (d_kv_in)" : "key (absent, so the query)",
                                " must have ", layer.d_kv_in, " features for w_k, got ", key->shape(2)));
  }
  const v1::Tensor* value = key;
  if (request.has_value()) {
    value = &request.value();
    RETURN_IF_ERROR(CheckRanked(*value, "value", 3, "[B, Tk, d_v_in]", context, &plan));
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
  plan.kv_source = !request.has_key() && !request.has_value() ? KvSource::kQuery
                   : !request.has_value()                     ? KvSource::kKey
                                                              : KvSource::kKeyValue;

  AttentionShape& s = plan.problem.shape;
  s.batch = batch;
  s.q_len = q_len;
  s.kv_len = key->shape(1);
  s.d_model = layer.d_model;
  s.d_kv_in = layer.d_kv_in;
  s.d_v_in = layer.d_v_in;
  s.heads = layer.heads;
  plan.problem.input_dtype = InputDtype({&query, key, value});
  plan.problem.mixed_inputs = MixedDtypes({&query, key, value});
  RETURN_IF_ERROR(ValidateHeadMask(request, &plan));
  RETURN_IF_ERROR(ValidateCommon(request, context, query.dtype(), batch * q_len * d_model, &plan));
  if (plan.layer != nullptr && plan.kv_source == KvSource::kQuery && !request.has_attn_mask() && !plan.stats.any() &&
      plan.head_mask.empty() && plan.shared_inputs.empty() && plan.output_to == nullptr) {
    plan.batch_key = absl::StrCat("mha|", reinterpret_cast<uintptr_t>(plan.backend), "|",
                                  reinterpret_cast<uintptr_t>(plan.layer.get()), "|", q_len, "|", query.dtype(), "|",
                                  plan.problem.output_dtype, "|", plan.problem.return_weights, "|", s.heads.causal,
                                  "|", RopeKey(s.heads));
  }
  plan.shapes = absl::StrCat("query", ShapeString(query.shape()),
                             request.has_key() ? absl::StrCat(" key", ShapeString(key->shape())) : " self",
                             " layer=", layer_name, " H=", s.heads.num_heads, " Hkv=", s.heads.num_kv_heads,
                             s.heads.causal ? " causal" : "");
  return plan;
}

absl::StatusOr<SdpaPlan> ValidateScaledDotProductAttention(const v1::ScaledDotProductAttentionRequest& request,
                                                           const ValidationContext& context) {
  SdpaPlan plan;
  if (!request.has_q()) return Invalid("q is required: [B, Tq, H, d_k]");
  if (!request.has_k()) return Invalid("k is required: [B, Tk, Hkv, d_k]");
  if (!request.has_v()) return Invalid("v is required: [B, Tk, Hkv, d_k]");
  const v1::Tensor &q = request.q(), &k = request.k(), &v = request.v();
  RETURN_IF_ERROR(CheckRanked(q, "q", 4, "[B, Tq, H, d_k]", context, &plan));
  RETURN_IF_ERROR(CheckRanked(k, "k", 4, "[B, Tk, Hkv, d_k]", context, &plan));
  RETURN_IF_ERROR(CheckDim(k, "k", 0, "B", q.shape(0), "(q's batch)"));
  RETURN_IF_ERROR(CheckDim(k, "k", 3, "d_k", q.shape(3), "(q's head_dim)"));
  if (q.shape(2) % k.shape(2) != 0) {
    return Invalid(absl::StrCat("k.shape[2] (Hkv = ", k.shape(2), ") must divide q.shape[2] (H = ", q.shape(2),
                                ")"));
  }
  RETURN_IF_ERROR(CheckRanked(v, "v", 4, "[B, Tk, Hkv, d_k]", context, &plan));
  const std::vector<int64_t> k_shape(k.shape().begin(), k.shape().end());
  const std::vector<int64_t> v_shape(v.shape().begin(), v.shape().end());
  if (k_shape != v_shape) {
    return Invalid("v.shape must equal k.shape ", ShapeString(k_shape), ", got ", ShapeString(v_shape));
  }

  AttentionShape& s = plan.problem.shape;
  s.batch = q.shape(0);
  s.q_len = q.shape(1);
  s.kv_len = k.shape(1);
  HeadSpec from_shapes;
  from_shapes.num_heads = q.shape(2);
  from_shapes.num_kv_heads = k.shape(2);
  from_shapes.head_dim = q.shape(3);
  ASSIGN_OR_RETURN(s.heads, ResolveHeads(request.heads(), from_shapes, "the q and k shapes", /*d_model=*/0, "heads"));
  plan.problem.input_dtype = InputDtype({&q, &k, &v});
  plan.problem.mixed_inputs = MixedDtypes({&q, &k, &v});
  plan.q = &q;
  plan.k = &k;
  plan.v = &v;
  RETURN_IF_ERROR(ValidateCommon(request, context, q.dtype(), s.batch * s.q_len * s.heads.q_width(), &plan));
  plan.shapes =
      absl::StrCat("q", ShapeString(q.shape()), " k", ShapeString(k.shape()), s.heads.causal ? " causal" : "");
  return plan;
}

}  // namespace mha
