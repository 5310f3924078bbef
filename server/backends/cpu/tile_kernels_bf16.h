// What the two bf16 tile-kernel sets share (the amx set, tile_kernels_amx.cc, and the avx512bf16 set,
// tile_kernels_avx512bf16.cc): the packed K^T and V layouts and their packing, the bf16 conversions
// (bf16_convert.h) and a per-thread scratch. Included by each inside its own anonymous namespace, in a TU compiled
// with AVX512-F, AVX512-BW and AVX512-BF16. Deliberately free of standard-library templates (see AlignedBuffer).
//
// Packed layouts, in bf16 (two per float of the caller's buffers; TileKernels::elements_per_float = 2):
//  - K^T: panels of 32 keys, one after another, each [depth / 32] chunks of two 16-key halves: half h of chunk c,
//    row r holds, for its keys x = 0..15, the pair (k[key x][32 c + 2 r], k[key x][32 c + 2 r + 1]) -- one AMX B
//    tile, and for AVX512-BF16 the vector of one depth pair for 16 keys. Keys past n are zero.
//  - V: panels of 16 columns, panel_stride floats apart; in each, row pair j (keys 2 j and 2 j + 1) is 32 bf16,
//    (v[2 j][x], v[2 j + 1][x]) for its columns x = 0..15, so that 16 row pairs (32 keys) are one B tile, and one
//    row pair is one AVX512-BF16 vector. Keys past n, up to the next multiple of 32, are zero.
// Both need depth and width to be multiples of 32.

constexpr int64_t kKeyPanel = 32;   // keys per K^T panel: two B tiles, or two vectors
constexpr int64_t kValuePanel = 16; // columns per V panel: one B tile, or one vector

// A per-thread buffer on a 64-byte boundary, so that no tile row straddles two cache lines, grown on demand. Not a
// std::vector: its out-of-line members would be compiled with AVX-512 enabled, and the linker may keep this
// copy for the whole program (the same holds for any other inline template, hence Min below).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  // At least `bytes` bytes, contents unspecified.
  void* Get(int64_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + 63) / 64 * 64;
      data_ = std::aligned_alloc(64, size_);
      if (data_ == nullptr) std::abort();  // at most tens of KiB (32 rows of 512 keys or of one head)
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

// Per-thread operands in bf16 and fp32 blocks around them.
struct Scratch {
  AlignedBuffer a;      // a block of queries or of probabilities, in bf16
  AlignedBuffer block;  // amx: staged output rows, or one 32x32 block of scores, fp32
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

#include "server/backends/cpu/bf16_convert.h"  // Mask, ToBf16

// GCC 12 reports the self-initialised placeholder of the unpack and shuffle intrinsics (_mm512_undefined_epi32) as
// an uninitialised read here since PackKeys became a template over its source type; every result lane is defined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
// Transposes 16 rows of 16 dwords in place: rows[r] lane c becomes rows[c] lane r.
void Transpose16x16(__m512i rows[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  // u[4 g + k], 128-bit lane L: rows 4 g .. 4 g + 3 of column 4 L + k.
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i even_a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);  // lanes 0 and 2 of rows 0-3 and 4-7
    const __m512i even_b = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i odd_a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);   // lanes 1 and 3
    const __m512i odd_b = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    rows[k] = _mm512_shuffle_i32x4(even_a, even_b, 0x88);       // column k
    rows[8 + k] = _mm512_shuffle_i32x4(even_a, even_b, 0xdd);   // column 8 + k
    rows[4 + k] = _mm512_shuffle_i32x4(odd_a, odd_b, 0x88);     // column 4 + k
    rows[12 + k] = _mm512_shuffle_i32x4(odd_a, odd_b, 0xdd);    // column 12 + k
  }
}
#pragma GCC diagnostic pop

// 32 consecutive elements of a row as bf16 (a depth chunk of one key): rounded from fp32, or as they are.
__m512i Chunk32(const float* src) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
}
__m512i Chunk32(const uint16_t* src) { return _mm512_loadu_si512(src); }

// TileKernels::pack_keys from fp32 keys (T = float) or pack_keys_bf16 from bf16 ones (T = uint16_t).
template <typename T>
void PackKeys(int64_t n, int64_t depth, const T* k, int64_t ldk, float* kt_floats) {
  uint32_t* kt = reinterpret_cast<uint32_t*>(kt_floats);  // one bf16 pair per element
  const int64_t panels = (n + kKeyPanel - 1) / kKeyPanel, chunks = depth / 32;
  __m512i rows[16];
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* panel = kt + p * kKeyPanel * depth / 2;
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t c = 0; c < chunks; ++c) {
        // Row x: key x of this half as 16 bf16 pairs (depths 32 c + 2 r and + 1 in pair r); transposed, row r is
        // the tile's row r.
        for (int64_t x = 0; x < 16; ++x) {
          const int64_t key = p * kKeyPanel + half * 16 + x;
          if (key < n) {
            rows[x] = Chunk32(k + key * ldk + 32 * c);
          } else {
            rows[x] = _mm512_setzero_si512();
          }
        }
        Transpose16x16(rows);
        uint32_t* tile = panel + (2 * c + half) * 256;  // 16 rows of 16 pairs
        for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 16, rows[r]);
      }
    }
  }
}

