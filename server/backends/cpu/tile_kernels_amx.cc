// The attention core's two products on AMX-BF16 (compiled with -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16;
// called only where the CPU has AMX-BF16 and AVX512-BF16 and the kernel grants this process the tile state).
//
// Operands are rounded to bf16 (round to nearest even) and multiplied on the tile unit with fp32 accumulation:
// Q (times the scale) and P when each call reads them, K and V once when packed. The softmax between the products
// stays fp32 (the AVX-512 set's). Every call loads its own tile configuration and releases the tiles at its end:
// oneDNN's AMX kernels, running on the same threads for the projections, configure the tiles their own way, and
// released tiles keep the kernel's context switches from saving 8 KiB of tile state.
//
// Packed layouts, in bf16 (two per float of the caller's buffers; TileKernels::elements_per_float = 2):
//  - K^T: panels of 32 keys, one after another, each [depth / 32] chunks of two 16-key B tiles: tile (chunk c,
//    half h) row r holds, for its keys x = 0..15, the pair (k[key x][32 c + 2 r], k[key x][32 c + 2 r + 1]). Keys
//    past n are zero.
//  - V: panels of 16 columns, panel_stride floats apart; in each, row pair j (keys 2 j and 2 j + 1) is 32 bf16,
//    (v[2 j][x], v[2 j + 1][x]) for its columns x = 0..15, so that 16 row pairs (32 keys) are one B tile. Keys past
//    n, up to the next multiple of 32, are zero.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::amx {
namespace {

constexpr int64_t kRows = 32;       // query rows per block: two tiles of 16
constexpr int64_t kKeyPanel = 32;   // keys per K^T panel: two B tiles
constexpr int64_t kValuePanel = 16; // columns per V panel: one B tile
constexpr int64_t kKeyChunk = 512;  // keys of P converted to bf16 at a time

// Tiles 0-3 accumulate a 32x32 fp32 block (rows 0-15 and 16-31 by columns 0-15 and 16-31); 4 and 5 are the two
// 16-row A tiles, 6 and 7 the two B tiles. Every tile is 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

class ScopedTiles {
 public:
  ScopedTiles() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  ~ScopedTiles() { _tile_release(); }
};

// A per-thread buffer on a 64-byte boundary, so that no tile row straddles two cache lines, grown on demand. Not a
// std::vector: its out-of-line members would be compiled here with AVX-512 enabled, and the linker may keep this
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
      if (data_ == nullptr) std::abort();  // at most tens of KiB (32 rows of one key chunk or one head)
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

// Per-thread operands in bf16 and the fp32 blocks around the tiles.
struct Scratch {
  AlignedBuffer a;      // [kRows, depth] queries or [kRows, <= kKeyChunk] probabilities, bf16
  AlignedBuffer block;  // [kRows, width] staged output rows, or one 32x32 block of scores, fp32
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

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

void PackKeys(int64_t n, int64_t depth, const float* k, int64_t ldk, float* kt_floats) {
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
            const float* src = k + key * ldk + 32 * c;
            rows[x] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
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

void PackValues(int64_t n, int64_t width, const float* v, int64_t ldv, float* vp_floats, int64_t panel_stride) {
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
      const __m512 even = r0 < n ? _mm512_maskz_loadu_ps(cols, v + r0 * ldv + w) : _mm512_setzero_ps();
      const __m512 odd = r1 < n ? _mm512_maskz_loadu_ps(cols, v + r1 * ldv + w) : _mm512_setzero_ps();
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
      _mm512_storeu_si512(panel + j * 32, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

void Scores(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
            const float* kt_floats, float* s, int64_t lds) {
  const uint16_t* kt = reinterpret_cast<const uint16_t*>(kt_floats);
  Scratch& scratch = ThreadScratch();
  uint16_t* qb = static_cast<uint16_t*>(scratch.a.Get(kRows * depth * 2));
  float* edge = static_cast<float*>(scratch.block.Get(kRows * kKeyPanel * 4));
  const int64_t chunks = depth / 32, a_stride = depth * 2;
  ScopedTiles tiles;
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const int64_t r = Min(kRows, rows - i0);
    if (ldq == depth) {  // dense rows (the attention core's queries): one pass
      ToBf16(q + i0 * ldq, r * depth, r * depth, scale, qb);
    } else {
      for (int64_t i = 0; i < r; ++i) ToBf16(q + (i0 + i) * ldq, depth, depth, scale, qb + i * depth);
    }
    std::memset(qb + r * depth, 0, (kRows - r) * depth * sizeof(uint16_t));
    for (int64_t j0 = 0; j0 < cols; j0 += kKeyPanel) {
      const uint16_t* panel = kt + j0 * depth;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, qb + c * 32, a_stride);
        _tile_loadd(5, qb + 16 * depth + c * 32, a_stride);
        _tile_loadd(6, panel + c * 1024, 64);
        _tile_loadd(7, panel + c * 1024 + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      const int64_t n = Min(kKeyPanel, cols - j0);
      if (r == kRows && n == kKeyPanel) {
        float* dst = s + i0 * lds + j0;
        _tile_stored(0, dst, lds * 4);
        _tile_stored(1, dst + 16, lds * 4);
        _tile_stored(2, dst + 16 * lds, lds * 4);
        _tile_stored(3, dst + 16 * lds + 16, lds * 4);
      } else {  // an edge block: through the scratch, so that nothing past the output is written
        _tile_stored(0, edge, kKeyPanel * 4);
        _tile_stored(1, edge + 16, kKeyPanel * 4);
        _tile_stored(2, edge + 16 * kKeyPanel, kKeyPanel * 4);
        _tile_stored(3, edge + 16 * kKeyPanel + 16, kKeyPanel * 4);
        for (int64_t i = 0; i < r; ++i) std::memcpy(s + (i0 + i) * lds + j0, edge + i * kKeyPanel, n * sizeof(float));
      }
    }
  }
}

void Values(int64_t rows, int64_t n, int64_t width, const float* p, int64_t ldp, const float* vp_floats,
            int64_t panel_stride, const float* o_scale, float* o, int64_t ldo) {
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vp_floats);
  Scratch& scratch = ThreadScratch();
  const int64_t chunk_keys = Min(kKeyChunk, (n + 31) / 32 * 32);
  uint16_t* pb = static_cast<uint16_t*>(scratch.a.Get(kRows * chunk_keys * 2));
  float* staged = static_cast<float*>(scratch.block.Get(kRows * width * 4));
  ScopedTiles tiles;
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const int64_t r = Min(kRows, rows - i0);
    // A whole block of rows accumulates in o itself; a partial one in `staged`, so that the tiles' 32 rows stay
    // inside memory this call owns.
    const bool direct = r == kRows;
    float* acc = direct ? o + i0 * ldo : staged;
    const int64_t ld = direct ? ldo : width;
    const bool from_zero = o_scale == nullptr;
    for (int64_t i = 0; i < (direct ? 0 : kRows); ++i) {
      if (i < r && !from_zero) {
        std::memcpy(staged + i * width, o + (i0 + i) * ldo, width * sizeof(float));
      } else {
        std::memset(staged + i * width, 0, width * sizeof(float));
      }
    }
    // The online softmax's rescaling, skipped for the rows whose max did not move (factor 1, most rows after the
    // first blocks).
    for (int64_t i = 0; i < r && !from_zero; ++i) {
      if (o_scale[i0 + i] == 1.0f) continue;
      const __m512 f = _mm512_set1_ps(o_scale[i0 + i]);
      for (int64_t c = 0; c < width; c += 16) {
        _mm512_storeu_ps(acc + i * ld + c, _mm512_mul_ps(f, _mm512_loadu_ps(acc + i * ld + c)));
      }
    }
    const int64_t stride = ld * 4;
    for (int64_t k0 = 0; k0 < n; k0 += kKeyChunk) {
      const int64_t keys = Min(kKeyChunk, n - k0), padded = (keys + 31) / 32 * 32;
      for (int64_t i = 0; i < r; ++i) ToBf16(p + (i0 + i) * ldp + k0, keys, padded, 1.0f, pb + i * padded);
      std::memset(pb + r * padded, 0, (kRows - r) * padded * sizeof(uint16_t));
      for (int64_t w = 0; w < width; w += 2 * kValuePanel) {
        float* a = acc + w;
        if (k0 == 0 && from_zero && direct) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, a, stride);
          _tile_loadd(1, a + 16, stride);
          _tile_loadd(2, a + 16 * ld, stride);
          _tile_loadd(3, a + 16 * ld + 16, stride);
        }
        const uint16_t* v0 = vp + (w / kValuePanel) * panel_stride * 2 + k0 * 16;
        const uint16_t* v1 = v0 + panel_stride * 2;
        for (int64_t kc = 0; kc < padded; kc += 32) {
          _tile_loadd(4, pb + kc, padded * 2);
          _tile_loadd(5, pb + 16 * padded + kc, padded * 2);
          _tile_loadd(6, v0 + kc * 16, 64);
          _tile_loadd(7, v1 + kc * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, a, stride);
        _tile_stored(1, a + 16, stride);
        _tile_stored(2, a + 16 * ld, stride);
        _tile_stored(3, a + 16 * ld + 16, stride);
      }
    }
    for (int64_t i = 0; i < (direct ? 0 : r); ++i) {
      std::memcpy(o + (i0 + i) * ldo, staged + i * width, width * sizeof(float));
    }
  }
}

}  // namespace

// The AVX-512 set with the packing and the two products replaced; its softmax and copies are the AVX-512 set's.
TileKernels MakeKernels(const TileKernels& avx512) {
  TileKernels k = avx512;
  k.isa = "amx";
  k.lanes = 32;  // depth and width: whole 32-element rows of the A tiles
  k.key_panel = kKeyPanel;
  k.value_panel = kValuePanel;
  k.panel_rows = kRows;
  k.elements_per_float = 2;
  k.key_multiple = kKeyPanel;
  k.key_block = 256;  // measured per key: 13% faster than 512, whose 64 KiB of scores spill from L1
  k.pack_keys = PackKeys;
  k.pack_values = PackValues;
  k.scores = Scores;
  k.values = Values;
  k.to_bf16 = ToBf16Array;
  return k;
}

}  // namespace mha::kernels::amx
