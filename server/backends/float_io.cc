#include "server/backends/float_io.h"

#include <cstdint>

#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

bool IsAlignedFp32(v1::DataType dtype, const void* data) {
  return dtype == v1::FP32 && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0;
}

float* Room(int64_t count, ConversionSpace* space, std::vector<float>& own) {
  if (space != nullptr) return space->Room(count);
  own.resize(count);
  return own.data();
}

void ForEachPiece(int64_t count, ConversionSpace* space, absl::FunctionRef<void(int64_t, int64_t)> convert) {
  if (space != nullptr) {
    space->ForEachPiece(count, convert);
  } else {
    convert(0, count);
  }
}

}  // namespace

FloatInput::FloatInput(const ConstTensor& tensor, int64_t count, ConversionSpace* space) {
  if (tensor.data == nullptr) return;
  if (IsAlignedFp32(tensor.dtype, tensor.data)) {
    data_ = static_cast<const float*>(tensor.data);
    return;
  }
  float* dst = Room(count, space, storage_);
  const char* src = static_cast<const char*>(tensor.data);
  const size_t size = DTypeSize(tensor.dtype);
  ForEachPiece(count, space, [&](int64_t begin, int64_t n) {
    DecodeToFloat(tensor.dtype, src + begin * size, n, dst + begin);
  });
  data_ = dst;
}

FloatOutput::FloatOutput(const MutableTensor& tensor, int64_t count, ConversionSpace* space)
    : tensor_(tensor), count_(count), space_(space) {
  if (!tensor.requested()) return;
  data_ = IsAlignedFp32(tensor.dtype, tensor.data) ? static_cast<float*>(tensor.data)
                                                   : (staged_ = Room(count, space, storage_));
}

void FloatOutput::Finish() {
  if (staged_ == nullptr) return;
  char* dst = static_cast<char*>(tensor_.data);
  const size_t size = DTypeSize(tensor_.dtype);
  ForEachPiece(count_, space_, [&](int64_t begin, int64_t n) {
    EncodeFromFloat(tensor_.dtype, staged_ + begin, n, dst + begin * size);
  });
}

}  // namespace mha
