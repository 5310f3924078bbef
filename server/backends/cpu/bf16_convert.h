// The bf16 conversions every AVX512-BF16 translation unit uses (tile_kernels_bf16.h's sets and the bf16 cache's
// decode kernels, paged_kernels_avx512bf16.cc). Included inside the including file's anonymous namespace, in a TU
// compiled with AVX512-F, AVX512-BW and AVX512-BF16.

// The first n lanes of 16 (none for n <= 0, all for n >= 16).
__mmask16 Mask(int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << n) - 1);
}

// dst[0, n) = bf16(scale * src[0, n)), zero from n up to `padded` (a multiple of 32).
void ToBf16(const float* src, int64_t n, int64_t padded, float scale, uint16_t* dst) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < padded; c += 32) {
    const __m512 lo = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(Mask(n - c), src + c));
    const __m512 hi = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(Mask(n - c - 16), src + c + 16));
    _mm512_storeu_si512(dst + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}
