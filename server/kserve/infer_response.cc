#include "server/kserve/infer_response.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace mha {
namespace {

constexpr int kRawOutputContentsField = 6;

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
    const TensorBytes* tensor = output == KServeOutput::kOutput ? computed.output : computed.attention_weights;
    const bool shared = output == KServeOutput::kOutput && computed.output_in_shared_memory != nullptr;
    if (!shared && (tensor == nullptr || tensor->field == 0)) {
      return absl::InternalError(absl::StrCat("output '", OutputName(output), "' was not computed"));
    }
    const v1::Tensor& from = shared ? *computed.output_in_shared_memory : tensor->header;
    inference::ModelInferResponse::InferOutputTensor* header = head.add_outputs();
    header->set_name(OutputName(output));
    header->set_datatype(DatatypeName(from.dtype()));
    header->mutable_shape()->Assign(from.shape().begin(), from.shape().end());
    if (shared) {
      (*header->mutable_parameters())["shared_memory_region"].set_string_param(from.shared_memory().region());
    }
    contents.push_back(shared ? grpc::Slice() : tensor->data);  // a reference, not a copy of the bytes
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
