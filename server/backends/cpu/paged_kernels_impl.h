// The body of the sessions' decode kernels (tile_kernels.h's PagedKernels), included by tile_kernels_impl.h inside
// namespace mha::kernels::<isa> after `struct Isa`, which adds to the tile kernels' operations:
//   LoadHalf(p) / LoadBf16(p): kLanes fp16 / bf16 elements at p widened to fp32;
//   kPagedVectors: vectors of 16 keys; kPagedMaxVectors: the widest group of key vectors a scores block takes (a
//   power of two times kPagedVectors); kPagedAccumulators: the vectors of accumulators a scores block may hold;
//   kPagedValueRows x kPagedValueVectors: the values' register block;
//   kPrefillScoreRows x kPrefillScoreVectors and kPrefillValueRows x kPrefillValueVectors: the register blocks of a
//   prefill tile's many rows (PagedKernels' prefill_scores and prefill_values).
// Free of standard-library templates, like the tile kernels (compiled with this TU's -m flags).

// Cache element types: fp32, and the 16-bit ones as tags over their bits.
struct Half {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};

// FP8 codes (quantized_cache.h), widened through fp16's bits: an E5M2 code is the top byte of the fp16 of its value;
// an E4M3 code's exponent and mantissa bits, placed in fp16's, read 2^-8 of its value (the kernels fold the 256 into
// the scales).
struct E4m3 {
  uint8_t bits;
};
struct E5m2 {
  uint8_t bits;
};
inline uint16_t HalfBits(E4m3 x) {
  return static_cast<uint16_t>(((x.bits & 0x80u) << 8) | ((x.bits & 0x7fu) << 7));
}
inline uint16_t HalfBits(E5m2 x) { return static_cast<uint16_t>(x.bits << 8); }
// FP8 codes read as fp32's bits, the sign in fp32's and the exponent and mantissa bits in the low ones of fp32's:
// 2^-120 (E4M3) or 2^-112 (E5M2) of the code's value, subnormal codes included (as fp32 subnormals; nothing here
// sets denormals-are-zero), in three instructions per vector where E4M3's fp16 route takes five. The kernels fold the
// factor into q times the key scales and the weights times the value scales; where that passes fp32's range (q
// times a key scale, or a weight times a value scale, of 2^8 or more for E4M3: keys or values near 10^5) a call
// takes the fp16 route (Via), whose factor of 256 or 1 does not.
template <typename Half8>
struct InFp32Bits {
  using Via = Half8;
  uint8_t bits;
};
template <typename E>
inline constexpr bool kInFp32Bits = false;
template <typename H>
inline constexpr bool kInFp32Bits<InFp32Bits<H>> = true;
// The FP8 types a set's kernels take: fp32's bits where its widening has them in three instructions (AVX2, AVX-512),
// fp16's in plain loops.
#if defined(__AVX2__)
using E4m3Code = InFp32Bits<E4m3>;
using E5m2Code = InFp32Bits<E5m2>;
#else
using E4m3Code = E4m3;
using E5m2Code = E5m2;
#endif
template <typename E>
inline constexpr bool kIsFp8 = sizeof(E) == 1;
// Whether a part's own lines are prefetched into L1 as it is read (Ahead's `here`): fp32 on AVX-512, whose kernel
// waits on its loads; the 16-bit and FP8 widening kernels and the AVX2 set are bound by their instructions, and the
// prefetches cost them more than they save (docs/PERFORMANCE.md).
template <typename E>
inline constexpr bool kPrefetchPart = Isa::kLanes == 16 && sizeof(E) == 4;
// The factor an FP8 element's widened value is short of the code's value.
constexpr float WidenedFactor(E4m3) { return 256.0f; }
constexpr float WidenedFactor(E5m2) { return 1.0f; }
constexpr float WidenedFactor(InFp32Bits<E4m3>) { return 0x1p120f; }
constexpr float WidenedFactor(InFp32Bits<E5m2>) { return 0x1p112f; }
// Where InFp32Bits puts a code's exponent and mantissa bits: shifted left by 20 (E4M3's 3 mantissa bits) or 21
// (E5M2's 2), under this mask with the sign.
template <typename H>
inline constexpr int kFp32BitsShift = WidenedFactor(H{}) != 1.0f ? 20 : 21;
template <typename H>
inline constexpr uint32_t kFp32BitsMask = 0x80000000u | (0x7fu << kFp32BitsShift<H>);
template <typename H>
inline uint32_t Fp32Bits(InFp32Bits<H> x) {
  return (static_cast<uint32_t>(x.bits & 0x80u) << 24) | (static_cast<uint32_t>(x.bits & 0x7fu) << kFp32BitsShift<H>);
}

