// Projections of bf16 requests on oneDNN's bf16 matmul primitive, on CPUs that compute bf16 natively (AVX512-BF16,
// AMX-BF16): the request's bf16 bytes are the source as sent, the layer's fp32 weights are rounded to bf16 and packed
// in the primitive's preferred layout once per stored layer, products accumulate in fp32: several times the fp32
// rate on AMX, about twice on AVX512-BF16 (docs/PERFORMANCE.md).
//
// Thread-safe. This module keeps the primitives of recent shapes (describing one costs more than a small projection
// computes) and the packed weights.
#ifndef MHA_SERVER_BACKENDS_CPU_BF16_MATMUL_H_
#define MHA_SERVER_BACKENDS_CPU_BF16_MATMUL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "server/backends/backend.h"

namespace mha {
namespace cpu {

// The oneDNN implementation a bf16 matmul gets on this CPU (e.g. "brg:avx512_core_amx_bf16"), or empty when the
// CPU has no native bf16 arithmetic (oneDNN would emulate it, slower than fp32). Decided once.
const std::string& NativeBf16Matmul();

// The weights of one product: fp32 [k, n] with row stride ld, and the key that names them in the packed-weights
// cache (LayerWeights::resident_id; 0 packs them for this call only).
struct Bf16Weights {
  const float* w = nullptr;
  int64_t ld = 0;
  uint64_t resident_id = 0;
};

enum class MatmulOut { kF32, kBF16 };

// y[m, n] (row stride ldy, fp32 or bf16) = x[m, k] (bf16, row stride ldx) W[k, n] + bias[n] (fp32, may be null), in
// slices of rows between which `stop` (may be null) is polled. Uses the calling thread's OpenMP threads. oneDNN's
// errors come back as INTERNAL.
absl::Status MatmulBf16(const void* x, int64_t m, int64_t k, int64_t ldx, const Bf16Weights& w, const float* bias,
                        int64_t n, void* y, MatmulOut y_type, int64_t ldy, const StopSignal* stop);

// Bytes of packed bf16 weights the cache holds now. For tests.
int64_t PackedWeightBytes();

}  // namespace cpu
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CPU_BF16_MATMUL_H_
