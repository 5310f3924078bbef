#include "client/bench_wire.h"

#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "proto/inference/grpc_service.pb.h"
#include "proto/mha/v1/tensor_wire.h"

namespace mha {
namespace {

// Buffers for the responses' tensors, reused from call to call as a client that keeps its output arrays would
// (a fresh 8 MB buffer per call pays its page faults every time: about 1 ms here).
class BufferPool {
 public:
  std::vector<char> Lend() {
    absl::MutexLock lock(&mu_);
    if (pool_.empty()) return {};
    std::vector<char> buffer = std::move(pool_.back());
    pool_.pop_back();
    return buffer;
  }
  void GiveBack(std::vector<char> buffer) {
    if (buffer.empty()) return;
    absl::MutexLock lock(&mu_);
    if (pool_.size() < kBuffers) pool_.push_back(std::move(buffer));
  }

 private:
  static constexpr size_t kBuffers = 16;
  absl::Mutex mu_;
  std::vector<std::vector<char>> pool_ ABSL_GUARDED_BY(mu_);
};

class NativeWire final : public BenchWire {
 public:
  explicit NativeWire(const v1::MultiHeadAttentionRequest& request) : rest_(request) {
    // Every call sends the request's tensors from where they lie, as AttentionClient does with a caller's arrays
    // (a tensor in shared memory stays in the rest: only its reference travels).
    using Clear = void (v1::MultiHeadAttentionRequest::*)();
    const auto borrow = [this](int field, bool present, const v1::Tensor& tensor, Clear clear) {
      if (!present || tensor.has_shared_memory()) return;
      TensorBytes& bytes = tensors_[tensor_count_++];
      bytes.field = field;
      bytes.header.set_dtype(tensor.dtype());
      *bytes.header.mutable_shape() = tensor.shape();
      bytes.data = BorrowedSlice(tensor.data().data(), tensor.data().size());
      (rest_.*clear)();
    };
    borrow(1, request.has_query(), request.query(), &v1::MultiHeadAttentionRequest::clear_query);
    borrow(2, request.has_key(), request.key(), &v1::MultiHeadAttentionRequest::clear_key);
    borrow(3, request.has_value(), request.value(), &v1::MultiHeadAttentionRequest::clear_value);
    borrow(8, request.has_attn_mask(), request.attn_mask(), &v1::MultiHeadAttentionRequest::clear_attn_mask);
    for (int i = 0; i < tensor_count_; ++i) tensor_list_[i] = &tensors_[i];
  }

  const char* method() const override { return "/mha.v1.Attention/MultiHeadAttention"; }

  absl::Status Encode(grpc::ByteBuffer* out) const override {
    return EncodeWithTensors(absl::MakeConstSpan(tensor_list_, tensor_count_), rest_, out);
  }

  absl::StatusOr<ServerTimes> Decode(const grpc::ByteBuffer& bytes) override {
    v1::MultiHeadAttentionResponse response;
    std::vector<char> output, weights;
    const int tensor_fields[] = {1, 2};
    CopyingSink sink([&](int field, size_t size) {
      std::vector<char>& to = field == 1 ? output : weights;
      if (to.empty()) to = pool_.Lend();
      if (to.size() < size) to.resize(size);
      return to.data();
    });
    const absl::Status decoded = DecodeWithTensors(bytes, tensor_fields, &sink, &response);
    pool_.GiveBack(std::move(output));
    pool_.GiveBack(std::move(weights));
    if (!decoded.ok()) return absl::InternalError(absl::StrCat("cannot decode the response: ", decoded.message()));
    return ServerTimes{response.timing().queue_us(), response.timing().compute_us(), response.timing().handler_us()};
  }