inline Isa::V LoadElements(const float* p) { return Isa::Load(p); }
inline Isa::V LoadElements(const Half* p) { return Isa::LoadHalf(&p->bits); }
inline Isa::V LoadElements(const Bf16* p) { return Isa::LoadBf16(&p->bits); }
template <typename E, typename = decltype(HalfBits(E{}))>
inline Isa::V LoadElements(const E* p) {
  [[maybe_unused]] constexpr bool kE4m3 = WidenedFactor(E{}) != 1.0f;
#if defined(__AVX512F__)
  // E4M3: sign-extended and shifted, the sign lands in fp16's sign and bit 14, which the mask clears.
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i bits = kE4m3 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                                                _mm256_set1_epi16(static_cast<int16_t>(0xbf80)))
                             : _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 8);
  return _mm512_cvtph_ps(bits);
#elif defined(__AVX2__)
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i bits = kE4m3 ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7),
                                             _mm_set1_epi16(static_cast<int16_t>(0xbf80)))
                             : _mm_unpacklo_epi8(_mm_setzero_si128(), codes);
  return _mm256_cvtph_ps(bits);
#else
  uint16_t halves[Isa::kLanes];
  for (int i = 0; i < Isa::kLanes; ++i) halves[i] = HalfBits(p[i]);
  return Isa::LoadHalf(halves);
#endif
}

#if defined(__AVX2__)
template <typename H>
inline Isa::V LoadElements(const InFp32Bits<H>* p) {
  // Sign-extended, the shift puts the sign's copies in fp32's sign and the exponent's top bits, which the mask clears.
  constexpr int kShift = kFp32BitsShift<H>;
  constexpr int kMask = static_cast<int>(kFp32BitsMask<H>);
#if defined(__AVX512F__)
  const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(x, kShift), _mm512_set1_epi32(kMask)));
#else
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, kShift), _mm256_set1_epi32(kMask)));
#endif
}
#endif

