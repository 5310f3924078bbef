#include "server/kserve/infer_response.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace mha {
namespace {

constexpr int kRawOutputContentsField = 6;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
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
  }
  std::vector<const TensorBytes*> tensors;
  for (KServeOutput output : outputs) {
    const TensorBytes* tensor =
        output == KServeOutput::kOutput ? computed.output : computed.attention_weights;
    if (tensor == nullptr || tensor->field == 0) {
      return absl::InternalError(absl::StrCat("output '", OutputName(output), "' was not computed"));
    }
    inference::ModelInferResponse::InferOutputTensor* header = head.add_outputs();
    header->set_name(OutputName(output));
    header->set_datatype(DatatypeName(tensor->header.dtype()));
    header->mutable_shape()->Assign(tensor->header.shape().begin(), tensor->header.shape().end());
    if (tensor->header.has_shared_memory()) {
      (*header->mutable_parameters())["shared_memory_region"].set_string_param(
          tensor->header.shared_memory().region());
    }
    tensors.push_back(tensor);
  }
  std::string head_bytes;
  if (!head.SerializeToString(&head_bytes)) return absl::InternalError("the response does not serialize");
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head_bytes);
  for (const TensorBytes* tensor : tensors) {
    // An output in shared memory keeps its place with an empty entry, so that entries and outputs pair up.
    std::string prefix;
    prefix.push_back(static_cast<char>(kRawOutputContentsField << 3 | 2));
    AppendVarint(tensor->data.size(), &prefix);
    slices.emplace_back(prefix);
    if (tensor->data.size() > 0) slices.push_back(tensor->data);
  }
  grpc::ByteBuffer encoded(slices.data(), slices.size());
  out->Swap(&encoded);
  return absl::OkStatus();
}

}  // namespace mha
