// The sessions' decode kernels for INT8 caches (tile_kernels.h's PagedKernels::scores and values), which multiply
// the cache's codes in integers instead of widening each to fp32: included inside namespace mha::kernels::<isa>,
// after Ahead and WithRows, by paged_kernels_impl.h (AVX-512BW, AVX2 or plain loops, by the TU's flags) and by
// paged_kernels_int8_vnni.cc (AVX512-VNNI). The block layout is quantized_cache.h's.
//
// Scores: q times the block's key scales (per channel), rounded to int16 per row (its scale: the row's largest value
// over the largest code whose sums stay within int32), against the keys' int8 codes: vpmaddwd adds the products of
// two depths of one key into its 32-bit lane, exactly; AVX512-VNNI rounds q to int8 instead and adds four depths'
// products per lane (Int8ScoresInQuads). Values: the probabilities times the value scales (per token), rounded to 7
// bits per row (p >= 0, so [0, 127]), against the values' codes: vpmaddubsw adds two keys' products of one column
// into 16 bits (at most 2 x 127 x 127, no saturation), vpmaddwd two of those. Sums are exact integers; each row's
// result is converted to fp32 and scaled once per block. Free of standard-library templates, like the kernels around
// it.

// The largest depth, block and rows the 8-bit kernels take (their per-row buffers live on the stack); deeper heads or
// larger blocks take the gather path (paged_attention.h).
inline constexpr int64_t kInt8MaxDepth = kQuantizedMaxElements, kInt8MaxKeys = kQuantizedMaxElements;
inline constexpr int64_t kInt8MaxRows = kQuantizedMaxRows;

#if defined(__AVX512BW__)
struct I8Avx512 {
  using W = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kScoreRows = 8;  // rows of a scores block (of two vectors of keys: 16 accumulators)
  static constexpr int kValueRows = 4;  // rows of a values block (of four vectors of columns: 16 accumulators)
  static W Zero() { return _mm512_setzero_si512(); }
  // kLanes keys' pairs of depths (2 kLanes codes) sign-extended to int16.
  static W KeyPairs(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // kLanes columns' quads of keys (4 kLanes codes).
  static W ValueQuads(const int8_t* p) { return _mm512_loadu_si512(p); }
  static void StoreScaled(float* out, W acc, float scale) {
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(scale)));
  }
  static void Update(float* o, W acc, float scale, float factor) {
    const __m512 old = _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(factor));
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(scale), old));
  }
  // kLanes values x times their scales times `mul`, rounded to nearest even, as int16 and as bytes (each within the
  // type's range).
  static void ToInt16(const float* x, const float* scale, float mul, int16_t* out) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(scale)), _mm512_set1_ps(mul));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
  }
  static void ToBytes(const float* x, const float* scale, float mul, uint8_t* out) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(scale)), _mm512_set1_ps(mul));
    const __m512i n = _mm512_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(n));
  }
};
#if defined(__AVX512VNNI__)
// AVX512-VNNI: vpdpwssd and vpdpbusd add the pairs' and quads' products into the accumulator in one instruction.
// Written as inline assembly with the accumulator read and written in place: GCC 12's register allocation of the
// intrinsics copies every accumulator twice per step, which spilled the values kernel's 16 to the stack.
struct I8 : I8Avx512 {
  static W AddPairs(W acc, int32_t pair, W k) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(_mm512_set1_epi32(pair)), "v"(k));
    return acc;
  }
  static W AddQuads(W acc, int32_t quad, W v) {  // the quad's bytes unsigned, v's signed
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(_mm512_set1_epi32(quad)), "v"(v));
    return acc;
  }
};
#else
struct I8 : I8Avx512 {
  static W AddPairs(W acc, int32_t pair, W k) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_set1_epi32(pair), k));
  }
  static W AddQuads(W acc, int32_t quad, W v) {
    const W pairs = _mm512_maddubs_epi16(_mm512_set1_epi32(quad), v);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
};
#endif
#elif defined(__AVX2__)
struct I8 {
  using W = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kScoreRows = 4, kValueRows = 2;
  static W Zero() { return _mm256_setzero_si256(); }
  static W KeyPairs(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // The adds into the accumulator written as inline assembly, in place: through the intrinsics GCC 12 added into
  // the product's register and copied that back to the accumulator's, a copy per add, and spilled one of the
  // scores kernel's accumulators to the stack.
  static W AddInPlace(W acc, W x) {
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(x));
    return acc;
  }
  static W AddPairs(W acc, int32_t pair, W k) {
    return AddInPlace(acc, _mm256_madd_epi16(_mm256_set1_epi32(pair), k));
  }
  static W ValueQuads(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static W AddQuads(W acc, int32_t quad, W v) {
    const W pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(quad), v);
    return AddInPlace(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static void StoreScaled(float* out, W acc, float scale) {
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(scale)));
  }
  static void Update(float* o, W acc, float scale, float factor) {
    const __m256 old = _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(factor));
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(scale), old));
  }
  static void ToInt16(const float* x, const float* scale, float mul, int16_t* out) {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(scale)), _mm256_set1_ps(mul));
    const __m256i n = _mm256_cvtps_epi32(v);
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  }
  static void ToBytes(const float* x, const float* scale, float mul, uint8_t* out) {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(scale)), _mm256_set1_ps(mul));
    const __m256i n = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
  }
};
#else
struct I8 {
  static constexpr int kLanes = 8;
  static constexpr int kScoreRows = 4, kValueRows = 2;
  struct W {
    int32_t x[kLanes];
  };
  static W Zero() { return W{}; }
  // Each lane's two (or four) codes, kept as they are: the sums below pick them from the bytes.
  struct Codes {
    const int8_t* p;
  };
  static Codes KeyPairs(const int8_t* p) { return {p}; }
  static W AddPairs(W acc, int32_t pair, Codes k) {
    const int32_t lo = static_cast<int16_t>(pair & 0xffff), hi = static_cast<int16_t>(pair >> 16);
    for (int i = 0; i < kLanes; ++i) acc.x[i] += lo * k.p[2 * i] + hi * k.p[2 * i + 1];
    return acc;
  }
  static Codes ValueQuads(const int8_t* p) { return {p}; }
  static W AddQuads(W acc, int32_t quad, Codes v) {
    for (int i = 0; i < kLanes; ++i) {
      for (int b = 0; b < 4; ++b) acc.x[i] += ((quad >> (8 * b)) & 0xff) * v.p[4 * i + b];
    }
    return acc;
  }
  static void StoreScaled(float* out, W acc, float scale) {
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<float>(acc.x[i]) * scale;
  }
  static void Update(float* o, W acc, float scale, float factor) {
    for (int i = 0; i < kLanes; ++i) o[i] = o[i] * factor + static_cast<float>(acc.x[i]) * scale;
  }
  static void ToInt16(const float* x, const float* scale, float mul, int16_t* out) {
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<int16_t>(__builtin_nearbyintf(x[i] * scale[i] * mul));
  }
  static void ToBytes(const float* x, const float* scale, float mul, uint8_t* out) {
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<uint8_t>(__builtin_nearbyintf(x[i] * scale[i] * mul));
  }
};
#endif

