// How the CUDA backend cuts one attention call into thread blocks, decided on the host and testable without a GPU:
// which kernel runs (tensor cores for fp16/bf16 at head_dim 64 and 128, a SIMT kernel for everything else), the
// grid, the tiles, the shared memory, and the keys each query tile can see. VisibleKeyEnd and KeyTileCount are
// compiled for both host and device so that the planner's tests check the very rule the kernels use.
#ifndef MHA_SERVER_BACKENDS_CUDA_FLASH_PLAN_H_
#define MHA_SERVER_BACKENDS_CUDA_FLASH_PLAN_H_

#include <cstdint>

#ifdef __CUDACC__
#define MHA_HOST_DEVICE __host__ __device__
#else
#define MHA_HOST_DEVICE
#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#endif

namespace mha {
namespace cuda {

// The largest head_dim any kernel computes (the SIMT kernel keeps head_dim / 32 values per lane in registers).
inline constexpr int kMaxHeadDim = 256;
// The tensor-core kernel: warps of 16 query rows each, 8 of them by default (128 query rows per block, so that each
// K/V tile read from L2 serves twice the rows of a 4-warp block; 4 warps is the other compiled choice), key tiles
// of 64.
inline constexpr int kTcBlockM = 128;
inline constexpr int kTcBlockN = 64;
// The SIMT kernel: one warp per query row, 4 warps per block, keys in steps of 32 (one per lane).
inline constexpr int kSimtWarps = 4;
inline constexpr int kSimtThreads = 32 * kSimtWarps;
// CUDA's limit on gridDim.y and gridDim.z.
inline constexpr int64_t kMaxGridYZ = 65535;

// One past the last key that query row i may see under causal masking (bottom-right aligned: key j is hidden when
// j > i + Tk - Tq) and the batch item's key length (-1: none); between 0 and kv_len. The same rule as
// VisibleKeyCount in backend.h, on plain numbers.
MHA_HOST_DEVICE inline int64_t VisibleKeyEnd(int64_t q_len, int64_t kv_len, bool causal, int64_t key_length,
                                             int64_t i) {
  int64_t n = kv_len;
  if (causal) {
    const int64_t last = i + (kv_len - q_len) + 1;
    n = last < 0 ? 0 : (last < n ? last : n);
  }
  if (key_length >= 0 && key_length < n) n = key_length;
  return n;
}

// Key tiles of `block_n` keys that query rows [row0, row0 + rows) need: every tile holding a key some row may see.
// Tiles past the last row's visible end are skipped (causal masking makes the later rows see the most keys).
MHA_HOST_DEVICE inline int64_t KeyTileCount(int64_t q_len, int64_t kv_len, bool causal, int64_t key_length,
                                            int64_t row0, int64_t rows, int64_t block_n) {
  int64_t last_row = row0 + rows - 1;
  if (last_row >= q_len) last_row = q_len - 1;
  const int64_t end = VisibleKeyEnd(q_len, kv_len, causal, key_length, last_row);
  return (end + block_n - 1) / block_n;
}

// The query tile that block row `y` of a grid of `grid_y` rows computes. Blocks start in about blockIdx order, and
// under causal masking the last query tiles see the most keys: they run first, so that the short tiles fill in at
// the end instead of a long one finishing alone.
MHA_HOST_DEVICE inline int64_t QueryTileOf(bool causal, int64_t grid_y, int64_t y) {
  return causal ? grid_y - 1 - y : y;
}

enum class FlashKernel { kTensorCore, kSimt };

// One launch of the attention kernel: grid (batch * heads, query tiles), `threads` per block.
struct FlashPlan {
  FlashKernel kernel = FlashKernel::kSimt;
  int block_m = 0;          // query rows per block (tensor cores: 64 or 128, 16 per warp)
  int block_n = 0;          // keys per tile
  int threads = 0;          // per block
  int64_t grid_x = 0;       // batch * num_heads
  int64_t grid_y = 0;       // query tiles: ceil(q_len / block_m)
  int64_t smem_bytes = 0;   // static shared memory per block
  // Tensor-core kernel: K and V tiles copied with cp.async, V's copy overlapping S = Q K^T and the next K's
  // overlapping O += P V (FlashAttention-2's order); false: plain loads between barriers (kept for comparison).
  bool async_copies = false;
};

#ifndef __CUDACC__

// The plan for attention on q/k/v of `dtype` (on the device, as the wire or the projections made them). The
// tensor-core kernel serves fp16 and bf16 with head_dim 64 or 128, softmax statistics included; every other case
// takes the SIMT kernel. UNIMPLEMENTED when no kernel computes the shape (head_dim above kMaxHeadDim, a grid beyond
// CUDA's limits).
absl::StatusOr<FlashPlan> PlanFlash(const AttentionShape& shape, v1::DataType dtype);

// `plan` (a tensor-core plan) as another of the kernel's compiled variants: `block_m` query rows per block (64 or
// 128: 4 or 8 warps of 16 rows), its tiles copied asynchronously or not. For the benchmark and the tests that
// compare the variants; PlanFlash makes its choice through it too.
FlashPlan TensorCoreVariant(FlashPlan plan, int64_t q_len, int block_m, bool async_copies);

// What the CUDA backend computes: every dtype, mask and option (RoPE and the softmax statistics included), with
// head_dim up to kMaxHeadDim. UNIMPLEMENTED, saying why, otherwise.
absl::Status CudaSupports(const AttentionProblem& problem);

// Device bytes a call needs beyond resident layer weights: its inputs and outputs on the device, the projections,
// the concatenated heads, the row statistics of the weights pass, the softmax statistics and the masks.
int64_t CudaWorkspaceBytes(const AttentionProblem& problem);

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_FLASH_PLAN_H_