inline float Widen(float x) { return x; }
inline float Widen(Half x) {
  // IEEE binary16 to binary32, exactly (subnormals, infinities and NaN included).
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16, exponent = (x.bits >> 10) & 0x1f,
                 mantissa = x.bits & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    float value = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // mantissa * 2^-24
    __builtin_memcpy(&bits, &value, sizeof(bits));
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float Widen(E4m3 x) { return Widen(Half{HalfBits(x)}); }
inline float Widen(E5m2 x) { return Widen(Half{HalfBits(x)}); }
template <typename H>
inline float Widen(InFp32Bits<H> x) {
  const uint32_t bits = Fp32Bits(x);
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float Widen(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// n (1..kLanes) elements at p, the other lanes zero.
template <typename E>
inline Isa::V LoadElementsPartial(const E* p, int n) {
  float widened[Isa::kLanes];
  for (int i = 0; i < n; ++i) widened[i] = Widen(p[i]);
  return Isa::LoadPartial(widened, n, 0.0f);
}

#include "server/backends/cpu/paged_kernels_common.h"  // Ahead, WithRows
#include "server/backends/cpu/paged_kernels_int8.h"    // Int8Scores, Int8Values, ScaleOf

// acc + a b, the sum left in acc's register. On AVX2 written as inline assembly: through the intrinsic GCC 12 let
// the sum land in a or b's register once the key loop was unrolled, and the copies back cost the front end what the
// FMAs need.
inline Isa::V AddProduct(Isa::V acc, Isa::V a, Isa::V b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __asm__("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
#else
  return Isa::Fma(a, b, acc);
#endif
}

// Paired bf16 (AVX2): 2 kLanes bf16 elements loaded as one vector of pairs, split into their even elements (each
// pair's low word shifted up) and odd ones (the high word masked): two instructions per 2 kLanes elements where
// widening each half takes four, which on AVX2 share the ports with the FMAs that bound the 16-bit decode. The
// kernels below compute in that order (even, odd) and put results back in memory order once per register block.
template <typename E>
inline constexpr bool kPaired = false;
#if defined(__AVX2__) && !defined(__AVX512F__)
template <>
inline constexpr bool kPaired<Bf16> = true;
inline void LoadPaired(const Bf16* p, Isa::V* even, Isa::V* odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
// (even, odd) of 16 elements to (elements 0..7, 8..15), and back.
inline void ToMemoryOrder(Isa::V* a, Isa::V* b) {
  const __m256 lo = _mm256_unpacklo_ps(*a, *b), hi = _mm256_unpackhi_ps(*a, *b);  // 0-3 8-11, 4-7 12-15
  *a = _mm256_permute2f128_ps(lo, hi, 0x20);
  *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}
inline void ToPairedOrder(Isa::V* a, Isa::V* b) {
  const __m256 even = _mm256_shuffle_ps(*a, *b, 0x88), odd = _mm256_shuffle_ps(*a, *b, 0xdd);  // 0 2 8 10 4 6 12 14
  *a = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8));
  *b = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8));
}
#else
inline void ToMemoryOrder(Isa::V*, Isa::V*) {}
inline void ToPairedOrder(Isa::V*, Isa::V*) {}
#endif

// kVectors vectors of elements from p: in memory order, or in kPaired<E>'s pairs (kVectors even).
template <typename E, int kVectors>
inline void LoadVectors(const E* p, Isa::V* b) {
  if constexpr (kPaired<E> && kVectors % 2 == 0) {
    MHA_UNROLL for (int v = 0; v < kVectors; v += 2) LoadPaired(p + v * Isa::kLanes, &b[v], &b[v + 1]);
  } else {
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) b[v] = LoadElements(p + v * Isa::kLanes);
  }
}

// kRows rows of scores for kVectors vectors of keys, the whole depth in registers; depths c with c % kSets apart in
// kSets sets of accumulators (more independent FMA chains when the block is small: 16 on AVX-512 cover the FMA
// latency of both ports).
template <typename E, int kRows, int kVectors, int kSets>
inline void PagedScoreBlock(int64_t depth, const float* q, int64_t ldq, const E* kt, int64_t ldk, float* s,
                            int64_t lds, Ahead& ahead) {
  using V = Isa::V;
  V acc[kSets][kRows][kVectors];
  MHA_UNROLL for (int h = 0; h < kSets; ++h) {
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[h][r][v] = Isa::Zero();
    }
  }
  // kDepths depths an iteration (two where one set of accumulators takes them all) and one Step per two depths, as
  // PagedScores counts them: the loop's and the prefetches' bookkeeping, which on AVX2 competed with the FMAs for
  // the front end, paid once per two depths.
  constexpr int kDepths = kSets == 1 ? 2 : kSets;
  const auto depth_row = [&](int64_t c, V (&sums)[kRows][kVectors]) {
    V b[kVectors];
    LoadVectors<E, kVectors>(kt + c * ldk, b);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const V a = Isa::Broadcast(q + r * ldq + c);
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) sums[r][v] = AddProduct(sums[r][v], a, b[v]);
    }
  };
  int64_t c = 0;
  for (; c + kDepths <= depth; c += kDepths) {
    MHA_UNROLL for (int d = 0; d < kDepths; d += 2) ahead.Step();
    MHA_UNROLL for (int d = 0; d < kDepths; ++d) depth_row(c + d, acc[d % kSets]);
  }
  for (; c < depth; ++c) depth_row(c, acc[0]);  // the depths that fill no iteration
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    V sums[kVectors];
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) {
      sums[v] = acc[0][r][v];
      MHA_UNROLL for (int h = 1; h < kSets; ++h) sums[v] = Isa::Add(sums[v], acc[h][r][v]);
    }
    if constexpr (kPaired<E> && kVectors % 2 == 0) {
      MHA_UNROLL for (int v = 0; v < kVectors; v += 2) ToMemoryOrder(&sums[v], &sums[v + 1]);
    }
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) Isa::Store(s + r * lds + v * Isa::kLanes, sums[v]);
  }
}

