// The 8-bit KV cache blocks (cache_dtype INT8, FP8_E4M3, FP8_E5M2): their layout, how tokens are quantized into
// them and read back. Every backend writes and reads through these functions, so that the reference backend (the
// ground truth) dequantizes exactly what the others store.
//
// Layout of one KV head's parts in a block (KvCacheLayout::KeyPart / ValuePart), d = head_dim, tb = block_tokens,
// Dp = d rounded up to even, Tp = tb rounded up to a multiple of 4:
//  - K part: Dp x tb codes, then Dp bf16 key scales, one per channel for the whole block. INT8 stores depth pairs
//    of each key together ([Dp / 2][tb][2]: the int16 products of x86's vpmaddwd pair two depths of one key); FP8
//    stores K^T ([Dp][tb]). The padding depth of an odd d holds zeros.
//  - V part: Tp x d codes, then Tp bf16 value scales, one per token. INT8 stores key quads of each column together
//    ([Tp / 4][d][4]: vpmaddubsw and vpdpbusd sum four keys of one column); FP8 stores V ([Tp][d]).
// A code times its scale is the value: INT8 codes are integers in [-127, 127]; FP8 codes are OCP FP8 (E4M3, no
// infinities, max 448; E5M2, max 57344). Scales are the amax over 127 (or the format's max), rounded up to bf16.
// A block's key scale of a channel only grows: a key larger than the scale allows requantizes the channel's earlier
// keys in the block to the new scale (a second rounding of those, within half a code of the new scale).
//
// Thread-safety: functions on one block must not run concurrently with writes to it; distinct blocks are
// independent.
#ifndef MHA_SERVER_BACKENDS_QUANTIZED_CACHE_H_
#define MHA_SERVER_BACKENDS_QUANTIZED_CACHE_H_

#include <cstdint>

#include "server/backends/backend.h"

namespace mha::quant {

inline int64_t PaddedDepth(const KvCacheLayout& c) { return (c.head_dim + 1) / 2 * 2; }
inline int64_t PaddedTokens(const KvCacheLayout& c) { return (c.block_tokens + 3) / 4 * 4; }

// The largest code's magnitude: 127, 448 or 57344.
float MaxCode(v1::DataType dtype);
// x rounded up (in magnitude) to the nearest bf16, and its bits.
uint16_t ScaleBits(float x);
float ScaleValue(uint16_t bits);

// The OCP FP8 formats: rounded to nearest even, saturating at the format's max (NaN stays NaN in E5M2, and
// becomes E4M3's NaN code 0x7f).
uint8_t EncodeE4m3(float x);
float DecodeE4m3(uint8_t code);
uint8_t EncodeE5m2(float x);
float DecodeE5m2(uint8_t code);

// Byte offsets, within a K part, of the code of (depth c, key j) and of the scales; within a V part, of (key j,
// column c) and of the scales.
int64_t KeyCodeOffset(const KvCacheLayout& cache, int64_t c, int64_t j);
inline int64_t KeyScalesOffset(const KvCacheLayout& cache) { return PaddedDepth(cache) * cache.block_tokens; }
int64_t ValueCodeOffset(const KvCacheLayout& cache, int64_t j, int64_t c);
inline int64_t ValueScalesOffset(const KvCacheLayout& cache) { return PaddedTokens(cache) * cache.head_dim; }

// Writes n tokens' keys and values (d fp32 values each at k + i ldk and v + i ldv) of KV head g into slots
// slot0..slot0+n-1 of `block`. Slots before slot0 hold earlier tokens of the same cache (slot0 = 0: the block holds
// nothing yet, whatever its bytes are).
void WriteTokens(const KvCacheLayout& cache, char* block, int64_t g, int64_t slot0, int64_t n, const float* k,
                 int64_t ldk, const float* v, int64_t ldv);

// Key (depth c) and value (column c) of slot j of KV head g, dequantized.
float KeyAt(const KvCacheLayout& cache, const char* block, int64_t g, int64_t j, int64_t c);
float ValueAt(const KvCacheLayout& cache, const char* block, int64_t g, int64_t j, int64_t c);

// The first `keys` slots of KV head g dequantized: k[j ldk + c] and v[j ldv + c] for c < head_dim.
void ReadTokens(const KvCacheLayout& cache, const char* block, int64_t g, int64_t keys, float* k, int64_t ldk,
                float* v, int64_t ldv);

}  // namespace mha::quant

#endif  // MHA_SERVER_BACKENDS_QUANTIZED_CACHE_H_