inline float ScaleOf(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  __builtin_memcpy(&x, &wide, sizeof(x));
  return x;
}

// Whether a part's own lines are prefetched into L1 as the kernels read them (Ahead's `here`): on AVX512-VNNI, whose
// kernels wait on their loads; the other sets' pairs are bound by their instructions (docs/PERFORMANCE.md).
#if defined(__AVX512VNNI__)
constexpr bool kInt8PrefetchPart = true;
#else
constexpr bool kInt8PrefetchPart = false;
#endif

// out[i] = x[i] times the bf16 scale[i] times `factor` (for i < n, then zeros up to a multiple of I8::kLanes);
// returns the largest |out[i]|.
inline float ScaledRow(const float* x, const uint16_t* scale, int64_t n, float* out, float factor = 1.0f) {
  Isa::V amax = Isa::Zero();
  const Isa::V f = Isa::Splat(factor);
  int64_t i = 0;
  for (; i + Isa::kLanes <= n; i += Isa::kLanes) {
    const Isa::V v = Isa::Mul(Isa::Mul(Isa::Load(x + i), Isa::LoadBf16(scale + i)), f);
    Isa::Store(out + i, v);
    amax = Isa::Max(amax, Isa::Max(v, Isa::Sub(Isa::Zero(), v)));
  }
  float m = Isa::ReduceMax(amax);
  for (; i < n; ++i) {
    out[i] = x[i] * ScaleOf(scale[i]) * factor;
    const float a = out[i] < 0 ? -out[i] : out[i];
    m = a > m ? a : m;
  }
  for (; i % I8::kLanes != 0; ++i) out[i] = 0.0f;
  return m;
}

// out[c] = the bf16 scale[c] as fp32 for c < n, then zeros up to the next multiple of I8::kLanes: a block's scales,
// widened once for all its rows.
inline void WidenScales(const uint16_t* scale, int64_t n, float* out) {
  int64_t c = 0;
  for (; c + Isa::kLanes <= n; c += Isa::kLanes) Isa::Store(out + c, Isa::LoadBf16(scale + c));
  for (; c < n; ++c) out[c] = ScaleOf(scale[c]);
  for (; c % I8::kLanes != 0; ++c) out[c] = 0.0f;
}

// The largest |x[c] scale[c]| over c < n.
inline float MaxAbsProduct(const float* x, const float* scale, int64_t n) {
  Isa::V amax = Isa::Zero();
  int64_t c = 0;
  for (; c + Isa::kLanes <= n; c += Isa::kLanes) {
    const Isa::V v = Isa::Mul(Isa::Load(x + c), Isa::Load(scale + c));
    amax = Isa::Max(amax, Isa::Max(v, Isa::Sub(Isa::Zero(), v)));
  }
  float m = Isa::ReduceMax(amax);
  for (; c < n; ++c) {
    const float a = x[c] * scale[c] < 0 ? -x[c] * scale[c] : x[c] * scale[c];
    m = a > m ? a : m;
  }
  return m;
}