// Every row block of `keys` keys (a multiple of kVectors vectors) in groups of kVectors vectors, kBudget vectors of
// accumulators: as many rows as fill it.
template <typename E, int kVectors, int kBudget = Isa::kPagedAccumulators>
inline void PagedScoreGroups(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const E* kt,
                             int64_t ldk, float* s, int64_t lds, Ahead& ahead) {
  constexpr int kRows = kBudget / kVectors;
  for (int64_t j = 0; j < keys; j += kVectors * Isa::kLanes) {
    for (int64_t i = 0; i < rows; i += kRows) {
      WithRows<kRows>(rows - i < kRows ? rows - i : kRows, [&](auto height) {
        constexpr int kHeight = decltype(height)::kValue;
        // A short block splits its depths to keep the budget's FMA chains in flight (up to 4 sets).
        constexpr int kFree = kBudget / (kHeight * kVectors);
        constexpr int kSets = kFree >= 4 ? 4 : kFree >= 2 ? 2 : 1;
        PagedScoreBlock<E, kHeight, kVectors, kSets>(depth, q + i * ldq, ldq, kt + j, ldk, s + i * lds + j, lds,
                                                     ahead);
      });
    }
  }
}

// out (rows x n, dense) = x's rows (row stride ldx) times the bf16 scales per column times E's widened factor: an
// FP8 block's q times its key scales, or weights times its value scales. Whether every product stayed within fp32's
// range (false also where x holds a NaN): where not, an InFp32Bits call takes its fp16 route (Via), whose factor does
// not carry them past it.
template <typename E>
inline bool ScaledFp8Rows(int64_t rows, const float* x, int64_t ldx, const uint16_t* scales, int64_t n, float* out) {
  float largest = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float m = ScaledRow(x + r * ldx, scales, n, out + r * n, WidenedFactor(E{}));
    largest = m > largest ? m : largest;
  }
  return largest <= __FLT_MAX__;
}

template <typename E>
void PagedScores(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
                 int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
                 int64_t ahead_size) {
  const E* kt = static_cast<const E*>(kt_bytes);
  // An FP8 block's q times its key scales, per channel (each row's zeros past depth reach into the next row's).
  float scaled[kInt8MaxRows * kInt8MaxDepth + 16];
  if constexpr (kIsFp8<E>) {
    [[maybe_unused]] const bool in_range = ScaledFp8Rows<E>(rows, q, ldq, key_scales, depth, scaled);
    if constexpr (kInFp32Bits<E>) {
      if (!in_range) {
        PagedScores<typename E::Via>(rows, keys, depth, q, ldq, kt_bytes, ldk, key_scales, s, lds, ahead_bytes,
                                     ahead_size);
        return;
      }
    }
    q = scaled;
    ldq = depth;
  }
  // The widest group of keys that divides the block: each q value loaded then feeds that many vectors.
  constexpr int kGroup = Isa::kPagedMaxVectors, kMid = kGroup > 1 ? kGroup / 2 : 1;
  const int vectors = keys % (kGroup * Isa::kLanes) == 0 ? kGroup
                      : keys % (kMid * Isa::kLanes) == 0 ? kMid
                                                         : Isa::kPagedVectors;
  const int64_t row_blocks = (rows + Isa::kPagedAccumulators / vectors - 1) / (Isa::kPagedAccumulators / vectors);
  Ahead ahead(ahead_bytes, ahead_size, keys / (vectors * Isa::kLanes) * row_blocks * depth / 2,
              kPrefetchPart<E> ? kt_bytes : nullptr);
  if (vectors == kGroup) {
    PagedScoreGroups<E, kGroup>(rows, keys, depth, q, ldq, kt, ldk, s, lds, ahead);
  } else if (vectors == kMid) {
    PagedScoreGroups<E, kMid>(rows, keys, depth, q, ldq, kt, ldk, s, lds, ahead);
  } else {
    PagedScoreGroups<E, Isa::kPagedVectors>(rows, keys, depth, q, ldq, kt, ldk, s, lds, ahead);
  }
}

