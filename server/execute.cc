#include "server/execute.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

// fp32 view of a validated tensor: borrows fp32 bytes when they are aligned, otherwise decodes a copy.
class FloatInput {
 public:
  explicit FloatInput(const v1::Tensor* tensor) {
    if (tensor == nullptr) return;
    const std::string& bytes = tensor->data();
    if (tensor->dtype() == v1::FP32 && reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
      data_ = reinterpret_cast<const float*>(bytes.data());
    } else {
      storage_ = TensorToFloats(*tensor);
      data_ = storage_.data();
    }
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
};

// An output tensor of `shape` in `dtype`: the backend writes fp32 into data(); Finish() encodes into the message
// unless the bytes were written in place.
class FloatOutput {
 public:
  FloatOutput(v1::Tensor* tensor, std::vector<int64_t> shape, v1::DataType dtype)
      : tensor_(tensor), dtype_(dtype) {
    count_ = 1;
    for (int64_t d : shape) count_ *= d;
    tensor_->Clear();
    for (int64_t d : shape) tensor_->add_shape(d);
    tensor_->set_dtype(dtype);
    std::string* bytes = tensor_->mutable_data();
    bytes->resize(count_ * DTypeSize(dtype));
    if (dtype == v1::FP32 && reinterpret_cast<uintptr_t>(bytes->data()) % alignof(float) == 0) {
      data_ = reinterpret_cast<float*>(bytes->data());
    } else {
      storage_.resize(count_);
      data_ = storage_.data();
    }
  }
  float* data() { return data_; }
  void Finish() {
    if (!storage_.empty()) EncodeFromFloat(dtype_, storage_.data(), count_, tensor_->mutable_data()->data());
  }

 private:
  v1::Tensor* tensor_;
  v1::DataType dtype_;
  int64_t count_;
  std::vector<float> storage_;
  float* data_ = nullptr;
};

AttentionMask MakeMask(const AttentionPlan& plan, const FloatInput& additive) {
  AttentionMask mask;
  mask.key_lengths = plan.key_lengths;
  mask.additive = additive.data();
  mask.additive_per_batch = plan.mask_per_batch;
  return mask;
}

// The response's output tensor and, when the plan asks for them, its attention weights [B, H, Tq, Tk].
class ResponseTensors {
 public:
  // `weights` is null unless plan.return_weights (so that an unrequested field stays unset).
  ResponseTensors(const AttentionPlan& plan, v1::Tensor* output, std::vector<int64_t> output_shape,
                  v1::Tensor* weights)
      : output_(output, std::move(output_shape), plan.output_dtype) {
    const AttentionDims& d = plan.dims;
    if (weights != nullptr) {
      weights_ = std::make_unique<FloatOutput>(
          weights, std::vector<int64_t>{d.batch, d.num_heads, d.q_len, d.kv_len}, plan.output_dtype);
    }
  }
  float* output() { return output_.data(); }
  float* weights() { return weights_ ? weights_->data() : nullptr; }
  // Encodes what the backend wrote when `status` is OK; returns `status`.
  absl::Status Finish(const absl::Status& status) {
    if (!status.ok()) return status;
    output_.Finish();
    if (weights_) weights_->Finish();
    return status;
  }

 private:
  FloatOutput output_;
  std::unique_ptr<FloatOutput> weights_;
};

}  // namespace

absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, v1::MultiHeadAttentionResponse* response) {
  const AttentionDims& d = plan.dims;
  FloatInput query(plan.query);
  FloatInput key(plan.self_attention || plan.key == plan.query ? nullptr : plan.key);
  FloatInput value(plan.value == plan.key || plan.value == plan.query ? nullptr : plan.value);
  FloatInput additive(plan.attn_mask);

  MhaArgs args;
  args.dims = d;
  args.mask = MakeMask(plan, additive);
  args.weights = plan.layer->Weights();
  args.query = query.data();
  args.key = plan.key == plan.query ? query.data() : key.data();
  args.value = plan.value == plan.query ? query.data() : plan.value == plan.key ? args.key : value.data();
  args.self_attention = plan.self_attention;
  args.head_mask = plan.head_mask;

  ResponseTensors tensors(plan, response->mutable_output(), {d.batch, d.q_len, plan.layer->d_model},
                          plan.return_weights ? response->mutable_attention_weights() : nullptr);
  args.out = tensors.output();
  args.attention_weights = tensors.weights();
  response->set_backend(std::string(plan.backend->name()));
  return tensors.Finish(plan.backend->MultiHeadAttention(args));
}

absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan,
                                              v1::ScaledDotProductAttentionResponse* response) {
  const AttentionDims& d = plan.dims;
  FloatInput q(plan.q), k(plan.k), v(plan.v), additive(plan.attn_mask);
  SdpaArgs args;
  args.dims = d;
  args.mask = MakeMask(plan, additive);
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  ResponseTensors tensors(plan, response->mutable_output(), {d.batch, d.q_len, d.num_heads, d.head_dim},
                          plan.return_weights ? response->mutable_attention_weights() : nullptr);
  args.out = tensors.output();
  args.weights = tensors.weights();
  response->set_backend(std::string(plan.backend->name()));
  return tensors.Finish(plan.backend->ScaledDotProductAttention(args));
}

}  // namespace mha