// kRows rows' scores for kVectors vectors of keys from column j on: the whole depth in registers, kRows kVectors
// independent chains of accumulation (a decode's 4 rows of one vector kept the products' latency exposed).
template <int kRows, int kVectors>
inline void Int8ScoreBlock(int64_t pairs, const int32_t* q, const float* q_scale, const int8_t* kt, int64_t ldk,
                           float* s, int64_t lds, Ahead& ahead) {
  typename I8::W acc[kRows][kVectors];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = I8::Zero();
  }
  for (int64_t i = 0; i < pairs; ++i) {
    if ((i & 3) == 0) ahead.Step();
    decltype(I8::KeyPairs(kt)) k[kVectors];
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) k[v] = I8::KeyPairs(kt + i * 2 * ldk + v * 2 * I8::kLanes);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const int32_t pair = q[r * kInt8MaxDepth / 2 + i];
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = I8::AddPairs(acc[r][v], pair, k[v]);
    }
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) I8::StoreScaled(s + r * lds + v * I8::kLanes, acc[r][v], q_scale[r]);
  }
}

#if defined(__AVX512BW__)
// Lanes 4r..4r+3 of the result: the largest of x[r]'s 16 lanes (kAdd: their sum as int32): four rows' horizontal
// reductions in six shuffles, their latency paid once, where one row's took four shuffles in a row.
template <bool kAdd>
inline __m512 ReduceFourRows(const __m512 (&x)[4]) {
  const auto op = [](__m512 a, __m512 b) {
    if constexpr (kAdd) {
      return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    } else {
      return _mm512_max_ps(a, b);
    }
  };
  // Rows 0 and 1 (2 and 3) to eight lanes each, then each row to one 128-bit lane, then within those lanes.
  const __m512 x01 = op(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xee));
  const __m512 x23 = op(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xee));
  __m512 z = op(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
  z = op(z, _mm512_permute_ps(z, 0x4e));
  return op(z, _mm512_permute_ps(z, 0xb1));
}

// out[r] = lane 4r of z (ReduceFourRows' results).
inline void StoreFourRows(__m512 z, float* out) {
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, z)));
}

// 127 over each row's largest magnitude (lanes 4r..4r+3 of amax), 0 where that is 0 (a row of zeros keeps zero
// codes).
inline __m512 FourRowsMultipliers(__m512 amax) {
  const __mmask16 positive = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), amax);
}

// products[r][c] = x_r[c] scale[c] (the bf16 scales) for c < 16 vectors, four rows r (those from row_count on repeat
// row 0); returns each row's largest |product| in lanes 4r..4r+3. kVectors > 0: `vectors` is that constant, the loops
// unrolled, the scales widened once into registers rather than reloaded for each row, and each row's largest taken
// in a tree rather than a chain (q's rounding costs a block about half of what its dot products do: PERFORMANCE.md).
template <int kVectors>
inline __m512 FourRowsProducts(int64_t row_count, int64_t vectors, const float* x, int64_t ldx, const uint16_t* scale,
                               float (&products)[4][kInt8MaxKeys]) {
  constexpr int kHeld = kVectors > 0 ? kVectors : 1;
#if defined(__AVX512DQ__)
  constexpr bool kPairwise = kVectors > 0 && kVectors % 2 == 0;
#else
  constexpr bool kPairwise = false;
#endif
  const int64_t n = kVectors > 0 ? kVectors : vectors;
  __m512 s[kHeld];
  if constexpr (kVectors > 0) {
    MHA_UNROLL for (int i = 0; i < kVectors; ++i) s[i] = Isa::LoadBf16(scale + 16 * i);
  }
  __m512 m[4];
  MHA_UNROLL for (int r = 0; r < 4; ++r) {
    const float* row = x + (r < row_count ? r : 0) * ldx;
    __m512 a[kHeld] = {};
    MHA_UNROLL for (int64_t i = 0; i < n; ++i) {
      const __m512 widened = kVectors > 0 ? s[i] : Isa::LoadBf16(scale + 16 * i);
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * i), widened);
      _mm512_store_ps(products[r] + 16 * i, v);
      if constexpr (kPairwise) {
        a[i] = v;
      } else if constexpr (kVectors > 0) {
        a[i] = _mm512_abs_ps(v);
      } else {
        a[0] = _mm512_max_ps(a[0], _mm512_abs_ps(v));
      }
    }
#if defined(__AVX512DQ__)
    if constexpr (kPairwise) {  // the tree's first level: the larger |.| of each pair, sign cleared, by vrangeps
      MHA_UNROLL for (int i = 0; i < kHeld; i += 2) a[i] = _mm512_range_ps(a[i], a[i + 1], 0x0b);
    }
#endif
    MHA_UNROLL for (int w = kPairwise ? 2 : 1; w < kHeld; w *= 2) {
      MHA_UNROLL for (int i = 0; i + w < kHeld; i += 2 * w) a[i] = _mm512_max_ps(a[i], a[i + w]);
    }
    m[r] = a[0];
  }
  return ReduceFourRows</*kAdd=*/false>(m);
}

// Four rows r of row_count (the rest repeat row 0, their results unused) of the weights x_r[j] >= 0, j < 16 vectors:
// codes[r] = x_r[j] scale[j] rounded to 7 bits at 127 / amax_r (amax_r the largest x_r[j] scale[j]); p_scale[r] =
// amax_r / 127. Int8Values' rounding per row, the rows' reductions and divisions shared. kVectors > 0: `vectors` is
// that constant (the loops unrolled: the values' loop waits on this rounding).
template <int kVectors>
inline void FourRowsToBytes(int64_t row_count, int64_t vectors, const float* x, int64_t ldx, const uint16_t* scale,
                            uint8_t* codes, int64_t ld_codes, float* p_scale) {
  const int64_t n = kVectors > 0 ? kVectors : vectors;
  alignas(64) float products[4][kInt8MaxKeys];
  const __m512 amax = FourRowsProducts<kVectors>(row_count, n, x, ldx, scale, products);
  const __m512 mul = FourRowsMultipliers(amax);
  MHA_UNROLL for (int r = 0; r < 4; ++r) {
    if (r >= row_count) break;
    const __m512 row_mul = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * r), mul);  // lane 4r everywhere
    MHA_UNROLL for (int64_t i = 0; i < n; ++i) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(products[r] + 16 * i), row_mul));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * ld_codes + 16 * i), _mm512_cvtepi32_epi8(c));
    }
  }
  float amax_rows[4];
  StoreFourRows(amax, amax_rows);
  for (int64_t r = 0; r < row_count && r < 4; ++r) p_scale[r] = amax_rows[r] / 127.0f;
}
#endif

