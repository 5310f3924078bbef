#include "proto/mha/v1/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mha {
namespace {

static_assert(sizeof(float) == 4, "fp32 must be 4 bytes");
// The wire format is little-endian; so is every platform we build for (x86-64, aarch64).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "big-endian hosts need byte swapping here");

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

size_t DTypeSize(int dtype) {
  switch (dtype) {
    case v1::FP32:
      return 4;
    case v1::FP16:
    case v1::BF16:
      return 2;
    default:
      return 0;
  }
}

bool IsCacheOnlyDType(int dtype) { return dtype == v1::INT8 || dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2; }

std::string DTypeName(int dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_UNSPECIFIED:
      return "unspecified";
    case v1::FP32:
      return "fp32";
    case v1::FP16:
      return "fp16";
    case v1::BF16:
      return "bf16";
    case v1::INT8:
      return "int8";
    case v1::FP8_E4M3:
      return "fp8_e4m3";
    case v1::FP8_E5M2:
      return "fp8_e5m2";
    default:
      return absl::StrCat("dtype(", dtype, ")");
  }
}

uint16_t FloatToHalf(float value) {
  const uint32_t x = FloatBits(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN; keep NaN quiet and non-zero.
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf.
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero.
    // Adding 0.5 makes the FPU round the value to a multiple of 2^-24 (half's subnormal step), nearest even.
    const float rounded = BitsFloat(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatBits(rounded) - 0x3f000000u));
  }
  const uint32_t mantissa_odd = (abs >> 13) & 1u;
  uint32_t bits = abs + 0xc8000fffu + mantissa_odd;  // rebias exponent (-112 << 23) and round to nearest even.
  return static_cast<uint16_t>(sign | (bits >> 13));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToBf16(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN.
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float Bf16ToFloat(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

void DecodeToFloat(int dtype, const void* src, size_t n, float* dst) {
  if (n == 0) return;  // an empty vector's data() may be null, which memcpy must not get even for 0 bytes
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case v1::FP32:
      std::memcpy(dst, src, n * 4);
      return;
    case v1::FP16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = HalfToFloat(h);
      }
      return;
    case v1::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = Bf16ToFloat(h);
      }
      return;
    default:
      return;
  }
}

void EncodeFromFloat(int dtype, const float* src, size_t n, void* dst) {
  if (n == 0) return;  // as in DecodeToFloat
  auto* bytes = static_cast<unsigned char*>(dst);
  switch (dtype) {
    case v1::FP32:
      std::memcpy(dst, src, n * 4);
      return;
    case v1::FP16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToHalf(src[i]);
        std::memcpy(bytes + 2 * i, &h, 2);
      }
      return;
    case v1::BF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToBf16(src[i]);
        std::memcpy(bytes + 2 * i, &h, 2);
      }
      return;
    default:
      return;
  }
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<int64_t> CheckedElementCount(absl::Span<const int64_t> shape, absl::string_view field) {
  // Leave headroom so that count * 16 (the widest byte arithmetic done on it) cannot overflow either.
  constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 16;
  int64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", i, "] must be >= 1, got ", shape[i],
                                                     " (shape ", ShapeString(shape), ")"));
    }
    if (count > kMaxElements / shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape ", ShapeString(shape), " has too many elements (overflow)"));
    }
    count *= shape[i];
  }
  return count;
}

absl::StatusOr<int64_t> CheckTensor(const v1::Tensor& tensor, absl::string_view field) {
  if (tensor.has_shared_memory()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shared_memory is accepted only on the activations (query, key, value; q, k, v)"));
  }
  absl::StatusOr<int64_t> count = CheckTensorHeader(tensor, field);
  if (!count.ok()) return count.status();
  const size_t dtype_size = DTypeSize(tensor.dtype());
  const int64_t want_bytes = *count * static_cast<int64_t>(dtype_size);
  if (static_cast<int64_t>(tensor.data().size()) != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", tensor.data().size(), " bytes, expected ", want_bytes, " (shape ",
        ShapeString(tensor.shape()), " x ", dtype_size, " bytes of ", DTypeName(tensor.dtype()), ")"));
  }
  return count;
}

