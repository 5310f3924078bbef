#include "server/calls/execute.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/calls/head_stats.h"
#include "server/transport/shared_memory.h"

namespace mha {
namespace {

ConstTensor View(const AttentionPlan& plan, const v1::Tensor& t) { return {plan.Data(t), t.dtype()}; }

// Makes `tensor` response field `field`, shaped `shape` in `dtype`, with a fresh slice for its bytes; returns the
// view the backend writes into.
MutableTensor Allocate(int field, std::initializer_list<int64_t> shape, v1::DataType dtype, TensorBytes* tensor) {
  int64_t count = 1;
  tensor->field = field;
  tensor->header.Clear();
  for (int64_t d : shape) {
    tensor->header.add_shape(d);
    count *= d;
  }
  tensor->header.set_dtype(dtype);
  char* bytes = nullptr;
  tensor->data = NewTensorSlice(count * DTypeSize(dtype), &bytes);
  return {bytes, dtype};
}

constexpr int kOutputField = 1, kWeightsField = 2;  // in both responses

// The output: into plan.output_to when the request gave shared memory for it (the response's output then carries
// the shape, the dtype and the reference), else into a fresh slice of the response.
template <typename Response>
MutableTensor AllocateOutput(const AttentionPlan& plan, std::initializer_list<int64_t> shape,
                             Reply<Response>* reply) {
  const v1::DataType dtype = plan.problem.output_dtype;
  if (plan.output_to == nullptr) return Allocate(kOutputField, shape, dtype, &reply->output);
  v1::Tensor* output = reply->message.mutable_output();
  for (int64_t d : shape) output->add_shape(d);
  output->set_dtype(dtype);
  *output->mutable_shared_memory() = *plan.output_ref;
  reply->output.field = 0;
  return {plan.output_to, dtype};
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

// The response's lse, head_stats and row_stats from what the backend wrote into `stats`, with the keys each row
// sees under `mask` (normalized entropy's denominator).
template <typename Message>
void FillStats(const AttentionShape& s, const AttentionMask& mask, const StatsBuffers& stats, Message* message) {
  const int64_t Tq = s.q_len, Tk = s.kv_len;
  const auto visible = [&](int64_t b, int64_t i) {
    const int64_t n = VisibleKeyCount(s, mask, b, i);
    if (mask.additive == nullptr) return n;
    const float* row = mask.additive + (mask.additive_per_batch ? b * Tq * Tk : 0) + i * Tk;
    int64_t count = 0;
    for (int64_t j = 0; j < n; ++j) count += row[j] != -std::numeric_limits<float>::infinity() ? 1 : 0;
    return count;
  };
  stats.FillInto(visible, /*batched=*/true, message);
}

}  // namespace

absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, const StopSignal* stop, MhaReply* reply) {
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
  args.query = View(plan, *plan.query);
  args.key = View(plan, *plan.key);
  args.value = View(plan, *plan.value);
  args.head_mask = plan.head_mask;
  args.out = AllocateOutput(plan, {s.batch, s.q_len, s.d_model}, reply);
  if (p.return_weights) {
    args.attention_weights = Allocate(kWeightsField, {s.batch, s.heads.num_heads, s.q_len, s.kv_len},
                                      p.output_dtype, &reply->attention_weights);
  }
  StatsBuffers stats(plan.stats, s.batch, s.heads.num_heads, s.q_len, /*has_w_o=*/true);
  args.stats = stats.View();
  reply->message.set_backend(std::string(plan.backend->name()));
  if (!plan.regions.empty()) PrepareThreadsForRegions();
  if (absl::Status status = plan.backend->MultiHeadAttention(args); !status.ok()) return status;
  FillStats(s, args.mask, stats, &reply->message);
  return plan.RegionsIntact();
}

absl::Status ExecuteMultiHeadAttentionBatch(absl::Span<const MhaPlan* const> plans, const StopSignal* stop,
                                            absl::Span<MhaReply* const> replies) {
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
  // The batch's outputs in one slice each; every call's reply takes its rows as a sub-slice of it, uncopied.
  TensorBytes out, weights;
  MhaArgs args;
  args.shape = s;
  args.stop = stop;
  args.mask.key_lengths = key_lengths;
  args.weights = first.layer->Weights();
  args.kv_source = KvSource::kQuery;
  args.query = args.key = args.value = {query.data(), input_dtype};
  args.out = Allocate(kOutputField, {s.batch, s.q_len, s.d_model}, p.output_dtype, &out);
  if (p.return_weights) {
    args.attention_weights =
        Allocate(kWeightsField, {s.batch, s.heads.num_heads, s.q_len, s.kv_len}, p.output_dtype, &weights);
  }
  if (absl::Status status = first.backend->MultiHeadAttention(args); !status.ok()) return status;

  // Each call's rows of the outputs, as sub-slices, into its reply.
  int64_t b0 = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    const int64_t batch = plans[i]->problem.shape.batch;
    MhaReply* reply = replies[i];
    const auto rows = [&](const TensorBytes& all, int64_t per_item, TensorBytes* to) {
      to->field = all.field;
      to->header = all.header;
      to->header.set_shape(0, batch);
      to->data = all.data.sub(b0 * per_item * out_size, (b0 + batch) * per_item * out_size);
    };
    rows(out, out_per_item, &reply->output);
    if (p.return_weights) rows(weights, weights_per_item, &reply->attention_weights);
    reply->message.set_backend(std::string(first.backend->name()));
    b0 += batch;
  }
  return absl::OkStatus();
}

absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan, const StopSignal* stop, SdpaReply* reply) {
  const AttentionProblem& p = plan.problem;
  const AttentionShape& s = p.shape;
  std::vector<float> additive;
  SdpaArgs args;
  if (absl::Status status = DecodeMask(plan, &additive, &args.mask); !status.ok()) return status;
  args.shape = s;
  args.stop = stop;
  args.q = View(plan, *plan.q);
  args.k = View(plan, *plan.k);
  args.v = View(plan, *plan.v);
  args.out = AllocateOutput(plan, {s.batch, s.q_len, s.heads.num_heads, s.heads.head_dim}, reply);
  if (p.return_weights) {
    args.weights = Allocate(kWeightsField, {s.batch, s.heads.num_heads, s.q_len, s.kv_len}, p.output_dtype,
                            &reply->attention_weights);
  }
  StatsBuffers stats(plan.stats, s.batch, s.heads.num_heads, s.q_len, /*has_w_o=*/false);
  args.stats = stats.View();
  reply->message.set_backend(std::string(plan.backend->name()));
  if (!plan.regions.empty()) PrepareThreadsForRegions();
  if (absl::Status status = plan.backend->ScaledDotProductAttention(args); !status.ok()) return status;
  FillStats(s, args.mask, stats, &reply->message);
  return plan.RegionsIntact();
}

}  // namespace mha