#if defined(__AVX512VNNI__)
// AVX512-VNNI's scores in vpdpbusd, four depths of a key per 32-bit lane: twice the products per instruction of
// vpdpwssd's pairs. q is rounded to int8 per row (instead of int16: vpdpbusd multiplies bytes), the keys' codes
// taken as unsigned code + 128 (one xor per vector, shared by the rows) and 128 times the sum of the row's q codes
// subtracted once per block: exact integer sums of q code times key code. Two pair rows of K^T (32 keys each) are
// interleaved into quads within each 128-bit lane, so the accumulators hold keys 0-3, 8-11, 16-19, 24-27 (lo) and
// 4-7, 12-15, 20-23, 28-31 (hi); the store puts them back in order.
struct KeyQuads {
  static __m512i Add(__m512i acc, __m512i keys, int32_t quad) {  // keys unsigned, the quad's bytes signed
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(keys), "v"(_mm512_set1_epi32(quad)));
    return acc;
  }
  // Pair row `a` and the next one `b` (32 keys each), as unsigned bytes, interleaved into quads.
  static void Interleave(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    a = _mm512_xor_si512(a, flip);
    b = _mm512_xor_si512(b, flip);
    lo = _mm512_unpacklo_epi16(a, b);
    hi = _mm512_unpackhi_epi16(a, b);
  }
  static void Store(float* s, __m512i lo, __m512i hi, int32_t offset, float scale) {
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i off = _mm512_set1_epi32(offset);
    lo = _mm512_sub_epi32(lo, off);
    hi = _mm512_sub_epi32(hi, off);
    const __m512 sc = _mm512_set1_ps(scale);
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, idx0, hi)), sc));
    _mm512_storeu_ps(s + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, idx1, hi)), sc));
  }
};

// 16 values v times `mul` rounded to int8 codes into row; returns sum plus the codes.
inline __m512i StoreCodes(__m512 v, __m512 mul, int8_t* row, __m512i sum) {
  const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v, mul));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm512_cvtepi32_epi8(codes));
  return _mm512_add_epi32(sum, codes);
}

// A row group's depths kept out of q's int8 rounding (SplitChannels below): at most this many, else none.
inline constexpr int kMaxSplitChannels = 16;

// Four rows' depths whose |q times the key scale| reaches half the rows' largest, each row's value of them in fp32.
// Real models' keys have a few channels many times larger than the rest (SmolLM2's: the largest channel 8-13 times
// the median's RMS), and q times those channels' scales would set the step of every other depth's int8 code: 2.4 times
// the logit error of the cache's own key codes (docs/PERFORMANCE.md). Those depths are zero in the int8 codes and
// added in fp32 after the integer sums (AddSplitChannels), so the other depths round at a step their own values set.
struct SplitChannels {
  int count = 0;
  int depth[kMaxSplitChannels];
  float q[4][kMaxSplitChannels];  // rows r of the group: x_r[depth] scale[depth]
};