// The V parts a values kernel reads: `blocks` parts (each a block's V of one KV head, rows of `width` elements) of
// block_keys keys each but the last, of last_keys; column `column` of each row on. Key j of part b is p's column
// b block_keys + j.
template <typename E>
struct ValueParts {
  const void* const* parts;
  int64_t blocks, block_keys, last_keys, column;
  const E* Part(int64_t b) const { return static_cast<const E*>(parts[b]) + column; }
  int64_t Keys(int64_t b) const { return b + 1 < blocks ? block_keys : last_keys; }
};

// kRows rows of kVectors vectors of o (the last holding last_lanes columns), rescaled by o_scale, plus p V over
// every part: the accumulators stay in registers from the first part's first key to the last part's last. kPairs:
// the columns in kPaired<E>'s order in between (whole vectors only).
template <typename E, int kRows, int kVectors, bool kMulti, bool kPairs = false>
inline void PagedValueBlock(const ValueParts<E>& v, int64_t width, const float* p, int64_t ldp, const float* o_scale,
                            float* o, int64_t ldo, int last_lanes, Ahead& ahead) {
  using V = Isa::V;
  V acc[kRows][kVectors];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    const V factor = o_scale != nullptr ? Isa::Broadcast(o_scale + r) : Isa::Splat(1.0f);
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
      const float* old = o + r * ldo + x * Isa::kLanes;
      const bool partial = x == kVectors - 1 && last_lanes < Isa::kLanes;
      acc[r][x] = Isa::Mul(factor, partial ? Isa::LoadPartial(old, last_lanes, 0.0f) : Isa::Load(old));
    }
    if constexpr (kPairs) {
      MHA_UNROLL for (int x = 0; x < kVectors; x += 2) ToPairedOrder(&acc[r][x], &acc[r][x + 1]);
    }
  }
  // One key's products; kPartial: the last vector holds last_lanes columns (a test hoisted out of the key loop).
  const auto key = [&](const E* row, const float* pp, auto partial) {
    V b[kVectors];
    if constexpr (kPairs) {
      LoadVectors<E, kVectors>(row, b);
    } else {
      MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
        b[x] = decltype(partial)::kValue && x == kVectors - 1 ? LoadElementsPartial(row + x * Isa::kLanes, last_lanes)
                                                               : LoadElements(row + x * Isa::kLanes);
      }
    }
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const V a = Isa::Broadcast(pp + r * ldp);
      MHA_UNROLL for (int x = 0; x < kVectors; ++x) acc[r][x] = AddProduct(acc[r][x], a, b[x]);
    }
  };
  // Two keys a step: the loop's and the prefetches' bookkeeping, which on AVX2 competed with the FMAs for the
  // front end, paid once per pair (ValuesOverParts counts the steps so).
  const auto keys_of = [&](const E* rows, const float* pp, int64_t keys, auto partial) {
    int64_t j = 0;
    for (; j + 2 <= keys; j += 2) {
      ahead.Step();
      key(rows + j * width, pp + j, partial);
      key(rows + (j + 1) * width, pp + j + 1, partial);
    }
    if (j < keys) {
      ahead.Step();
      key(rows + j * width, pp + j, partial);
    }
  };
  const auto part = [&](const E* rows, const float* pp, int64_t keys) {
    if (last_lanes < Isa::kLanes) {
      keys_of(rows, pp, keys, Flag<true>{});
    } else {
      keys_of(rows, pp, keys, Flag<false>{});
    }
  };
  // One part without the loop over parts: on AVX2 its bookkeeping took registers the accumulators need.
  if constexpr (kMulti) {
    for (int64_t k = 0; k < v.blocks; ++k) part(v.Part(k), p + k * v.block_keys, v.Keys(k));
  } else {
    part(v.Part(0), p, v.Keys(0));
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    if constexpr (kPairs) {
      MHA_UNROLL for (int x = 0; x < kVectors; x += 2) ToMemoryOrder(&acc[r][x], &acc[r][x + 1]);
    }
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
      if (x == kVectors - 1 && last_lanes < Isa::kLanes) {
        Isa::StorePartial(o + r * ldo + x * Isa::kLanes, acc[r][x], last_lanes);
      } else {
        Isa::Store(o + r * ldo + x * Isa::kLanes, acc[r][x]);
      }
    }
  }
}