 private:
  v1::MultiHeadAttentionRequest rest_;  // the request without the tensors in tensors_
  TensorBytes tensors_[4];
  const TensorBytes* tensor_list_[4] = {};
  int tensor_count_ = 0;
  BufferPool pool_;
};

const char* KServeDatatype(v1::DataType dtype) {
  return dtype == v1::FP16 ? "FP16" : dtype == v1::BF16 ? "BF16" : "FP32";
}

// The same call as a Triton client makes it: the inputs' headers, then their bytes as raw_input_contents.
class KServeWire final : public BenchWire {
 public:
  explicit KServeWire(const v1::MultiHeadAttentionRequest& request) {
    rest_.set_model_name(request.layer());
    const auto add = [this](const char* name, const v1::Tensor& tensor) {
      auto* input = rest_.add_inputs();
      input->set_name(name);
      input->set_datatype(KServeDatatype(tensor.dtype()));
      *input->mutable_shape() = tensor.shape();
      raw_.push_back(BorrowedSlice(tensor.data().data(), tensor.data().size()));
    };
    add("query", request.query());
    if (request.has_key()) add("key", request.key());
    if (request.has_value()) add("value", request.value());
    if (request.has_attn_mask()) add("attn_mask", request.attn_mask());
    auto& params = *rest_.mutable_parameters();
    if (request.heads().causal()) params["causal"].set_bool_param(true);
    if (request.backend() != v1::BACKEND_AUTO) {
      std::string backend = v1::Backend_Name(request.backend()).substr(sizeof("BACKEND_") - 1);
      params["backend"].set_string_param(absl::AsciiStrToLower(backend));
    }
    rest_.add_outputs()->set_name("output");
    if (request.return_attention_weights()) rest_.add_outputs()->set_name("attention_weights");
  }

  const char* method() const override { return "/inference.GRPCInferenceService/ModelInfer"; }

  absl::Status Encode(grpc::ByteBuffer* out) const override {
    std::vector<grpc::Slice> slices = {grpc::Slice(rest_.SerializeAsString())};
    constexpr int kRawInputContentsField = 7;
    for (const grpc::Slice& raw : raw_) AppendBytesField(kRawInputContentsField, raw, &slices);
    grpc::ByteBuffer encoded(slices.data(), slices.size());
    out->Swap(&encoded);
    return absl::OkStatus();
  }

  absl::StatusOr<ServerTimes> Decode(const grpc::ByteBuffer& bytes) override {
    inference::ModelInferResponse response;
    grpc::ByteBuffer copy(bytes);  // shares the slices; Deserialize consumes its argument
    if (!grpc::SerializationTraits<inference::ModelInferResponse>::Deserialize(&copy, &response).ok()) {
      return absl::InternalError("cannot decode the response as inference.ModelInferResponse");
    }
    const auto param = [&](const char* name) {
      const auto it = response.parameters().find(name);
      return it == response.parameters().end() ? int64_t{0} : it->second.int64_param();
    };
    return ServerTimes{param("queue_us"), param("compute_us"), param("handler_us")};
  }

 private:
  inference::ModelInferRequest rest_;  // without raw_input_contents
  std::vector<grpc::Slice> raw_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BenchWire>> MakeBenchWire(BenchProtocol protocol,
                                                         const v1::MultiHeadAttentionRequest& request) {
  if (protocol == BenchProtocol::kNative) return std::make_unique<NativeWire>(request);
  if (request.layer().empty()) {
    return absl::InvalidArgumentError("--protocol kserve calls a layer's model: give --layer");
  }
  for (const v1::Tensor* tensor : {&request.query(), &request.key(), &request.value(), &request.attn_mask()}) {
    if (tensor->has_shared_memory()) {
      return absl::InvalidArgumentError("--protocol kserve sends its tensors in the message: drop --shared_memory");
    }
  }
  if (request.has_output_shared_memory() || request.key_lengths_size() > 0 || request.head_mask_size() > 0 ||
      request.attn_mask_type() != v1::MASK_ADDITIVE) {
    return absl::InvalidArgumentError(
        "--protocol kserve sends query, key, value, an additive attn_mask, causal and backend only");
  }
  return std::make_unique<KServeWire>(request);
}

}  // namespace mha