// Four rows r of row_count (the rest repeat row 0, their results unused): the depths SplitChannels keeps apart (when
// at most kMaxSplitChannels reach half the rows' largest |x_r[c] scale[c]|), and for the others codes[r] = x_r[c]
// scale[c] (the bf16 scales) rounded to int8 at 127 / amax_r (amax_r = the row's largest |x_r[c] scale[c]|, or with
// depths split the smaller of that and the other depths' largest over the four rows), the split depths' codes zero,
// for c < kVectors 16; q_sum[r] = the codes' sum, q_scale[r] = amax_r / 127. The rows interleaved so that their
// reductions and the division overlap.
template <int kVectors>
inline void FourRowsToInt8(int64_t row_count, const float* x, int64_t ldx, const uint16_t* scale, int8_t* codes,
                           int64_t ld_codes, int32_t* q_sum, float* q_scale, SplitChannels* split) {
  static_assert(kVectors % 4 == 0, "whole groups of four vectors");
  alignas(64) float products[4][kInt8MaxKeys];
  __m512 amax = FourRowsProducts<kVectors>(row_count, kVectors, x, ldx, scale, products);
  // Each depth's largest |product| over the rows, against half the largest of all (amax's lanes hold the rows').
  const __m512 half = _mm512_set1_ps(0.5f * _mm512_reduce_max_ps(amax));
  __mmask16 apart[kVectors];
  __m512 rest = _mm512_setzero_ps();
  int count = 0;
  MHA_UNROLL for (int i = 0; i < kVectors; ++i) {
    const __m512 m = _mm512_range_ps(
        _mm512_range_ps(_mm512_load_ps(products[0] + 16 * i), _mm512_load_ps(products[1] + 16 * i), 0x0b),
        _mm512_range_ps(_mm512_load_ps(products[2] + 16 * i), _mm512_load_ps(products[3] + 16 * i), 0x0b), 0x0b);
    apart[i] = _mm512_cmp_ps_mask(m, half, _CMP_GE_OQ);
    rest = _mm512_mask_max_ps(rest, static_cast<__mmask16>(~apart[i]), rest, m);
    count += __builtin_popcount(apart[i]);
  }
  split->count = 0;
  if (count <= kMaxSplitChannels && half[0] > 0.0f) {
    // The rows' step is set by the other depths: amax_r over them is at most min(amax_r, their largest).
    amax = _mm512_min_ps(amax, _mm512_set1_ps(_mm512_reduce_max_ps(rest)));
    MHA_UNROLL for (int i = 0; i < kVectors; ++i) {
      for (unsigned bits = apart[i]; bits != 0; bits &= bits - 1) {
        const int c = 16 * i + __builtin_ctz(bits), k = split->count++;
        split->depth[k] = c;
        MHA_UNROLL for (int r = 0; r < 4; ++r) split->q[r][k] = products[r][c];
      }
    }
  } else {
    MHA_UNROLL for (int i = 0; i < kVectors; ++i) apart[i] = 0;
  }
  const __m512 mul = FourRowsMultipliers(amax);
  // Four vectors' codes packed into one by two saturating packs (in range already) and one dword permute: three
  // shuffles where four vpmovdb stores took two uops each; their sum in one vpdpbusd against bytes of 1.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 sums[4];
  MHA_UNROLL for (int r = 0; r < 4; ++r) {
    sums[r] = _mm512_setzero_ps();
    if (r >= row_count) continue;
    const __m512 row_mul = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * r), mul);  // lane 4r everywhere
    __m512i sum = _mm512_setzero_si512();
    MHA_UNROLL for (int i = 0; i < kVectors; i += 4) {
      __m512i c[4];
      MHA_UNROLL for (int j = 0; j < 4; ++j) {
        c[j] = _mm512_maskz_cvtps_epi32(static_cast<__mmask16>(~apart[i + j]),
                                        _mm512_mul_ps(_mm512_load_ps(products[r] + 16 * (i + j)), row_mul));
      }
      const __m512i bytes = _mm512_permutexvar_epi32(
          order, _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3])));
      _mm512_storeu_si512(codes + r * ld_codes + 16 * i, bytes);
      sum = _mm512_dpbusd_epi32(sum, ones, bytes);
    }
    sums[r] = _mm512_castsi512_ps(sum);
  }
  float amax_rows[4], sum_rows[4];
  StoreFourRows(amax, amax_rows);
  StoreFourRows(ReduceFourRows</*kAdd=*/true>(sums), sum_rows);
  for (int64_t r = 0; r < row_count && r < 4; ++r) {
    __builtin_memcpy(&q_sum[r], &sum_rows[r], sizeof(int32_t));
    q_scale[r] = amax_rows[r] / 127.0f;
  }
}

// s[r][j] += the split depths' q times key j's codes, for rows r < rows (at most 4) and keys j < keys (a multiple
// of 32) of the pair rows at kt (ldk keys apart).
inline void AddSplitChannels(const SplitChannels& split, int64_t rows, int64_t keys, const int8_t* kt, int64_t ldk,
                             float* s, int64_t lds) {
  for (int64_t j = 0; j < keys; j += 32) {
    __m512 acc[4][2];
    MHA_UNROLL for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < split.count; ++k) {
      const int c = split.depth[k];
      // Pair row c / 2 holds keys j.. as (depth 2i, depth 2i + 1) byte pairs: this depth's byte, sign-extended.
      __m512i w = _mm512_loadu_si512(kt + (c / 2) * 2 * ldk + 2 * j);
      if (c % 2 == 0) w = _mm512_slli_epi16(w, 8);
      w = _mm512_srai_epi16(w, 8);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
      MHA_UNROLL for (int r = 0; r < 4; ++r) {
        const __m512 q = _mm512_set1_ps(split.q[r][k]);
        acc[r][0] = _mm512_fmadd_ps(q, lo, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(q, hi, acc[r][1]);
      }
    }
    for (int64_t r = 0; r < rows && r < 4; ++r) {
      float* out = s + r * lds + j;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[r][0]));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16), acc[r][1]));
    }
  }
}

