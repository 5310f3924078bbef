// The attention core's two products on AMX-BF16 (compiled with -mamx-tile -mamx-bf16 -mavx512f -mavx512bf16;
// called only where the CPU has AMX-BF16 and AVX512-BF16 and the kernel grants this process the tile state).
//
// Operands are rounded to bf16 (round to nearest even) and multiplied on the tile unit with fp32 accumulation:
// Q (times the scale) and P when each call reads them, K and V once when packed. The softmax between the products
// stays fp32 (the AVX-512 set's). Every call loads its own tile configuration and releases the tiles at its end:
// oneDNN's AMX kernels, running on the same threads for the projections, configure the tiles their own way, and
// released tiles keep the kernel's context switches from saving 8 KiB of tile state.
//
// The packed layouts of K^T and V are tile_kernels_bf16.h's.
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "server/backends/cpu/tile_kernels.h"

namespace mha::kernels::amx {
namespace {

#include "server/backends/cpu/tile_kernels_bf16.h"  // the packed layouts, bf16 conversions, scratch

constexpr int64_t kRows = 32;       // query rows per block: two tiles of 16
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

// The AVX-512 set with the packing and the two products replaced. Key blocks of 256, whose scores stay in L1
// (512's 64 KiB spill from it).
TileKernels MakeKernels(const TileKernels& avx512) { return Bf16Kernels(avx512, "amx", kRows, 256, Scores, Values); }

}  // namespace mha::kernels::amx
