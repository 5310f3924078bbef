#include "server/calls/request_reader.h"

#include <algorithm>
#include <string>

#include "proto/mha/v1/tensor_codec.h"
#include "proto/mha/v1/tensor_wire.h"

namespace mha {
namespace {

constexpr int kActivationFields[] = {1, 2, 3};  // query/key/value, q/k/v

// Collects each activation's data in a string of its own (moved into the message afterwards) and scans every
// complete element of each piece as it arrives.
class ScanningSink final : public TensorSink {
 public:
  struct Slot {
    bool present = false;
    std::string data;
    v1::DataType dtype = v1::DATA_TYPE_UNSPECIFIED;
    size_t element_size = 0;  // 0: dtype unknown when the data began, not scanned
    size_t scanned = 0;       // elements scanned
    int64_t first_non_finite = -1;
  };

  bool Begin(int field, const v1::Tensor& header, size_t bytes) override {
    Slot& slot = slots_[field - 1];
    slot = Slot();
    slot.present = true;
    slot.data.reserve(bytes);  // DecodeWithTensors bounds bytes by what the message holds
    slot.dtype = header.dtype();
    slot.element_size = DTypeSize(header.dtype());
    current_ = &slot;
    return true;
  }

  void Append(const char* data, size_t n) override {
    Slot& slot = *current_;
    slot.data.append(data, n);
    if (slot.element_size == 0 || slot.first_non_finite >= 0) return;
    const size_t complete = slot.data.size() / slot.element_size;
    if (complete == slot.scanned) return;
    const int64_t bad = FirstNonFinite(slot.dtype, slot.data.data() + slot.scanned * slot.element_size,
                                       complete - slot.scanned);
    if (bad >= 0) slot.first_non_finite = static_cast<int64_t>(slot.scanned) + bad;
    slot.scanned = complete;
  }

  Slot& slot(int field) { return slots_[field - 1]; }

 private:
  Slot slots_[3];
  Slot* current_ = nullptr;
};

}  // namespace

absl::Status ReadComputeRequest(const grpc::ByteBuffer& bytes, google::protobuf::Message* request,
                                std::vector<FiniteScan>* scans) {
  ScanningSink sink;
  if (absl::Status status = DecodeWithTensors(bytes, kActivationFields, &sink, request); !status.ok()) {
    return status;
  }
  const google::protobuf::Descriptor* descriptor = request->GetDescriptor();
  const google::protobuf::Reflection* reflection = request->GetReflection();
  for (int field : kActivationFields) {
    ScanningSink::Slot& slot = sink.slot(field);
    if (!slot.present) continue;
    const google::protobuf::FieldDescriptor* fd = descriptor->FindFieldByNumber(field);
    if (fd == nullptr || fd->message_type() != v1::Tensor::descriptor()) continue;  // not a compute request
    auto* tensor = static_cast<v1::Tensor*>(reflection->MutableMessage(request, fd));
    tensor->mutable_data()->swap(slot.data);
    // Settled: the first non-finite element found, or every element scanned; as the dtype the message ends with.
    const bool settled =
        slot.first_non_finite >= 0 || slot.scanned == tensor->data().size() / std::max<size_t>(slot.element_size, 1);
    if (slot.element_size != 0 && tensor->dtype() == slot.dtype && settled) {
      scans->push_back({tensor, slot.dtype, slot.first_non_finite});
    }
  }
  return absl::OkStatus();
}

}  // namespace mha