// FourRowsToInt8 for any depth, in plain loops over zero-padded copies (`padded`: the depth rounded up to whole
// vectors of quads), with the same codes, sums and split depths.
inline void FourRowsToInt8Padded(int64_t row_count, const float* x, int64_t ldx, int64_t depth, int64_t padded,
                                 const float* scale, int8_t* codes, int64_t ld_codes, int32_t* q_sum, float* q_scale,
                                 SplitChannels* split) {
  alignas(64) float products[4][kInt8MaxDepth + I8::kLanes] = {};
  float column[kInt8MaxDepth] = {}, amax[4] = {}, top = 0.0f;
  for (int r = 0; r < 4; ++r) {
    const float* row = x + (r < row_count ? r : 0) * ldx;
    for (int64_t c = 0; c < depth; ++c) {
      products[r][c] = row[c] * scale[c];
      const float a = products[r][c] < 0 ? -products[r][c] : products[r][c];
      column[c] = a > column[c] ? a : column[c];
      amax[r] = a > amax[r] ? a : amax[r];
      top = a > top ? a : top;
    }
  }
  const float half = 0.5f * top;
  float rest = 0.0f;
  int count = 0;
  for (int64_t c = 0; c < depth; ++c) {
    if (column[c] >= half) {
      ++count;
    } else if (column[c] > rest) {
      rest = column[c];
    }
  }
  split->count = 0;
  if (count <= kMaxSplitChannels && half > 0.0f) {
    for (int r = 0; r < 4; ++r) amax[r] = amax[r] < rest ? amax[r] : rest;
    for (int64_t c = 0; c < depth; ++c) {
      if (!(column[c] >= half)) continue;  // the predicate `count` counted
      const int k = split->count++;
      split->depth[k] = static_cast<int>(c);
      for (int r = 0; r < 4; ++r) {
        split->q[r][k] = products[r][c];
        products[r][c] = 0.0f;
      }
    }
  }
  for (int64_t r = 0; r < row_count && r < 4; ++r) {
    const __m512 mul = _mm512_set1_ps(amax[r] > 0 ? 127.0f / amax[r] : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = 0; c < padded; c += 16) {
      sum = StoreCodes(_mm512_load_ps(products[r] + c), mul, codes + r * ld_codes + c, sum);
    }
    q_sum[r] = _mm512_reduce_add_epi32(sum);
    q_scale[r] = amax[r] / 127.0f;
  }
}

// kRows rows' scores of the 32 keys at kt (pair rows 2 ldk bytes apart) over `pairs` depth pairs.
template <int kRows>
inline void QuadScoreBlock(int64_t pairs, const int32_t* q, const int32_t* q_sum, const float* q_scale,
                           const int8_t* kt, int64_t ldk, float* s, int64_t lds, Ahead& ahead) {
  __m512i lo[kRows], hi[kRows];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  const auto step = [&](int64_t i, __m512i a, __m512i b) {
    __m512i klo, khi;
    KeyQuads::Interleave(a, b, klo, khi);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const int32_t quad = q[r * kInt8MaxDepth / 4 + i];
      lo[r] = KeyQuads::Add(lo[r], klo, quad);
      hi[r] = KeyQuads::Add(hi[r], khi, quad);
    }
  };
  int64_t i = 0;
  for (; 2 * i + 1 < pairs; ++i) {
    if ((i & 1) == 0) ahead.Step();
    step(i, _mm512_loadu_si512(kt + 2 * i * 2 * ldk), _mm512_loadu_si512(kt + (2 * i + 1) * 2 * ldk));
  }
  // An odd last pair row is paired with code 0 (times q's zero padding).
  if (2 * i < pairs) step(i, _mm512_loadu_si512(kt + 2 * i * 2 * ldk), _mm512_setzero_si512());
  MHA_UNROLL for (int r = 0; r < kRows; ++r) KeyQuads::Store(s + r * lds, lo[r], hi[r], 128 * q_sum[r], q_scale[r]);
}

// Int8Scores for keys a multiple of 32 on AVX512-VNNI.
void Int8ScoresInQuads(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const int8_t* kt,
                       int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
                       int64_t ahead_size) {
  const int64_t pairs = (depth + 1) / 2, quads = (pairs + 1) / 2;
  int32_t codes[kInt8MaxRows * kInt8MaxDepth / 4];
  int32_t q_sum[kInt8MaxRows];
  float q_scale[kInt8MaxRows];
  // Depth quads as int32 words, little-endian: depth 4i in the low byte (padding depths zero).
  int8_t* const rows_codes = reinterpret_cast<int8_t*>(codes);
  const bool common = depth == 128 || depth == 64;
  SplitChannels split[kInt8MaxRows / 4];
  for (int64_t r = 0; common && r < rows; r += 4) {
    int8_t* row = rows_codes + r * kInt8MaxDepth;
    SplitChannels* group = &split[r / 4];
    if (depth == 128) {
      FourRowsToInt8<8>(rows - r, q + r * ldq, ldq, key_scales, row, kInt8MaxDepth, q_sum + r, q_scale + r, group);
    } else {
      FourRowsToInt8<4>(rows - r, q + r * ldq, ldq, key_scales, row, kInt8MaxDepth, q_sum + r, q_scale + r, group);
    }
  }
  float scale[kInt8MaxDepth + 2 * I8::kLanes];
  if (!common) WidenScales(key_scales, depth, scale);
  for (int64_t r = 0; !common && r < rows; r += 4) {
    FourRowsToInt8Padded(rows - r, q + r * ldq, ldq, depth, (4 * quads + 15) / 16 * 16, scale,
                         rows_codes + r * kInt8MaxDepth, kInt8MaxDepth, q_sum + r, q_scale + r, &split[r / 4]);
  }
  constexpr int kRows = 8;
  Ahead ahead(ahead_bytes, ahead_size, keys / 32 * ((rows + kRows - 1) / kRows) * quads / 2, kt);  // VNNI
  for (int64_t j = 0; j < keys; j += 32) {
    for (int64_t r = 0; r < rows; r += kRows) {
      WithRows<kRows>(rows - r < kRows ? rows - r : kRows, [&](auto height) {
        QuadScoreBlock<decltype(height)::kValue>(pairs, codes + r * kInt8MaxDepth / 4, q_sum + r, q_scale + r,
                                                 kt + 2 * j, ldk, s + r * lds + j, lds, ahead);
      });
    }
  }
  for (int64_t r = 0; r < rows; r += 4) {
    if (split[r / 4].count > 0) AddSplitChannels(split[r / 4], rows - r, keys, kt, ldk, s + r * lds, lds);
  }
}
#endif

