#include "server/rpc/kserve/infer_response.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

constexpr int kRawOutputContentsField = 6;

// One of HeadStats' fields as a [B, H] FP32 tensor: its header and a slice of its bytes (a copy: B x H floats).
// INTERNAL when it is empty (a head statistic a call did not compute).
absl::Status HeadStatTensor(KServeOutput output, const v1::HeadStats& stats, const v1::Tensor& lse,
                            v1::Tensor* header, grpc::Slice* data) {
  const google::protobuf::RepeatedField<float>* fields[] = {
      &stats.entropy(), &stats.normalized_entropy(), &stats.confidence(),
      &stats.distance(), &stats.sink_mass(), &stats.contribution()};
  const auto& values = *fields[static_cast<int>(output) - static_cast<int>(KServeOutput::kEntropy)];
  const int64_t batch = lse.shape_size() == 3 ? lse.shape(0) : 0;
  if (values.empty() || batch == 0) {
    return absl::InternalError(absl::StrCat("output '", OutputName(output), "' was not computed"));
  }
  header->add_shape(batch);
  header->add_shape(values.size() / batch);
  header->set_dtype(v1::FP32);
  *data = grpc::Slice(values.data(), values.size() * sizeof(float));
  return absl::OkStatus();
}

}  // namespace

absl::Status EncodeInferResponse(const std::string& model, const std::string& id,
                                 absl::Span<const KServeOutput> outputs, const ComputedOutputs& computed,
                                 grpc::ByteBuffer* out) {
  inference::ModelInferResponse head;
  head.set_model_name(model);
  head.set_model_version(kModelVersion);
  head.set_id(id);
  auto& params = *head.mutable_parameters();
  params["backend"].set_string_param(computed.backend);
  if (computed.timing != nullptr) {
    params["queue_us"].set_int64_param(computed.timing->queue_us());
    params["compute_us"].set_int64_param(computed.timing->compute_us());
    params["handler_us"].set_int64_param(computed.timing->handler_us());
  }
  // Each output's bytes; empty for one written to shared memory, which keeps its place with an empty entry, so
  // that entries and outputs pair up.
  std::vector<grpc::Slice> contents;
  for (KServeOutput output : outputs) {
    // lse and the head statistics travel inside the native message: small, so copied.
    v1::Tensor small;
    grpc::Slice small_data;
    if (output == KServeOutput::kLse || IsHeadStat(output)) {
      if (computed.lse == nullptr || computed.lse->shape_size() == 0) {
        return absl::InternalError(absl::StrCat("output '", OutputName(output), "' was not computed"));
      }
      if (output == KServeOutput::kLse) {
        small = *computed.lse;
        small.clear_data();
        small_data = grpc::Slice(computed.lse->data());
      } else {
        RETURN_IF_ERROR(HeadStatTensor(output, *computed.head_stats, *computed.lse, &small, &small_data));
      }
    }
    const bool is_small = output == KServeOutput::kLse || IsHeadStat(output);
    const TensorBytes* tensor = output == KServeOutput::kOutput ? computed.output : computed.attention_weights;
    const bool shared = output == KServeOutput::kOutput && computed.output_in_shared_memory != nullptr;
    if (!is_small && !shared && (tensor == nullptr || tensor->field == 0)) {
      return absl::InternalError(absl::StrCat("output '", OutputName(output), "' was not computed"));
    }
    const v1::Tensor& from = is_small ? small : shared ? *computed.output_in_shared_memory : tensor->header;
    inference::ModelInferResponse::InferOutputTensor* header = head.add_outputs();
    header->set_name(OutputName(output));
    header->set_datatype(DatatypeName(from.dtype()));
    header->mutable_shape()->Assign(from.shape().begin(), from.shape().end());
    if (shared) {
      (*header->mutable_parameters())["shared_memory_region"].set_string_param(from.shared_memory().region());
    }
    contents.push_back(is_small ? small_data : shared ? grpc::Slice() : tensor->data);  // a reference, not a copy
  }
  std::string head_bytes;
  if (!head.SerializeToString(&head_bytes)) return absl::InternalError("the response does not serialize");
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head_bytes);
  for (const grpc::Slice& data : contents) AppendBytesField(kRawOutputContentsField, data, &slices);
  grpc::ByteBuffer encoded(slices.data(), slices.size());
  out->Swap(&encoded);
  return absl::OkStatus();
}

}  // namespace mha
