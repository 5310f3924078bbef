// The tensor codec (proto/mha/v1/tensor_codec.h) on arbitrary bytes:
// - every 4 bytes as an fp32 value: FloatToHalf and FloatToBf16 round to nearest even exactly as a rounding computed
//   here in double arithmetic does (overflow to inf, NaN stays NaN with its sign);
// - every 2 bytes as fp16 and as bf16: widening is exact (checked against ldexp) and narrowing gives the bits back;
// - the bytes as a serialized Tensor: CheckTensor, and for a valid tensor TensorToFloats -> FloatsToTensor in the same
//   dtype gives the same bytes (NaN stays NaN).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "proto/mha/v1/tensor_codec.h"

namespace {

void Fail(const char* what, uint32_t bits) {
  std::fprintf(stderr, "fuzz_tensor_codec: %s (input bits 0x%08x)\n", what, bits);
  std::abort();
}

// |x| rounded to a multiple of the format's step at x's binade (nearest, ties to even), with the sign; inf when it
// reaches 2^(max_exponent + 1). `mantissa_bits` and `min_exponent` (of the smallest normal) describe the format.
float Rounded(float x, int mantissa_bits, int min_exponent, int max_exponent) {
  const double a = std::fabs(static_cast<double>(x));
  int exponent = 0;
  std::frexp(a, &exponent);  // a = m 2^exponent, m in [0.5, 1)
  const int binade = std::max(exponent - 1, min_exponent);
  const double step = std::ldexp(1.0, binade - mantissa_bits);
  const double r = std::nearbyint(a / step) * step;  // the default rounding mode: to nearest, ties to even
  const double limit = std::ldexp(1.0, max_exponent + 1);
  const double magnitude = r >= limit ? INFINITY : r;
  return static_cast<float>(std::signbit(x) ? -magnitude : magnitude);
}

bool SameValue(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

void CheckFloat(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const float half = mha::HalfToFloat(mha::FloatToHalf(x));
  const float bf16 = mha::Bf16ToFloat(mha::FloatToBf16(x));
  if (std::isnan(x)) {
    if (!std::isnan(half) || std::signbit(half) != std::signbit(x)) Fail("fp16 lost a NaN", bits);
    if (!std::isnan(bf16) || std::signbit(bf16) != std::signbit(x)) Fail("bf16 lost a NaN", bits);
    return;
  }
  if (std::isinf(x)) {
    if (half != x) Fail("fp16 lost an inf", bits);
    if (bf16 != x) Fail("bf16 lost an inf", bits);
    return;
  }
  if (!SameValue(half, Rounded(x, 10, -14, 15))) Fail("FloatToHalf rounds differently", bits);
  if (!SameValue(bf16, Rounded(x, 7, -126, 127))) Fail("FloatToBf16 rounds differently", bits);
}

void CheckHalfBits(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  const float value = mha::HalfToFloat(h);
  float want;
  if (exponent == 31) {
    want = mantissa == 0 ? sign * INFINITY : NAN;
  } else if (exponent == 0) {
    want = sign * static_cast<float>(std::ldexp(mantissa, -24));
  } else {
    want = sign * static_cast<float>(std::ldexp(1024 + mantissa, exponent - 25));
  }
  if (!SameValue(value, want)) Fail("HalfToFloat", h);
  const uint16_t back = mha::FloatToHalf(value);
  if (std::isnan(value) ? (back & 0x7c00) != 0x7c00 || (back & 0x3ff) == 0 || (back & 0x8000) != (h & 0x8000)
                        : back != h) {
    Fail("fp16 -> fp32 -> fp16 changed the bits", h);
  }
}

void CheckBf16Bits(uint16_t h) {
  const float value = mha::Bf16ToFloat(h);
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (bits != static_cast<uint32_t>(h) << 16) Fail("Bf16ToFloat", h);
  const uint16_t back = mha::FloatToBf16(value);
  if (std::isnan(value) ? (back & 0x7f80) != 0x7f80 || (back & 0x7f) == 0 || (back & 0x8000) != (h & 0x8000)
                        : back != h) {
    Fail("bf16 -> fp32 -> bf16 changed the bits", h);
  }
}

// Same bytes, except that a NaN element may come back as another NaN of the same sign.
bool SameEncoding(int dtype, const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  const size_t size = mha::DTypeSize(dtype);
  std::vector<float> fa(a.size() / size), fb(b.size() / size);
  mha::DecodeToFloat(dtype, a.data(), fa.size(), fa.data());
  mha::DecodeToFloat(dtype, b.data(), fb.size(), fb.data());
  for (size_t i = 0; i < fa.size(); ++i) {
    if (std::isnan(fa[i]) && std::isnan(fb[i]) && std::signbit(fa[i]) == std::signbit(fb[i])) continue;
    if (std::memcmp(a.data() + i * size, b.data() + i * size, size) != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (size_t i = 0; i + 4 <= size; i += 4) {
    float x;
    std::memcpy(&x, data + i, 4);
    CheckFloat(x);
  }
  for (size_t i = 0; i + 2 <= size; i += 2) {
    uint16_t h;
    std::memcpy(&h, data + i, 2);
    CheckHalfBits(h);
    CheckBf16Bits(h);
  }

  mha::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::StatusOr<int64_t> count = mha::CheckTensor(tensor, "tensor");
  (void)mha::ShapeString(tensor.shape());
  if (!count.ok()) {
    if (count.status().code() != absl::StatusCode::kInvalidArgument) Fail("CheckTensor's code", 0);
    return 0;
  }
  const std::vector<float> values = mha::TensorToFloats(tensor);
  if (static_cast<int64_t>(values.size()) != *count) Fail("TensorToFloats' element count", 0);
  mha::v1::Tensor again;
  mha::FloatsToTensor(values, std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()), tensor.dtype(),
                      &again);
  if (!mha::CheckTensor(again, "again").ok()) Fail("FloatsToTensor made an invalid tensor", 0);
  if (!SameEncoding(tensor.dtype(), tensor.data(), again.data())) Fail("decode -> encode changed the bytes", 0);
  return 0;
}
