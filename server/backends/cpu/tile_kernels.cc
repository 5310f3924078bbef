#include "server/backends/cpu/tile_kernels.h"

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

const TileKernels* TileKernelsFor(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0 && __builtin_cpu_supports("avx512f")) return &avx512::kKernels;
  if (std::strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return &avx2::kKernels;
  }
  if (std::strcmp(isa, "portable") == 0) return &portable::kKernels;
  return nullptr;
}

}  // namespace mha::kernels
