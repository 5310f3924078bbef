#include "server/backends/quantized_cache.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace mha::quant {
namespace {

// The positive finite values of an FP8 format by code (0 .. the largest finite code), increasing.
template <int kExponentBits>
struct Fp8Table {
  static constexpr int kMantissaBits = 7 - kExponentBits, kBias = (1 << (kExponentBits - 1)) - 1;
  // E4M3's largest finite code is 0x7e (0x7f is NaN); E5M2's is 0x7b (0x7c is infinity).
  static constexpr int kMaxCode = kExponentBits == 4 ? 0x7e : 0x7b;
  std::array<float, kMaxCode + 1> value{};

  Fp8Table() {
    for (int code = 0; code <= kMaxCode; ++code) {
      const int e = code >> kMantissaBits, m = code & ((1 << kMantissaBits) - 1);
      const float mantissa = static_cast<float>(m) / static_cast<float>(1 << kMantissaBits);
      value[code] = e == 0 ? std::ldexp(mantissa, 1 - kBias) : std::ldexp(1.0f + mantissa, e - kBias);
    }
  }
  float Decode(uint8_t code) const {
    const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
    const int magnitude = code & 0x7f;
    if (magnitude > kMaxCode) {
      return kExponentBits == 5 && magnitude == 0x7c ? sign * std::numeric_limits<float>::infinity()
                                                     : std::numeric_limits<float>::quiet_NaN();
    }
    return sign * value[magnitude];
  }
};

// x rounded to an integer, ties to even, for |x| <= 2^22: fp32's own rounding of a sum at 2^23's spacing
// (nearbyint without its library call; no -ffast-math here to fold the two additions away).
float RoundToEven(float x) {
  constexpr float kShift = 0x1.8p23f;
  return (x + kShift) - kShift;
}

// The FP8 code nearest x, ties to the even code (the even mantissa), saturating at the largest finite value: the
// mantissa rounded in x's own bits, and subnormals as multiples of the smallest one.
template <int kExponentBits>
uint8_t EncodeFp8(float x) {
  using Table = Fp8Table<kExponentBits>;
  constexpr int kMantissaBits = Table::kMantissaBits, kDropped = 23 - kMantissaBits;
  constexpr uint32_t kBias = Table::kBias;
  constexpr float kMaxValue = kExponentBits == 4 ? 448.0f : 57344.0f;
  constexpr float kMinNormal = kExponentBits == 4 ? 0x1p-6f : 0x1p-14f;
  constexpr float kPerSubnormal = kExponentBits == 4 ? 0x1p9f : 0x1p16f;  // 1 / the smallest subnormal
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= kMaxValue) return sign | Table::kMaxCode;
  if (a < kMinNormal) {  // a subnormal code, or the smallest normal's (2^kMantissaBits multiples)
    return sign | static_cast<uint8_t>(RoundToEven(a * kPerSubnormal));
  }
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  bits += ((1u << (kDropped - 1)) - 1) + ((bits >> kDropped) & 1);  // a carry out of the mantissa lifts the exponent
  const uint32_t exponent = (bits >> 23) - 127 + kBias, mantissa = (bits >> kDropped) & ((1u << kMantissaBits) - 1);
  return sign | static_cast<uint8_t>((exponent << kMantissaBits) | mantissa);
}

const Fp8Table<4>& E4m3() {
  static const Fp8Table<4> table;
  return table;
}
const Fp8Table<5>& E5m2() {
  static const Fp8Table<5> table;
  return table;
}

uint8_t Encode(v1::DataType dtype, float x) {
  switch (dtype) {
    case v1::FP8_E4M3:
      return EncodeE4m3(x);
    case v1::FP8_E5M2:
      return EncodeE5m2(x);
    default: {
      if (std::isnan(x)) return 0;  // no int8 code is NaN; a NaN input has no meaning a cache could keep
      const float code = std::clamp(RoundToEven(std::clamp(x, -128.0f, 128.0f)), -127.0f, 127.0f);
      return static_cast<uint8_t>(static_cast<int8_t>(code));
    }
  }
}

float Decode(v1::DataType dtype, uint8_t code) {
  switch (dtype) {
    case v1::FP8_E4M3:
      return DecodeE4m3(code);
    case v1::FP8_E5M2:
      return DecodeE5m2(code);
    default:
      return static_cast<float>(static_cast<int8_t>(code));
  }
}

uint16_t LoadScale(const char* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}
void StoreScale(char* p, uint16_t bits) { std::memcpy(p, &bits, sizeof(bits)); }

// The code of x at `scale` (0: every value of the channel or token so far is 0).
uint8_t Quantize(v1::DataType dtype, float x, float scale) { return Encode(dtype, scale > 0 ? x / scale : 0.0f); }

