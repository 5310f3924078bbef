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
// mantissa rounded in x's own bits, and subnormals as multiples of the smallest one. Every case computed and one
// selected, without branches, so that the writers' loops over a row vectorize.
template <int kExponentBits>
uint8_t EncodeFp8(float x) {
  using Table = Fp8Table<kExponentBits>;
  constexpr int kMantissaBits = Table::kMantissaBits, kDropped = 23 - kMantissaBits;
  constexpr uint32_t kBias = Table::kBias;
  constexpr float kMaxValue = kExponentBits == 4 ? 448.0f : 57344.0f;
  constexpr float kMinNormal = kExponentBits == 4 ? 0x1p-6f : 0x1p-14f;
  constexpr float kPerSubnormal = kExponentBits == 4 ? 0x1p9f : 0x1p16f;  // 1 / the smallest subnormal
  uint32_t x_bits;
  std::memcpy(&x_bits, &x, sizeof(x_bits));
  const uint32_t sign = (x_bits >> 24) & 0x80;
  const float a = std::fabs(x);
  // A subnormal code, or the smallest normal's (2^kMantissaBits multiples); a NaN or larger a multiplies 0 here.
  const float small = a < kMinNormal ? a : 0.0f;
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(RoundToEven(small * kPerSubnormal)));
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  bits += ((1u << (kDropped - 1)) - 1) + ((bits >> kDropped) & 1);  // a carry out of the mantissa lifts the exponent
  const uint32_t exponent = (bits >> 23) - 127 + kBias, mantissa = (bits >> kDropped) & ((1u << kMantissaBits) - 1);
  uint32_t code = a < kMinNormal ? subnormal : (exponent << kMantissaBits) | mantissa;
  code = a >= kMaxValue ? Table::kMaxCode : code;
  return static_cast<uint8_t>(x != x ? 0x7f : sign | code);
}

const Fp8Table<4>& E4m3() {
  static const Fp8Table<4> table;
  return table;
}
const Fp8Table<5>& E5m2() {
  static const Fp8Table<5> table;
  return table;
}

// The INT8 code of x: rounded to nearest even, within [-127, 127]; NaN has no code a cache could keep: 0. In
// std::min and std::max, which a loop of these vectorizes.
uint8_t EncodeInt8(float x) {
  const float code = std::min(std::max(RoundToEven(std::min(std::max(x, -128.0f), 128.0f)), -127.0f), 127.0f);
  return static_cast<uint8_t>(static_cast<int32_t>(x == x ? code : 0.0f));
}

template <v1::DataType kDtype>
uint8_t Encode(float x) {
  if constexpr (kDtype == v1::FP8_E4M3) return EncodeFp8<4>(x);
  if constexpr (kDtype == v1::FP8_E5M2) return EncodeFp8<5>(x);
  if constexpr (kDtype == v1::INT8) return EncodeInt8(x);
}

// An FP8 format's table of values.
template <v1::DataType kDtype>
const auto& Table() {
  if constexpr (kDtype == v1::FP8_E4M3) return E4m3();
  if constexpr (kDtype == v1::FP8_E5M2) return E5m2();
}

template <v1::DataType kDtype>
float Decode(uint8_t code) {
  if constexpr (kDtype == v1::INT8) return static_cast<float>(static_cast<int8_t>(code));
  if constexpr (kDtype != v1::INT8) return Table<kDtype>().Decode(code);
}

float Decode(v1::DataType dtype, uint8_t code) {
  switch (dtype) {
    case v1::FP8_E4M3:
      return Decode<v1::FP8_E4M3>(code);
    case v1::FP8_E5M2:
      return Decode<v1::FP8_E5M2>(code);
    default:
      return Decode<v1::INT8>(code);
  }
}

uint16_t LoadScale(const char* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}
void StoreScale(char* p, uint16_t bits) { std::memcpy(p, &bits, sizeof(bits)); }

// The code of x at `scale` (0: every value of the channel or token so far is 0). The division is done whatever the
// scale, by the smallest positive float at least (every positive scale is one), so that a loop of these has no
// branch to keep it from vectorizing.
template <v1::DataType kDtype>
uint8_t Quantize(float x, float scale) {
  const float scaled = x / std::max(scale, 0x1p-149f);
  return Encode<kDtype>(scale > 0 ? scaled : 0.0f);
}

// Channels a writer's pass takes at once (its buffers on the stack): even, so that INT8's depth pairs stay whole.
constexpr int64_t kPassChannels = 64;

// Key channel c's grown scale for keys of largest magnitude amax joining slots from slot0 on (its old scale `old`),
// stored, and the channel's earlier codes (KeyCodeOffset's) requantized to it. `scales` is the K part's, tb its
// block_tokens.
template <v1::DataType kDtype>
float GrowKeyScale(char* part, char* scales, int64_t tb, int64_t c, int64_t slot0, float old, float amax) {
  const uint16_t bits = ScaleBits(amax / MaxCode(kDtype));
  const float scale = ScaleValue(bits);
  StoreScale(scales + 2 * c, bits);
  uint8_t* codes = reinterpret_cast<uint8_t*>(part) + (kDtype == v1::INT8 ? c / 2 * tb * 2 + c % 2 : c * tb);
  if constexpr (kDtype == v1::INT8) {
    for (int64_t j = 0; j < slot0; ++j) codes[2 * j] = Quantize<kDtype>(Decode<kDtype>(codes[2 * j]) * old, scale);
  } else {
    const auto& table = Table<kDtype>();  // fetched once, not once a code
    for (int64_t j = 0; j < slot0; ++j) codes[j] = Quantize<kDtype>(table.Decode(codes[j]) * old, scale);
  }
  return scale;
}