// PagedKernels::scores over an INT8 block (keys a multiple of 16, depth up to kInt8MaxDepth, rows up to
// kInt8MaxRows): `kt` is the block's K codes (depth pairs), `key_scales` its per-channel bf16 scales.
void Int8Scores(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
                int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
                int64_t ahead_size) {
#if defined(__AVX512VNNI__)
  if (keys % 32 == 0) {
    Int8ScoresInQuads(rows, keys, depth, q, ldq, static_cast<const int8_t*>(kt_bytes), ldk, key_scales, s, lds,
                      ahead_bytes, ahead_size);
    return;
  }
#endif
  const int64_t pairs = (depth + 1) / 2;
  // |q code| times 127 times the depth stays within int32.
  const float q_max = static_cast<float>(2147483647 / (254 * pairs) < 32767 ? 2147483647 / (254 * pairs) : 32767);
  int32_t codes[kInt8MaxRows * kInt8MaxDepth / 2];
  float q_scale[kInt8MaxRows];
  float scale[kInt8MaxDepth + 2 * I8::kLanes];
  WidenScales(key_scales, depth, scale);
  const int64_t whole = depth / I8::kLanes * I8::kLanes;
  // Two passes: every row's largest product first, so that the rows' reductions overlap rather than each row's
  // rounding waiting on its own.
  float amax[kInt8MaxRows];
  for (int64_t r = 0; r < rows; ++r) amax[r] = MaxAbsProduct(q + r * ldq, scale, depth);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = q + r * ldq;
    q_scale[r] = amax[r] / q_max;
    const float mul = amax[r] > 0 ? q_max / amax[r] : 0.0f;
    // Depth pairs as int32 words, little-endian: depth 2i in the low half (the padding depth of an odd one zero).
    int16_t* row = reinterpret_cast<int16_t*>(codes + r * kInt8MaxDepth / 2);
    for (int64_t c = 0; c < whole; c += I8::kLanes) I8::ToInt16(x + c, scale + c, mul, row + c);
    if (whole < 2 * pairs) {  // the last depths through a zero-padded copy (q's row may end at depth)
      float tail[I8::kLanes] = {};
      for (int64_t c = whole; c < depth; ++c) tail[c - whole] = x[c];
      I8::ToInt16(tail, scale + whole, mul, row + whole);
    }
  }
  const int8_t* kt = static_cast<const int8_t*>(kt_bytes);
  // Two vectors of keys where the block has them (16 accumulators on AVX-512, 8 on AVX2), else one.
  constexpr int kRows = I8::kScoreRows;
  const bool two = keys % (2 * I8::kLanes) == 0;
  const int64_t step = two ? 2 * I8::kLanes : I8::kLanes;
  Ahead ahead(ahead_bytes, ahead_size, keys / step * ((rows + kRows - 1) / kRows) * pairs / 4);
  for (int64_t j = 0; j < keys; j += step) {
    for (int64_t r = 0; r < rows; r += kRows) {
      WithRows<kRows>(rows - r < kRows ? rows - r : kRows, [&](auto height) {
        constexpr int kHeight = decltype(height)::kValue;
        const int32_t* qr = codes + r * kInt8MaxDepth / 2;
        if (two) {
          Int8ScoreBlock<kHeight, 2>(pairs, qr, q_scale + r, kt + 2 * j, ldk, s + r * lds + j, lds, ahead);
        } else {
          Int8ScoreBlock<kHeight, 1>(pairs, qr, q_scale + r, kt + 2 * j, ldk, s + r * lds + j, lds, ahead);
        }
      });
    }
  }
}

// kRows rows of kVectors vectors of columns: o = factor o + scale (p codes . V codes) over the block's quads.
template <int kRows, int kVectors>
inline void Int8ValueBlock(int64_t quads, const int32_t* p, const float* p_scale, const float* o_scale, const int8_t* v,
                           int64_t width, float* o, int64_t ldo, Ahead& ahead) {
  typename I8::W acc[kRows][kVectors];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) { MHA_UNROLL for (int x = 0; x < kVectors; ++x) acc[r][x] = I8::Zero(); }
  for (int64_t i = 0; i < quads; ++i) {
    ahead.Step();
    decltype(I8::ValueQuads(v)) b[kVectors];
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) b[x] = I8::ValueQuads(v + i * width * 4 + x * I8::kLanes * 4);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      MHA_UNROLL for (int x = 0; x < kVectors; ++x) acc[r][x] =
          I8::AddQuads(acc[r][x], p[r * kInt8MaxKeys / 4 + i], b[x]);
    }
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    const float factor = o_scale != nullptr ? o_scale[r] : 1.0f;
    MHA_UNROLL for (int x = 0; x < kVectors; ++x)
        I8::Update(o + r * ldo + x * I8::kLanes, acc[r][x], p_scale[r], factor);
  }
}