void ToBf16Array(int64_t n, const float* src, uint16_t* dst) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + j + 16),
                                                                       _mm512_loadu_ps(src + j)));
    _mm512_storeu_si512(dst + j, both);
  }
  if (j < n) {
    const __m512 lo = _mm512_maskz_loadu_ps(Mask(n - j), src + j);
    const __m512 hi = _mm512_maskz_loadu_ps(Mask(n - j - 16), src + j + 16);
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_mask_storeu_epi16(dst + j, static_cast<__mmask32>((uint64_t{1} << (n - j)) - 1), both);
  }
}

// Columns [0, 16) of two rows (those of `cols`; a null row gives zeros) as bf16, the even row in lanes 0-15 and the
// odd one in 16-31: rounded from fp32, or as they are.
__m512i RowPair(const float* even, const float* odd, __mmask16 cols) {
  const __m512 e = even != nullptr ? _mm512_maskz_loadu_ps(cols, even) : _mm512_setzero_ps();
  const __m512 o = odd != nullptr ? _mm512_maskz_loadu_ps(cols, odd) : _mm512_setzero_ps();
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o, e));
}
__m512i RowPair(const uint16_t* even, const uint16_t* odd, __mmask16 cols) {
  const __m512i e = even != nullptr ? _mm512_maskz_loadu_epi16(cols, even) : _mm512_setzero_si512();
  const __m512i o = odd != nullptr ? _mm512_maskz_loadu_epi16(cols, odd) : _mm512_setzero_si512();
  return _mm512_inserti64x4(e, _mm512_castsi512_si256(o), 1);
}

// TileKernels::pack_values (T = float) or pack_values_bf16 (T = uint16_t).
template <typename T>
void PackValues(int64_t n, int64_t width, const T* v, int64_t ldv, float* vp_floats, int64_t panel_stride) {
  uint16_t* vp = reinterpret_cast<uint16_t*>(vp_floats);
  const int64_t pairs = (n + kKeyPanel - 1) / kKeyPanel * kKeyPanel / 2;
  // Interleaves the 16 bf16 of one row (lanes 0-15) with those of the next (lanes 16-31).
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t w = 0; w < width; w += kValuePanel) {
    uint16_t* panel = vp + (w / kValuePanel) * panel_stride * 2;
    const __mmask16 cols = Mask(width - w);
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t r0 = 2 * j, r1 = 2 * j + 1;
      const __m512i both = RowPair(r0 < n ? v + r0 * ldv + w : nullptr, r1 < n ? v + r1 * ldv + w : nullptr, cols);
      _mm512_storeu_si512(panel + j * 32, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// dst[r, c] = bf16(scale * src[r, c]).
void CopyScaledToBf16(int64_t rows, int64_t cols, float scale, const float* src, int64_t lds, uint16_t* dst,
                      int64_t ldd) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 32) {
      const __m512 lo = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(Mask(cols - c), src + r * lds + c));
      const __m512 hi = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(Mask(cols - c - 16), src + r * lds + c + 16));
      const __mmask32 m = cols - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << (cols - c)) - 1);
      _mm512_mask_storeu_epi16(dst + r * ldd + c, m, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// dst[r, c] = scale * src[r, c] from bf16 src (a bf16 is the top half of its fp32).
void CopyScaledBf16(int64_t rows, int64_t cols, float scale, const uint16_t* src, int64_t lds, float* dst,
                    int64_t ldd) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = Mask(cols - c);
      const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, src + r * lds + c));
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm512_mask_storeu_ps(dst + r * ldd + c, m, _mm512_mul_ps(f, x));
    }
  }
}

// `avx512` (the fp32 AVX-512 set, whose softmax and copies a bf16 set keeps) with this file's packing and
// conversion, and a bf16 set's own products, panel height and key block.
TileKernels Bf16Kernels(const TileKernels& avx512, const char* isa, int panel_rows, int key_block,
                        decltype(TileKernels::scores) scores, decltype(TileKernels::values) values) {
  TileKernels k = avx512;
  k.isa = isa;
  k.lanes = 32;  // depth and width: whole 32-element chunks of the packed layouts
  k.key_panel = kKeyPanel;
  k.value_panel = kValuePanel;
  k.panel_rows = panel_rows;
  k.elements_per_float = 2;
  k.key_multiple = kKeyPanel;
  k.key_block = key_block;
  k.pack_keys = PackKeys<float>;
  k.pack_values = PackValues<float>;
  k.scores = scores;
  k.values = values;
  k.to_bf16 = ToBf16Array;
  k.pack_keys_bf16 = PackKeys<uint16_t>;
  k.pack_values_bf16 = PackValues<uint16_t>;
  k.copy_scaled_bf16 = CopyScaledBf16;
  k.copy_scaled_to_bf16 = CopyScaledToBf16;
  return k;
}
