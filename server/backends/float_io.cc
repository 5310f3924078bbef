#include "server/backends/float_io.h"

#include <cstdint>

#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

bool IsAlignedFloat(const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(float) == 0; }

}  // namespace

FloatInput::FloatInput(const ConstTensor& tensor, int64_t count) {
  if (tensor.data == nullptr) return;
  if (tensor.dtype == v1::FP32 && IsAlignedFloat(tensor.data)) {
    data_ = static_cast<const float*>(tensor.data);
    return;
  }
  storage_.resize(count);
  DecodeToFloat(tensor.dtype, tensor.data, count, storage_.data());
  data_ = storage_.data();
}

FloatOutput::FloatOutput(const MutableTensor& tensor, int64_t count) : tensor_(tensor), count_(count) {
  if (!tensor.requested()) return;
  if (tensor.dtype == v1::FP32 && IsAlignedFloat(tensor.data)) {
    data_ = static_cast<float*>(tensor.data);
    return;
  }
  storage_.resize(count);
  data_ = storage_.data();
}

void FloatOutput::Finish() {
  if (!storage_.empty()) EncodeFromFloat(tensor_.dtype, storage_.data(), count_, tensor_.data);
}

}  // namespace mha
