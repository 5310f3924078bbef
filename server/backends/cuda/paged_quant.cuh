// The 8-bit caches' device code (cache_dtype INT8, FP8_E4M3, FP8_E5M2): codes and scales as quantized_cache.h
// defines them (layout, rounding, bf16 scales rounded up, a block's key scales that only grow and requantize the
// block's earlier keys), so that the reference backend dequantizes exactly what these kernels store. Included by
// paged_kernels.cuh; compiled for the host by tests/emulated_cuda, where tests hold the codes against
// quantized_cache.cc's.
#ifndef MHA_SERVER_BACKENDS_CUDA_PAGED_QUANT_CUH_
#define MHA_SERVER_BACKENDS_CUDA_PAGED_QUANT_CUH_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"

namespace mha {
namespace cuda {
namespace device {

// The split kernel's "element type" for an 8-bit cache: its codes are read through LoadCodeTile, not as elements.
template <int kDtype>
struct Code8 {
  static constexpr int kCacheDtype = kDtype;
};
template <typename T>
struct IsCode8 {
  static constexpr bool value = false;
};
template <int kDtype>
struct IsCode8<Code8<kDtype>> {
  static constexpr bool value = true;
};

// bf16 scales, rounded up in magnitude (quant::ScaleBits / ScaleValue).
__host__ __device__ __forceinline__ uint16_t ScaleBitsOf(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return 0x7fc0;
  if ((bits & 0xffffu) != 0 && std::isfinite(x)) bits += 0x10000u;
  return static_cast<uint16_t>(bits >> 16);
}
__host__ __device__ __forceinline__ float ScaleOf(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  memcpy(&x, &wide, sizeof(x));
  return x;
}

template <int kDtype>
__host__ __device__ constexpr float MaxCodeOf() {
  return kDtype == kE4M3 ? 448.0f : kDtype == kE5M2 ? 57344.0f : 127.0f;
}

// OCP FP8 with kExponentBits (4: E4M3, 5: E5M2): nearest code, ties to even, saturating at the largest finite value;
// NaN is 0x7f. The step at x's binade (or the subnormal step) scales x to an integer count of steps, which rintf
// rounds to nearest even: that count is the code's mantissa part, and the binade's exponent its upper bits (a count
// rounded up into the next binade lands on that binade's first code).
template <int kExponentBits>
__host__ __device__ __forceinline__ uint8_t EncodeFp8(float x) {
  constexpr int kMantissa = 7 - kExponentBits, kBias = (1 << (kExponentBits - 1)) - 1;
  constexpr int kMaxCode = kExponentBits == 4 ? 0x7e : 0x7b;
  constexpr float kMax = kExponentBits == 4 ? 448.0f : 57344.0f;
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = fabsf(x);
  if (a >= kMax) return sign | kMaxCode;
  int e = 0;
  frexpf(a, &e);  // a = f 2^e, f in [0.5, 1)
  const int exponent = e - 1, min_exponent = 1 - kBias;
  const bool subnormal = a == 0.0f || exponent < min_exponent;
  const int steps = static_cast<int>(rintf(ldexpf(a, kMantissa - (subnormal ? min_exponent : exponent))));
  const int code = subnormal ? steps : ((exponent + kBias) << kMantissa) + steps - (1 << kMantissa);
  return static_cast<uint8_t>(sign | code);
}

template <int kExponentBits>
__host__ __device__ __forceinline__ float DecodeFp8(uint8_t code) {
  constexpr int kMantissa = 7 - kExponentBits, kBias = (1 << (kExponentBits - 1)) - 1;
  constexpr int kMaxCode = kExponentBits == 4 ? 0x7e : 0x7b;
  const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
  const int magnitude = code & 0x7f;
  if (magnitude > kMaxCode) return kExponentBits == 5 && magnitude == 0x7c ? sign * INFINITY : NAN;
  const int e = magnitude >> kMantissa, m = magnitude & ((1 << kMantissa) - 1);
  const float value = e == 0 ? ldexpf(static_cast<float>(m), 1 - kBias - kMantissa)
                             : ldexpf(static_cast<float>((1 << kMantissa) + m), e - kBias - kMantissa);
  return sign * value;
}

template <int kDtype>
__host__ __device__ __forceinline__ uint8_t EncodeCode(float x) {
  if (kDtype == kE4M3) return EncodeFp8<4>(x);
  if (kDtype == kE5M2) return EncodeFp8<5>(x);
  if (std::isnan(x)) return 0;  // no int8 code is NaN
  const float code = fminf(fmaxf(rintf(x), -127.0f), 127.0f);
  return static_cast<uint8_t>(static_cast<int8_t>(code));
}

template <int kDtype>
__host__ __device__ __forceinline__ float DecodeCode(uint8_t code) {
  if (kDtype == kE4M3) return DecodeFp8<4>(code);
  if (kDtype == kE5M2) return DecodeFp8<5>(code);
  return static_cast<float>(static_cast<int8_t>(code));
}

// The code of x at `scale` (0: every value of the channel or token so far is 0).
template <int kDtype>
__device__ __forceinline__ uint8_t QuantizeCode(float x, float scale) {
  return EncodeCode<kDtype>(scale > 0 ? x / scale : 0.0f);
}

// Byte offsets within a K part of (depth c, slot j) and its scales; within a V part of (slot j, column c) and its
// scales (quant::KeyCodeOffset and the others).
template <int kDtype>
__device__ __forceinline__ int64_t KeyCodeAt(int64_t c, int64_t j, int64_t bt) {
  return kDtype == kI8 ? (c / 2) * bt * 2 + j * 2 + c % 2 : c * bt + j;
}
__device__ __forceinline__ int64_t KeyScaleAt(int64_t c, int64_t dk, int64_t bt) {
  return (dk + 1) / 2 * 2 * bt + 2 * c;
}
template <int kDtype>
__device__ __forceinline__ int64_t ValueCodeAt(int64_t j, int64_t c, int64_t dk) {
  return kDtype == kI8 ? (j / 4) * dk * 4 + c * 4 + j % 4 : j * dk + c;
}
__device__ __forceinline__ int64_t ValueScaleAt(int64_t j, int64_t dk, int64_t bt) {
  return (bt + 3) / 4 * 4 * dk + 2 * j;
}

__device__ __forceinline__ uint16_t LoadScaleBits(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ void StoreScaleBits(uint8_t* p, uint16_t bits) { *reinterpret_cast<uint16_t*>(p) = bits; }

// One channel of a block's n new keys (key(i) gives new key i's value of the channel; c past head_dim is the
// padding depth, all zeros) at slots slot0.., the channel's scale grown and its earlier keys requantized when a new
// key needs it (quant::WriteTokens' WriteKeyChannel).
template <int kDtype, typename KeyOf>
__device__ __forceinline__ void WriteKeyChannel(uint8_t* part, int64_t c, int64_t dk, int64_t bt, int64_t slot0,
                                                int64_t n, KeyOf key) {
  constexpr float kMaxCode = MaxCodeOf<kDtype>();
  float amax = 0.0f;
  if (c < dk) {
    for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(key(i)));
  }
  uint8_t* scale_at = part + KeyScaleAt(c, dk, bt);
  const float old = slot0 > 0 ? ScaleOf(LoadScaleBits(scale_at)) : 0.0f;
  float scale = old;
  if (slot0 == 0 || amax / kMaxCode > old) {
    const uint16_t bits = ScaleBitsOf(amax / kMaxCode);
    scale = ScaleOf(bits);
    StoreScaleBits(scale_at, bits);
    for (int64_t j = 0; j < slot0; ++j) {
      uint8_t* code = part + KeyCodeAt<kDtype>(c, j, bt);
      *code = QuantizeCode<kDtype>(DecodeCode<kDtype>(*code) * old, scale);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    part[KeyCodeAt<kDtype>(c, slot0 + i, bt)] = QuantizeCode<kDtype>(c < dk ? key(i) : 0.0f, scale);
  }
}

// One new token's value row v[0..dk) into slot j of a block's V part, with a scale of its own.
template <int kDtype>
__device__ __forceinline__ void WriteValueRow(uint8_t* part, int64_t j, int64_t dk, int64_t bt, const float* v) {
  float amax = 0.0f;
  for (int64_t c = 0; c < dk; ++c) amax = fmaxf(amax, fabsf(v[c]));
  const uint16_t bits = ScaleBitsOf(amax / MaxCodeOf<kDtype>());
  const float scale = ScaleOf(bits);
  StoreScaleBits(part + ValueScaleAt(j, dk, bt), bits);
  for (int64_t c = 0; c < dk; ++c) part[ValueCodeAt<kDtype>(j, c, dk)] = QuantizeCode<kDtype>(v[c], scale);
}

// One tile of kPagedTileKeys keys from t0 (keys at or past `end` read as 0) of one KV head's 8-bit part at byte
// `base` of each block, dequantized into shared memory as fp32: K^T [kDim][kTile + 1] (`key` = true) or V
// [kTile][kDim]. Consecutive threads read consecutive bytes of each layout.
template <int kDtype, int kDim, bool kKey>
__device__ __forceinline__ void LoadCodeTile(const PagedParams& p, char* const* blocks, int64_t base, int64_t t0,
                                             int64_t end, float* tile) {
  constexpr int kTile = kPagedTileKeys;
  const int64_t dk = p.head_dim, bt = p.block_tokens, depth = kKey ? (dk + 1) / 2 * 2 : dk;
  for (int64_t idx = threadIdx.x; idx < depth * kTile; idx += blockDim.x) {
    int64_t jj, c;
    if (kKey) {
      c = kDtype == kI8 ? idx / (2 * kTile) * 2 + idx % 2 : idx / kTile;
      jj = kDtype == kI8 ? idx / 2 % kTile : idx % kTile;
      if (c >= dk) continue;  // the padding depth: never read
    } else {
      jj = kDtype == kI8 ? idx / (4 * dk) * 4 + idx % 4 : idx / dk;
      c = kDtype == kI8 ? idx / 4 % dk : idx % dk;
    }
    const int64_t j = t0 + jj;
    float value = 0;
    if (j < end) {  // slots past the cache may hold anything
      const uint8_t* part = reinterpret_cast<const uint8_t*>(blocks[j / bt]) + base;
      const int64_t slot = j % bt;
      value = kKey ? DecodeCode<kDtype>(part[KeyCodeAt<kDtype>(c, slot, bt)]) *
                         ScaleOf(LoadScaleBits(part + KeyScaleAt(c, dk, bt)))
                   : DecodeCode<kDtype>(part[ValueCodeAt<kDtype>(slot, c, dk)]) *
                         ScaleOf(LoadScaleBits(part + ValueScaleAt(slot, dk, bt)));
    }
    tile[kKey ? c * (kTile + 1) + jj : jj * kDim + c] = value;
  }
}

}  // namespace device
}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_PAGED_QUANT_CUH_