// Columns [c, width) that no whole vector covers, in plain loops.
inline void Int8ValueTail(int64_t rows, int64_t quads, int64_t c0, const int32_t* p, const float* p_scale,
                          const float* o_scale, const int8_t* v, int64_t width, float* o, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < width; ++c) {
      int32_t sum = 0;
      for (int64_t i = 0; i < quads; ++i) {
        const int32_t quad = p[r * kInt8MaxKeys / 4 + i];
        for (int b = 0; b < 4; ++b) sum += ((quad >> (8 * b)) & 0xff) * v[i * width * 4 + c * 4 + b];
      }
      const float factor = o_scale != nullptr ? o_scale[r] : 1.0f;
      o[r * ldo + c] = o[r * ldo + c] * factor + static_cast<float>(sum) * p_scale[r];
    }
  }
}

// PagedKernels::values over an INT8 block (keys up to kInt8MaxKeys, rows up to kInt8MaxRows): `v` is the block's V
// codes (key quads), `value_scales` its per-token bf16 scales.
void Int8Values(int64_t rows, int64_t keys, int64_t width, const float* p, int64_t ldp, const void* v_bytes,
                const uint16_t* value_scales, const float* o_scale, float* o, int64_t ldo, const void* ahead_bytes,
                int64_t ahead_size) {
  const int64_t quads = (keys + 3) / 4;
  int32_t codes[kInt8MaxRows * kInt8MaxKeys / 4];
  float p_scale[kInt8MaxRows];
  const int64_t whole_keys = keys / I8::kLanes * I8::kLanes;
  int64_t r = 0;
#if defined(__AVX512BW__)
  for (; keys % 16 == 0 && r < rows; r += 4) {
    uint8_t* row = reinterpret_cast<uint8_t*>(codes + r * kInt8MaxKeys / 4);
    const float* x = p + r * ldp;
    if (keys == 32) {  // the default block
      FourRowsToBytes<2>(rows - r, 2, x, ldp, value_scales, row, kInt8MaxKeys, p_scale + r);
    } else if (keys == 64) {  // the block DEPLOY.md suggests where memory is fast
      FourRowsToBytes<4>(rows - r, 4, x, ldp, value_scales, row, kInt8MaxKeys, p_scale + r);
    } else {
      FourRowsToBytes<0>(rows - r, keys / 16, x, ldp, value_scales, row, kInt8MaxKeys, p_scale + r);
    }
  }
#endif
  // The other rows in two passes, as Int8Scores' (p >= 0).
  float scale[kInt8MaxKeys + 2 * I8::kLanes];
  if (r < rows) WidenScales(value_scales, keys, scale);
  float amax[kInt8MaxRows];
  for (int64_t i = r; i < rows; ++i) amax[i] = MaxAbsProduct(p + i * ldp, scale, keys);
  for (; r < rows; ++r) {
    const float* x = p + r * ldp;
    p_scale[r] = amax[r] / 127.0f;
    const float mul = amax[r] > 0 ? 127.0f / amax[r] : 0.0f;
    // Key quads as int32 words, little-endian: key 4i in the low byte (keys past `keys` zero).
    uint8_t* row = reinterpret_cast<uint8_t*>(codes + r * kInt8MaxKeys / 4);
    for (int64_t j = 0; j < whole_keys; j += I8::kLanes) I8::ToBytes(x + j, scale + j, mul, row + j);
    if (whole_keys < 4 * quads) {  // the last keys through a zero-padded copy
      float tail[I8::kLanes] = {};
      for (int64_t j = whole_keys; j < keys; ++j) tail[j - whole_keys] = x[j];
      I8::ToBytes(tail, scale + whole_keys, mul, row + whole_keys);
    }
  }
  const int8_t* v = static_cast<const int8_t*>(v_bytes);
  constexpr int kRows = I8::kValueRows, kVectors = 4;
  const int64_t whole = width / I8::kLanes;
  Ahead ahead(ahead_bytes, ahead_size, quads * ((whole + kVectors - 1) / kVectors) * ((rows + kRows - 1) / kRows),
              kInt8PrefetchPart ? v_bytes : nullptr);
  for (int64_t x = 0; x < whole; x += kVectors) {
    const int64_t vectors = whole - x < kVectors ? whole - x : kVectors;
    for (int64_t r = 0; r < rows; r += kRows) {
      WithRows<kRows>(rows - r < kRows ? rows - r : kRows, [&](auto height) {
        constexpr int kHeight = decltype(height)::kValue;
        const float* factor = o_scale == nullptr ? nullptr : o_scale + r;
        const int8_t* column = v + x * I8::kLanes * 4;
        float* out = o + r * ldo + x * I8::kLanes;
        const int32_t* pr = codes + r * kInt8MaxKeys / 4;
        if (vectors == 4) {
          Int8ValueBlock<kHeight, 4>(quads, pr, p_scale + r, factor, column, width, out, ldo, ahead);
        } else if (vectors == 3) {
          Int8ValueBlock<kHeight, 3>(quads, pr, p_scale + r, factor, column, width, out, ldo, ahead);
        } else if (vectors == 2) {
          Int8ValueBlock<kHeight, 2>(quads, pr, p_scale + r, factor, column, width, out, ldo, ahead);
        } else {
          Int8ValueBlock<kHeight, 1>(quads, pr, p_scale + r, factor, column, width, out, ldo, ahead);
        }
      });
    }
  }
  Int8ValueTail(rows, quads, whole * I8::kLanes, codes, p_scale, o_scale, v, width, o, ldo);
}