absl::StatusOr<int64_t> CheckTensorHeader(const v1::Tensor& tensor, absl::string_view field) {
  const size_t dtype_size = DTypeSize(tensor.dtype());
  if (IsCacheOnlyDType(tensor.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype ", DTypeName(tensor.dtype()),
                                                   " is for KV caches only (CreateSessionRequest.cache_dtype); "
                                                   "tensors are FP32, FP16 or BF16"));
  }
  if (dtype_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype must be FP32, FP16 or BF16, got ",
                                                   DTypeName(tensor.dtype())));
  }
  return CheckedElementCount(tensor.shape(), field);
}

namespace {

// First i < n whose element, read as a little-endian Word, has every exponent bit set (inf or NaN); -1 if none.
// Scans blocks branch-free, so that the compiler vectorises the common all-finite case.
template <typename Word>
int64_t FirstWithExponent(const unsigned char* src, size_t n, Word exponent) {
  constexpr size_t kBlock = 256;
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t end = std::min(n, start + kBlock);
    bool any = false;
    for (size_t i = start; i < end; ++i) {
      Word w;
      std::memcpy(&w, src + i * sizeof(Word), sizeof(Word));
      any |= (w & exponent) == exponent;
    }
    if (!any) continue;
    for (size_t i = start; i < end; ++i) {
      Word w;
      std::memcpy(&w, src + i * sizeof(Word), sizeof(Word));
      if ((w & exponent) == exponent) return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(int dtype, const void* src, size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case v1::FP32:
      return FirstWithExponent<uint32_t>(bytes, n, 0x7f800000u);
    case v1::FP16:
      return FirstWithExponent<uint16_t>(bytes, n, 0x7c00u);
    case v1::BF16:
      return FirstWithExponent<uint16_t>(bytes, n, 0x7f80u);
    default:
      return -1;
  }
}

absl::Status CheckFinite(const v1::Tensor& tensor, absl::string_view field) {
  const size_t size = DTypeSize(tensor.dtype());
  if (size == 0) return absl::OkStatus();
  return NonFiniteError(tensor, field,
                        FirstNonFinite(tensor.dtype(), tensor.data().data(), tensor.data().size() / size));
}

absl::Status NonFiniteError(const v1::Tensor& tensor, absl::string_view field, int64_t bad, const char* data) {
  const size_t size = DTypeSize(tensor.dtype());
  if (bad < 0 || size == 0) return absl::OkStatus();
  float value;
  DecodeToFloat(tensor.dtype(), (data != nullptr ? data : tensor.data().data()) + bad * size, 1, &value);
  // The flat index as a multi-index, innermost dimension last.
  std::vector<int64_t> index(tensor.shape_size());
  int64_t rest = bad;
  for (int d = tensor.shape_size() - 1; d >= 0; --d) {
    index[d] = rest % tensor.shape(d);
    rest /= tensor.shape(d);
  }
  const char* what = std::isnan(value) ? "NaN" : value > 0 ? "inf" : "-inf";
  return absl::InvalidArgumentError(
      absl::StrCat(field, ShapeString(index), " is ", what,
                   "; every value of an input tensor must be finite (only attn_mask may hold -inf)"));
}

std::vector<float> TensorToFloats(const v1::Tensor& tensor) {
  const size_t size = DTypeSize(tensor.dtype());
  const size_t n = size == 0 ? 0 : tensor.data().size() / size;
  std::vector<float> out(n);
  DecodeToFloat(tensor.dtype(), tensor.data().data(), n, out.data());
  return out;
}

void FloatsToTensor(absl::Span<const float> values, absl::Span<const int64_t> shape, v1::DataType dtype,
                    v1::Tensor* tensor) {
  tensor->Clear();
  for (int64_t d : shape) tensor->add_shape(d);
  tensor->set_dtype(dtype);
  std::string* data = tensor->mutable_data();
  data->resize(values.size() * DTypeSize(dtype));
  EncodeFromFloat(dtype, values.data(), values.size(), data->data());
}

}  // namespace mha