// Channel c of n new keys into the block's K part at slot0.., the channel's scale grown (and its earlier keys
// requantized) when a new key needs it.
void WriteKeyChannel(const KvCacheLayout& cache, char* part, int64_t c, int64_t slot0, int64_t n, const float* k,
                     int64_t ldk) {
  float amax = 0.0f;
  if (c < cache.head_dim) {
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(k[i * ldk + c]));
  }
  char* scale_at = part + KeyScalesOffset(cache) + 2 * c;
  const float old = slot0 > 0 ? ScaleValue(LoadScale(scale_at)) : 0.0f;
  float scale = old;
  if (slot0 == 0 || amax / MaxCode(cache.dtype) > old) {
    const uint16_t bits = ScaleBits(amax / MaxCode(cache.dtype));
    scale = ScaleValue(bits);
    StoreScale(scale_at, bits);
    for (int64_t j = 0; j < slot0; ++j) {  // requantized to the grown scale
      uint8_t* code = reinterpret_cast<uint8_t*>(part + KeyCodeOffset(cache, c, j));
      *code = Quantize(cache.dtype, Decode(cache.dtype, *code) * old, scale);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float x = c < cache.head_dim ? k[i * ldk + c] : 0.0f;
    part[KeyCodeOffset(cache, c, slot0 + i)] = static_cast<char>(Quantize(cache.dtype, x, scale));
  }
}

}  // namespace

float MaxCode(v1::DataType dtype) { return dtype == v1::FP8_E4M3 ? 448.0f : dtype == v1::FP8_E5M2 ? 57344.0f : 127.0f; }

uint16_t ScaleBits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return 0x7fc0;
  if ((bits & 0xffffu) != 0 && std::isfinite(x)) bits += 0x10000u;  // up in magnitude (never past infinity's bits)
  return static_cast<uint16_t>(bits >> 16);
}

float ScaleValue(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

uint8_t EncodeE4m3(float x) { return EncodeFp8<4>(x); }
float DecodeE4m3(uint8_t code) { return E4m3().Decode(code); }
uint8_t EncodeE5m2(float x) { return EncodeFp8<5>(x); }
float DecodeE5m2(uint8_t code) { return E5m2().Decode(code); }

int64_t KeyCodeOffset(const KvCacheLayout& cache, int64_t c, int64_t j) {
  const int64_t tb = cache.block_tokens;
  return cache.dtype == v1::INT8 ? (c / 2) * tb * 2 + j * 2 + c % 2 : c * tb + j;
}

int64_t ValueCodeOffset(const KvCacheLayout& cache, int64_t j, int64_t c) {
  const int64_t d = cache.head_dim;
  return cache.dtype == v1::INT8 ? (j / 4) * d * 4 + c * 4 + j % 4 : j * d + c;
}

void WriteTokens(const KvCacheLayout& cache, char* block, int64_t g, int64_t slot0, int64_t n, const float* k,
                 int64_t ldk, const float* v, int64_t ldv) {
  char* key_part = block + cache.KeyPart(g);
  for (int64_t c = 0; c < PaddedDepth(cache); ++c) WriteKeyChannel(cache, key_part, c, slot0, n, k, ldk);
  char* value_part = block + cache.ValuePart(g);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = v + i * ldv;
    float amax = 0.0f;
    for (int64_t c = 0; c < cache.head_dim; ++c) amax = std::max(amax, std::fabs(row[c]));
    const uint16_t bits = ScaleBits(amax / MaxCode(cache.dtype));
    const float scale = ScaleValue(bits);
    StoreScale(value_part + ValueScalesOffset(cache) + 2 * (slot0 + i), bits);
    for (int64_t c = 0; c < cache.head_dim; ++c) {
      value_part[ValueCodeOffset(cache, slot0 + i, c)] = static_cast<char>(Quantize(cache.dtype, row[c], scale));
    }
  }
}

float KeyAt(const KvCacheLayout& cache, const char* block, int64_t g, int64_t j, int64_t c) {
  const char* part = block + cache.KeyPart(g);
  const float scale = ScaleValue(LoadScale(part + KeyScalesOffset(cache) + 2 * c));
  return Decode(cache.dtype, static_cast<uint8_t>(part[KeyCodeOffset(cache, c, j)])) * scale;
}

float ValueAt(const KvCacheLayout& cache, const char* block, int64_t g, int64_t j, int64_t c) {
  const char* part = block + cache.ValuePart(g);
  const float scale = ScaleValue(LoadScale(part + ValueScalesOffset(cache) + 2 * j));
  return Decode(cache.dtype, static_cast<uint8_t>(part[ValueCodeOffset(cache, j, c)])) * scale;
}

void ReadTokens(const KvCacheLayout& cache, const char* block, int64_t g, int64_t keys, float* k, int64_t ldk, float* v,
                int64_t ldv) {
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t c = 0; c < cache.head_dim; ++c) {
      k[j * ldk + c] = KeyAt(cache, block, g, j, c);
      v[j * ldv + c] = ValueAt(cache, block, g, j, c);
    }
  }
}

}  // namespace mha::quant
