// The sessions' decode kernels for INT8 caches (tile_kernels.h's PagedKernels::scores and values), which multiply
// the cache's codes in integers instead of widening each to fp32: included inside namespace mha::kernels::<isa>,
// after Ahead and WithRows, by paged_kernels_impl.h (AVX-512BW, AVX2 or plain loops, by the TU's flags) and by
// paged_kernels_int8_vnni.cc (AVX512-VNNI). The block layout is quantized_cache.h's.
//
// Scores: q times the block's key scales (per channel), rounded to int16 per row (its scale: the row's largest value
// over the largest code whose sums stay within int32), against the keys' int8 codes: vpmaddwd adds the products of two depths of one key into its 32-bit lane,
// exactly. Values: the probabilities times the value scales (per token), rounded to 7 bits per row (p >= 0, so
// [0, 127]), against the values' codes: vpmaddubsw adds two keys' products of one column into 16 bits (at most
// 2 x 127 x 127, no saturation), vpmaddwd two of those. Sums are exact integers; each row's result is converted to
// fp32 and scaled once per block. Free of standard-library templates, like the kernels around it.

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
  // kLanes values times `mul`, rounded to nearest even, as int16 and as bytes (each within the type's range).
  static void ToInt16(const float* x, float mul, int16_t* out) {
    const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(mul)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(n));
  }
  static void ToBytes(const float* x, float mul, uint8_t* out) {
    const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(mul)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(n));
  }
};
#if defined(__AVX512VNNI__)
// AVX512-VNNI: vpdpwssd and vpdpbusd add the pairs' and quads' products into the accumulator in one instruction.
struct I8 : I8Avx512 {
  static W AddPairs(W acc, int32_t pair, W k) { return _mm512_dpwssd_epi32(acc, _mm512_set1_epi32(pair), k); }
  static W AddQuads(W acc, int32_t quad, W v) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(quad), v); }
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
  static W AddPairs(W acc, int32_t pair, W k) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(pair), k));
  }
  static W ValueQuads(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static W AddQuads(W acc, int32_t quad, W v) {
    const W pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(quad), v);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static void StoreScaled(float* out, W acc, float scale) {
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(scale)));
  }
  static void Update(float* o, W acc, float scale, float factor) {
    const __m256 old = _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(factor));
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(scale), old));
  }
  static void ToInt16(const float* x, float mul, int16_t* out) {
    const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(mul)));
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  }
  static void ToBytes(const float* x, float mul, uint8_t* out) {
    const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_set1_ps(mul)));
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
  static void ToInt16(const float* x, float mul, int16_t* out) {
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<int16_t>(__builtin_nearbyintf(x[i] * mul));
  }
  static void ToBytes(const float* x, float mul, uint8_t* out) {
    for (int i = 0; i < kLanes; ++i) out[i] = static_cast<uint8_t>(__builtin_nearbyintf(x[i] * mul));
  }
};
#endif

inline float ScaleOf(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  __builtin_memcpy(&x, &wide, sizeof(x));
  return x;
}

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

// PagedKernels::scores over an INT8 block (keys a multiple of 16, depth up to kInt8MaxDepth, rows up to
// kInt8MaxRows): `kt` is the block's K codes (depth pairs), `key_scales` its per-channel bf16 scales.
void Int8Scores(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt_bytes,
                int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead_bytes,
                int64_t ahead_size) {
  const int64_t pairs = (depth + 1) / 2;
  // |q code| times 127 times the depth stays within int32.
  const float q_max = static_cast<float>(2147483647 / (254 * pairs) < 32767 ? 2147483647 / (254 * pairs) : 32767);
  int32_t codes[kInt8MaxRows * kInt8MaxDepth / 2];
  float q_scale[kInt8MaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    float scaled[kInt8MaxDepth + 2 * I8::kLanes];
    const float amax = ScaledRow(q + r * ldq, key_scales, depth, scaled);
    q_scale[r] = amax / q_max;
    // Depth pairs as int32 words, little-endian: depth 2i in the low half (the padding depth of an odd one zero).
    int16_t* row = reinterpret_cast<int16_t*>(codes + r * kInt8MaxDepth / 2);
    for (int64_t c = 0; c < 2 * pairs; c += I8::kLanes)
      I8::ToInt16(scaled + c, amax > 0 ? q_max / amax : 0.0f, row + c);
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
  for (int64_t r = 0; r < rows; ++r) {
    float scaled[kInt8MaxKeys + 2 * I8::kLanes];
    const float amax = ScaledRow(p + r * ldp, value_scales, keys, scaled);  // p >= 0
    p_scale[r] = amax / 127.0f;
    // Key quads as int32 words, little-endian: key 4i in the low byte (keys past `keys` zero).
    uint8_t* row = reinterpret_cast<uint8_t*>(codes + r * kInt8MaxKeys / 4);
    for (int64_t j = 0; j < 4 * quads; j += I8::kLanes)
      I8::ToBytes(scaled + j, amax > 0 ? 127.0f / amax : 0.0f, row + j);
  }
  const int8_t* v = static_cast<const int8_t*>(v_bytes);
  constexpr int kRows = I8::kValueRows, kVectors = 4;
  const int64_t whole = width / I8::kLanes;
  Ahead ahead(ahead_bytes, ahead_size, quads * ((whole + kVectors - 1) / kVectors) * ((rows + kRows - 1) / kRows));
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