// n new keys (d fp32 values each at k + i ldk) into the block's K part at slot0.., kPassChannels channels at a time:
// their scales first (a channel's grows, and its earlier keys are requantized, when a new key needs more), then each
// key's codes in one loop over the channels.
template <v1::DataType kDtype>
void WriteKeys(const KvCacheLayout& cache, char* part, int64_t slot0, int64_t n, const float* k, int64_t ldk) {
  const int64_t d = cache.head_dim, tb = cache.block_tokens, depth = PaddedDepth(cache);
  char* const scales = part + KeyScalesOffset(cache);
  for (int64_t c0 = 0; c0 < depth; c0 += kPassChannels) {
    const int64_t m = std::min(kPassChannels, depth - c0), live = std::min(m, d - c0);  // the rest pad
    float amax[kPassChannels] = {}, scale[kPassChannels] = {};
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < live; ++c) {
        const float a = std::fabs(k[i * ldk + c0 + c]);
        amax[c] = amax[c] < a ? a : amax[c];  // std::max's: a NaN key leaves the channel's amax as it was
      }
    }
    if (slot0 > 0) {
      uint16_t bits[kPassChannels];
      std::memcpy(bits, scales + 2 * c0, 2 * m);
      for (int64_t c = 0; c < m; ++c) scale[c] = ScaleValue(bits[c]);
    }
    for (int64_t c = 0; c < m; ++c) {
      if (slot0 == 0 || amax[c] / MaxCode(kDtype) > scale[c]) {
        scale[c] = GrowKeyScale<kDtype>(part, scales, tb, c0 + c, slot0, scale[c], amax[c]);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      uint8_t codes[kPassChannels] = {};  // the padding depth's stay 0
      for (int64_t c = 0; c < live; ++c) codes[c] = Quantize<kDtype>(k[i * ldk + c0 + c], scale[c]);
      // KeyCodeOffset's, with the layout's numbers in locals (a char store may alias `cache`).
      const int64_t j = slot0 + i;
      if constexpr (kDtype == v1::INT8) {
        for (int64_t c = 0; c < m; c += 2) {
          part[(c0 + c) / 2 * tb * 2 + j * 2] = static_cast<char>(codes[c]);
          part[(c0 + c) / 2 * tb * 2 + j * 2 + 1] = static_cast<char>(codes[c + 1]);
        }
      } else {
        for (int64_t c = 0; c < m; ++c) part[(c0 + c) * tb + j] = static_cast<char>(codes[c]);
      }
    }
  }
}

// The largest |x[c]| over c < n (std::max's, NaN skipped), in eight running maxima that vectorize.
float MaxMagnitude(const float* x, int64_t n) {
  float lanes[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] = std::max(lanes[l], std::fabs(x[c + l]));
  }
  for (; c < n; ++c) lanes[0] = std::max(lanes[0], std::fabs(x[c]));
  float amax = 0.0f;
  for (float lane : lanes) amax = std::max(amax, lane);
  return amax;
}

// n new values into the block's V part at slot0..: each token's scale, then its codes in one loop over the columns.
template <v1::DataType kDtype>
void WriteValues(const KvCacheLayout& cache, char* part, int64_t slot0, int64_t n, const float* v, int64_t ldv) {
  const int64_t d = cache.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = v + i * ldv;
    const uint16_t bits = ScaleBits(MaxMagnitude(row, d) / MaxCode(kDtype));
    const float scale = ScaleValue(bits);
    StoreScale(part + ValueScalesOffset(cache) + 2 * (slot0 + i), bits);
    for (int64_t c0 = 0; c0 < d; c0 += kPassChannels) {
      const int64_t m = std::min(kPassChannels, d - c0);
      uint8_t codes[kPassChannels];
      for (int64_t c = 0; c < m; ++c) codes[c] = Quantize<kDtype>(row[c0 + c], scale);
      const int64_t j = slot0 + i;  // ValueCodeOffset's, as WriteKeys' stores
      for (int64_t c = 0; c < m; ++c) {
        part[kDtype == v1::INT8 ? j / 4 * d * 4 + (c0 + c) * 4 + j % 4 : j * d + c0 + c] = static_cast<char>(codes[c]);
      }
    }
  }
}

template <v1::DataType kDtype>
void WriteHead(const KvCacheLayout& cache, char* block, int64_t g, int64_t slot0, int64_t n, const float* k,
               int64_t ldk, const float* v, int64_t ldv) {
  WriteKeys<kDtype>(cache, block + cache.KeyPart(g), slot0, n, k, ldk);
  WriteValues<kDtype>(cache, block + cache.ValuePart(g), slot0, n, v, ldv);
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
  switch (cache.dtype) {
    case v1::FP8_E4M3:
      return WriteHead<v1::FP8_E4M3>(cache, block, g, slot0, n, k, ldk, v, ldv);
    case v1::FP8_E5M2:
      return WriteHead<v1::FP8_E5M2>(cache, block, g, slot0, n, k, ldk, v, ldv);
    default:
      return WriteHead<v1::INT8>(cache, block, g, slot0, n, k, ldk, v, ldv);
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