// Every row block (of kRows rows) of one column panel of up to kVectors vectors (`vectors` of them).
template <typename E, int kRows, int kVectors, bool kMulti>
inline void PagedValuePanel(int64_t vectors, int64_t rows, const ValueParts<E>& v, int64_t width, const float* p,
                            int64_t ldp, const float* o_scale, float* o, int64_t ldo, int last_lanes, Ahead& ahead) {
  if constexpr (kVectors > 1) {
    if (vectors < kVectors) {
      PagedValuePanel<E, kRows, kVectors - 1, kMulti>(vectors, rows, v, width, p, ldp, o_scale, o, ldo, last_lanes,
                                                      ahead);
      return;
    }
  }
  const bool pairs = kPaired<E> && kVectors % 2 == 0 && last_lanes == Isa::kLanes;
  for (int64_t i = 0; i < rows; i += kRows) {
    WithRows<kRows>(rows - i < kRows ? rows - i : kRows, [&](auto height) {
      constexpr int kHeight = decltype(height)::kValue;
      const float* factor = o_scale == nullptr ? nullptr : o_scale + i;
      if (pairs) {
        PagedValueBlock<E, kHeight, kVectors, kMulti, kPaired<E> && kVectors % 2 == 0>(
            v, width, p + i * ldp, ldp, factor, o + i * ldo, ldo, last_lanes, ahead);
      } else {
        PagedValueBlock<E, kHeight, kVectors, kMulti>(v, width, p + i * ldp, ldp, factor, o + i * ldo, ldo,
                                                      last_lanes, ahead);
      }
    });
  }
}

// The values over `blocks` V parts (ValueParts) with a register block of kRows rows and up to kVectors vectors of
// columns, panel after panel of columns, kParts parts at a time: each row block keeps its outputs in registers over
// that many parts, and every row block passes over them (on AVX2 one part at a time, which stays in L1, is faster).
template <typename E, int kRows, int kVectors, int kParts>
void ValuesOverParts(int64_t rows, const void* const* parts, const uint16_t* const* /*value_scales: none*/,
                     int64_t blocks, int64_t block_keys, int64_t last_keys, int64_t width, const float* p, int64_t ldp,
                     const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes, int64_t ahead_size) {
  constexpr int64_t kPanel = kVectors * Isa::kLanes;
  const int64_t row_blocks = (rows + kRows - 1) / kRows, panels = (width + kPanel - 1) / kPanel;
  for (int64_t g = 0; g < blocks; g += kParts) {
    const int64_t count = blocks - g < kParts ? blocks - g : kParts;
    const int64_t last = g + count == blocks ? last_keys : block_keys;
    // The next group's first part (as long as `ahead`, a part's V) streams in while this group computes.
    Ahead ahead(g + count < blocks ? parts[g + count] : ahead_bytes, ahead_size,
                ((count - 1) * ((block_keys + 1) / 2) + (last + 1) / 2) * panels * row_blocks,
                kPrefetchPart<E> && count == 1 ? parts[g] : nullptr);
    for (int64_t c = 0; c < width; c += kPanel) {
      const int64_t left = width - c;
      const int64_t vectors = left >= kPanel ? kVectors : (left + Isa::kLanes - 1) / Isa::kLanes;
      const int64_t lanes = left - (vectors - 1) * Isa::kLanes;
      const ValueParts<E> v{parts + g, count, block_keys, last, c};
      // The first parts rescale the outputs; the later ones add to them.
      PagedValuePanel<E, kRows, kVectors, (kParts > 1)>(vectors, rows, v, width, p + g * block_keys, ldp,
                                          g == 0 ? o_scale : nullptr, o + c, ldo,
                                          static_cast<int>(lanes < Isa::kLanes ? lanes : Isa::kLanes), ahead);
    }
  }
}

