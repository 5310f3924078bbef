#include "server/backends/cpu/tile_kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace mha::kernels {
namespace avx512 {
extern const TileKernels kKernels;
extern const decltype(TileKernels::online_softmax) kBf16OnlineSoftmax;  // its exps to bf16's precision
extern const decltype(TileKernels::online_softmax_stats) kBf16OnlineSoftmaxStats;
}
namespace avx2 {
extern const TileKernels kKernels;
}
namespace portable {
extern const TileKernels kKernels;
}
namespace amx {
TileKernels MakeKernels(const TileKernels& avx512);
}
namespace avx512bf16 {
TileKernels MakeKernels(const TileKernels& avx512);
extern const PagedKernels kBf16PagedKernels;
extern const PagedKernels kFp8PagedKernels[2];  // E4M3, E5M2
}
namespace avx512vnni {
extern const PagedKernels kInt8PagedKernels;
}

namespace {

// Linux hands out AMX's 8 KiB of tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. The grant is for the whole process.
bool AmxPermitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// AVX512-F, AVX512-BW, AVX512-DQ and AVX512-BF16 (CPUID leaf 7; every CPU with BF16 has DQ), with the OS's XCR0
// enabling the ZMM state (bits 5..7); with `tiles`, AMX-TILE and AMX-BF16 too, and XCR0's tile state (bits 17, 18).
// Read directly rather than through __builtin_cpu_supports, whose feature names for AMX clang 14 does not know.
bool CpuHasAvx512Bf16(bool tiles) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv may run
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) return false;
  const bool avx512_bf16 = (a1 >> 5) & 1;
  if (!(avx512f && avx512bw && avx512dq && avx512_bf16) || (tiles && !(amx_bf16 && amx_tile))) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr unsigned kZmmState = 0xE0, kTileState = 0x60000;
  return (xcr0_lo & kZmmState) == kZmmState && (!tiles || (xcr0_lo & kTileState) == kTileState);
}

// F16C (CPUID leaf 1, ECX bit 29): fp16 conversions, which the avx2 set's decode kernels use.
bool CpuHasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1);
}

// AVX512-VNNI and AVX512-DQ (CPUID leaf 7, ECX bit 11 and EBX bit 17; every CPU with VNNI has DQ), asked where the
// AVX-512 sets already run.
bool CpuHasAvx512Vnni() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((c >> 11) & 1) && ((b >> 17) & 1);
}

// The INT8 caches' decode kernels of a set over the AVX-512 set's: VNNI's where the CPU has it.
PagedKernels Avx512Int8(const PagedKernels& plain) {
  return CpuHasAvx512Vnni() ? avx512vnni::kInt8PagedKernels : plain;
}

// The AVX-512 set, its INT8 caches' decode kernels VNNI's where the CPU has it.
TileKernels Avx512Set() {
  const PagedKernels* p = avx512::kKernels.paged;
  static const PagedKernels kPaged[kPagedDtypes] = {p[0], p[1], p[2], Avx512Int8(p[3]), p[4], p[5]};
  TileKernels k = avx512::kKernels;
  k.paged = kPaged;
  return k;
}

// A bf16 set (its packing and products over the AVX-512 set's kernels) with the online softmax whose exps keep
// bf16's precision only: its products round the weights to bf16. Its decode kernels: the AVX-512 set's for fp32
// and fp16 caches (and INT8, VNNI's where the CPU has it), AVX512-BF16's dot products for bf16 and FP8 caches.
TileKernels Bf16Set(TileKernels k) {
  static const PagedKernels kPaged[kPagedDtypes] = {k.paged[0],
                                                    k.paged[1],
                                                    avx512bf16::kBf16PagedKernels,
                                                    Avx512Int8(k.paged[3]),
                                                    avx512bf16::kFp8PagedKernels[0],
                                                    avx512bf16::kFp8PagedKernels[1]};
  k.online_softmax = avx512::kBf16OnlineSoftmax;
  k.online_softmax_stats = avx512::kBf16OnlineSoftmaxStats;
  k.paged = kPaged;
  return k;
}

}  // namespace

const TileKernels* TileKernelsFor(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "amx") == 0 && CpuHasAvx512Bf16(/*tiles=*/true) && AmxPermitted()) {
    static const TileKernels kAmx = Bf16Set(amx::MakeKernels(avx512::kKernels));
    return &kAmx;
  }
  if (std::strcmp(isa, "avx512bf16") == 0 && CpuHasAvx512Bf16(/*tiles=*/false)) {
    static const TileKernels kAvx512Bf16 = Bf16Set(avx512bf16::MakeKernels(avx512::kKernels));
    return &kAvx512Bf16;
  }
  if (std::strcmp(isa, "avx512") == 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    static const TileKernels kAvx512 = Avx512Set();
    return &kAvx512;
  }
  if (std::strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      CpuHasF16c()) {
    return &avx2::kKernels;
  }
  if (std::strcmp(isa, "portable") == 0) return &portable::kKernels;
  return nullptr;
}

}  // namespace mha::kernels
