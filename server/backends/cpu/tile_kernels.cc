#include "server/backends/cpu/tile_kernels.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace mha::kernels {
namespace avx512 {
extern const TileKernels kKernels;
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

namespace {

// Linux hands out AMX's 8 KiB of tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. The grant is for the whole process.
bool AmxPermitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

}  // namespace

const TileKernels* TileKernelsFor(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "amx") == 0 && __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && AmxPermitted()) {
    static const TileKernels kAmx = amx::MakeKernels(avx512::kKernels);
    return &kAmx;
  }
  if (std::strcmp(isa, "avx512") == 0 && __builtin_cpu_supports("avx512f")) return &avx512::kKernels;
  if (std::strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return &avx2::kKernels;
  }
  if (std::strcmp(isa, "portable") == 0) return &portable::kKernels;
  return nullptr;
}

}  // namespace mha::kernels
