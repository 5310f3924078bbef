#include "server/execute.h"

#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

ConstTensor View(const v1::Tensor& t) { return {t.data().data(), t.dtype()}; }

// Shapes `tensor` as `shape` in `dtype` with room for its bytes, and returns a view the backend writes into.
MutableTensor Allocate(v1::Tensor* tensor, std::initializer_list<int64_t> shape, v1::DataType dtype) {
  int64_t count = 1;
  tensor->Clear();
  for (int64_t d : shape) {
    tensor->add_shape(d);
    count *= d;
  }
  tensor->set_dtype(dtype);
  std::string* bytes = tensor->mutable_data();
  bytes->resize(count * DTypeSize(dtype));
  return {bytes->data(), dtype};
}

// The mask as additive fp32, checked while decoding: an additive mask's -inf masks a key, NaN and +inf have no
// meaning; a boolean (MASK_KEEP) mask's 1 becomes 0 and its 0 becomes -inf, and any other value has no meaning.
absl::Status DecodeMask(const AttentionPlan& plan, std::vector<float>* values, AttentionMask* mask) {
  mask->key_lengths = plan.key_lengths;
  if (plan.attn_mask == nullptr) return absl::OkStatus();
  *values = TensorToFloats(*plan.attn_mask);
  for (size_t i = 0; i < values->size(); ++i) {
    float& x = (*values)[i];
    if (plan.attn_mask_keep) {
      if (x != 0.0f && x != 1.0f) {
        return absl::InvalidArgumentError(absl::StrCat("attn_mask element ", i, " is ", x,
                                                       "; with MASK_KEEP every value must be 1 (attends) or 0 "
                                                       "(masked)"));
      }
      x = x == 1.0f ? 0.0f : -std::numeric_limits<float>::infinity();
    } else if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
      return absl::InvalidArgumentError(
          absl::StrCat("attn_mask element ", i, " is ", x, "; only finite values and -inf are allowed"));
    }
  }
  mask->additive = values->data();
  mask->additive_per_batch = plan.attn_mask->shape_size() == 3;
  return absl::OkStatus();
}

}  // namespace

absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, const StopSignal* stop,
                                       v1::MultiHeadAttentionResponse* response) {
  const AttentionProblem& p = plan.problem;
  const AttentionShape& s = p.shape;
  std::vector<float> additive;
  MhaArgs args;
  if (absl::Status status = DecodeMask(plan, &additive, &args.mask); !status.ok()) return status;
  std::shared_ptr<const Layer> layer = plan.layer;
  if (layer == nullptr) layer = DecodeLayer("inline", "inline", *plan.inline_weights, plan.inline_shape);

  args.shape = s;
  args.stop = stop;
  args.weights = layer->Weights();
  args.kv_source = plan.kv_source;
  args.query = View(*plan.query);
  args.key = View(*plan.key);
  args.value = View(*plan.value);
  args.head_mask = plan.head_mask;
  args.out = Allocate(response->mutable_output(), {s.batch, s.q_len, s.d_model}, p.output_dtype);
  if (p.return_weights) {
    args.attention_weights = Allocate(response->mutable_attention_weights(),
                                      {s.batch, s.heads.num_heads, s.q_len, s.kv_len}, p.output_dtype);
  }
  response->set_backend(std::string(plan.backend->name()));
  return plan.backend->MultiHeadAttention(args);
}

absl::Status ExecuteMultiHeadAttentionBatch(absl::Span<const MhaPlan* const> plans, const StopSignal* stop,
                                            absl::Span<v1::MultiHeadAttentionResponse* const> responses) {
  const MhaPlan& first = *plans.front();
  const AttentionProblem& p = first.problem;
  const v1::DataType input_dtype = first.query->dtype();
  // The batch's inputs one after another along B: the same layer, lengths and dtypes by the batch key.
  AttentionShape s = p.shape;
  s.batch = 0;
  std::string query;
  bool any_lengths = false;
  for (const MhaPlan* plan : plans) {
    s.batch += plan->problem.shape.batch;
    any_lengths |= !plan->key_lengths.empty();
  }
  query.reserve(s.batch * s.q_len * s.d_model * DTypeSize(input_dtype));
  std::vector<int32_t> key_lengths;
  for (const MhaPlan* plan : plans) {
    query.append(plan->query->data());
    if (!any_lengths) continue;
    if (plan->key_lengths.empty()) {
      key_lengths.insert(key_lengths.end(), plan->problem.shape.batch, static_cast<int32_t>(s.kv_len));
    } else {
      key_lengths.insert(key_lengths.end(), plan->key_lengths.begin(), plan->key_lengths.end());
    }
  }
  const size_t out_size = DTypeSize(p.output_dtype);
  const int64_t out_per_item = s.q_len * s.d_model, weights_per_item = s.heads.num_heads * s.q_len * s.kv_len;
  std::string out(s.batch * out_per_item * out_size, '\0'), weights;
  MhaArgs args;
  args.shape = s;
  args.stop = stop;
  args.mask.key_lengths = key_lengths;
  args.weights = first.layer->Weights();
  args.kv_source = KvSource::kQuery;
  args.query = args.key = args.value = {query.data(), input_dtype};
  args.out = {out.data(), p.output_dtype};
  if (p.return_weights) {
    weights.resize(s.batch * weights_per_item * out_size);
    args.attention_weights = {weights.data(), p.output_dtype};
  }
  if (absl::Status status = first.backend->MultiHeadAttention(args); !status.ok()) return status;

  // Each call's slice of the outputs into its response.
  int64_t b0 = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    const int64_t batch = plans[i]->problem.shape.batch;
    v1::MultiHeadAttentionResponse* response = responses[i];
    MutableTensor slice = Allocate(response->mutable_output(), {batch, s.q_len, s.d_model}, p.output_dtype);
    std::memcpy(slice.data, out.data() + b0 * out_per_item * out_size, batch * out_per_item * out_size);
    if (p.return_weights) {
      slice = Allocate(response->mutable_attention_weights(), {batch, s.heads.num_heads, s.q_len, s.kv_len},
                       p.output_dtype);
      std::memcpy(slice.data, weights.data() + b0 * weights_per_item * out_size, batch * weights_per_item * out_size);
    }
    response->set_backend(std::string(first.backend->name()));
    b0 += batch;
  }
  return absl::OkStatus();
}

absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan, const StopSignal* stop,
                                              v1::ScaledDotProductAttentionResponse* response) {
  const AttentionProblem& p = plan.problem;
  const AttentionShape& s = p.shape;
  std::vector<float> additive;
  SdpaArgs args;
  if (absl::Status status = DecodeMask(plan, &additive, &args.mask); !status.ok()) return status;
  args.shape = s;
  args.stop = stop;
  args.q = View(*plan.q);
  args.k = View(*plan.k);
  args.v = View(*plan.v);
  args.out = Allocate(response->mutable_output(), {s.batch, s.q_len, s.heads.num_heads, s.heads.head_dim},
                      p.output_dtype);
  if (p.return_weights) {
    args.weights = Allocate(response->mutable_attention_weights(), {s.batch, s.heads.num_heads, s.q_len, s.kv_len},
                            p.output_dtype);
  }
  response->set_backend(std::string(plan.backend->name()));
  return plan.backend->ScaledDotProductAttention(args);
}

}  // namespace mha