// PagedKernels::values: one block's V.
template <typename E>
void PagedValues(int64_t rows, int64_t keys, int64_t width, const float* p, int64_t ldp, const void* v_bytes,
                 const uint16_t* value_scales, const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes,
                 int64_t ahead_size) {
  float scaled[kInt8MaxRows * kInt8MaxKeys + 16];  // an FP8 block's p times its value scales, per token
  if constexpr (kIsFp8<E>) {
    [[maybe_unused]] const bool in_range = ScaledFp8Rows<E>(rows, p, ldp, value_scales, keys, scaled);
    if constexpr (kInFp32Bits<E>) {
      if (!in_range) {
        PagedValues<typename E::Via>(rows, keys, width, p, ldp, v_bytes, value_scales, o_scale, o, ldo, ahead_bytes,
                                     ahead_size);
        return;
      }
    }
    p = scaled;
    ldp = keys;
  }
  ValuesOverParts<E, Isa::kPagedValueRows, Isa::kPagedValueVectors, 1>(rows, &v_bytes, nullptr, 1, keys, keys, width,
                                                                       p, ldp, o_scale, o, ldo, ahead_bytes,
                                                                       ahead_size);
}

// PagedKernels::prefill_scores: register blocks of kPrefillScoreRows rows of kPrefillScoreVectors vectors of keys, or
// of one vector (as many rows) when a block's keys are not a multiple of that.
template <typename E>
void PrefillScores(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
                   int64_t ldk, const uint16_t* /*key_scales: none*/, float* s, int64_t lds, const void* ahead_bytes,
                   int64_t ahead_size) {
  const E* kt = static_cast<const E*>(kt_bytes);
  constexpr int kVectors = Isa::kPrefillScoreVectors, kBudget = Isa::kPrefillScoreRows * kVectors;
  const bool wide = keys % (kVectors * Isa::kLanes) == 0;
  const int vectors = wide ? kVectors : 1;
  const int64_t row_blocks = (rows + kBudget / vectors - 1) / (kBudget / vectors);
  Ahead ahead(ahead_bytes, ahead_size, keys / (vectors * Isa::kLanes) * row_blocks * depth / 2);
  if (wide) {
    PagedScoreGroups<E, kVectors, kBudget>(rows, keys, depth, q, ldq, kt, ldk, s, lds, ahead);
  } else {
    PagedScoreGroups<E, 1, Isa::kPrefillScoreRows>(rows, keys, depth, q, ldq, kt, ldk, s, lds, ahead);
  }
}

// Decode: the kPaged register blocks; prefill: the kPrefill ones. The 8-bit caches' prefill runs their decode
// kernels over groups of rows.
template <typename E>
constexpr PagedKernels KernelsOf() {
  if constexpr (kIsFp8<E>) {
    return {&PagedScores<E>, &PagedValues<E>, &ScoresInRowGroups<&PagedScores<E>>,
            &ValuesPartByPart<&PagedValues<E>>};
  } else {
    return {&PagedScores<E>, &PagedValues<E>, &PrefillScores<E>,
            &ValuesOverParts<E, Isa::kPrefillValueRows, Isa::kPrefillValueVectors, Isa::kPrefillValueParts>};
  }
}
// By cache dtype - 1 (FP32, FP16, BF16, INT8, FP8_E4M3, FP8_E5M2).
extern const PagedKernels kPagedKernels[kPagedDtypes] = {
    KernelsOf<float>(), KernelsOf<Half>(),  KernelsOf<Bf16>(),
    {&Int8Scores, &Int8Values, &ScoresInRowGroups<&Int8Scores>, &ValuesPartByPart<&Int8Values>},
    KernelsOf<E4m3Code>(), KernelsOf<E5m2Code>()};
