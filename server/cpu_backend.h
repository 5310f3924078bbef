// Attention on the host CPU, fp32.
//
// Projections are oneDNN sgemm calls (one fused Q|K|V product for self-attention); measured here they beat the
// matmul primitive on the projection shapes. The attention core keeps the head-packed [B, T, H, d_k] layout and
// runs as one OpenMP region over (batch, head, query block of kQueryBlock rows), items of one kv head handed
// out together. With the tile kernels (tile_kernels.h; AVX-512 or AVX2, head_dim a multiple of their vector
// width) a thread packs its kv head's K^T and V into panels in its L2 once for all those items, and takes each
// item's queries a panel of a few rows at a time, from the score kernel through the softmax to the value kernel
// while the panel's scores are in L1 (and prefetches its next item's rows meanwhile):
//  - weights off: FlashAttention's online softmax over key blocks of kTileKeyBlock, so memory is O(T) per head;
//  - weights on: exact row softmax written in place in the returned [B, H, Tq, Tk] tensor, then P V from it.
// Otherwise (or with Create("sgemm")) oneDNN's sgemm does the same tiles on the tensors in place (scale fused as
// alpha), with the generic softmax row kernels. Key blocks that causal masking or key_lengths hide from every row
// of a panel are never computed. GQA/MQA point each query head at its shared K/V head; nothing is repeated.
//
// Thread-safe: scratch buffers belong to the calling thread. Each call parallelises over the calling thread's
// OpenMP threads (omp_set_num_threads on that thread sets how many), so the server still runs one large
// computation at a time; requests under 8 MFLOP run on the calling thread alone.
#ifndef MHA_SERVER_CPU_BACKEND_H_
#define MHA_SERVER_CPU_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "server/backend.h"
#include "server/tile_kernels.h"

namespace mha {

class CpuBackend final : public Backend {
 public:
  // Tile sizes of the attention core. kQueryBlock: rows per work item. kKeyBlock: keys per sgemm score tile (a
  // [kQueryBlock, kKeyBlock] fp32 tile is 128 KiB, within a core's L2).
  static constexpr int64_t kQueryBlock = 128;
  static constexpr int64_t kKeyBlock = 256;
  // Keys per block of the tile kernels' online softmax: a panel of a few query rows against 512 keys keeps its
  // scores in L1, and the block's K^T and V (128 KiB each at d_k = 64) in L2.
  static constexpr int64_t kTileKeyBlock = 512;

  // The kernels of the attention core: "auto" (the widest tile kernels this CPU runs whose vector width divides
  // head_dim), "avx512", "avx2" or "sgemm" (oneDNN's, on the head-packed tensors in place). A call whose head_dim
  // is not a multiple of an allowed kernels' vector width uses sgemm. UNAVAILABLE if oneDNN does not run here or
  // the CPU lacks the requested instructions; INVALID_ARGUMENT for any other name.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(absl::string_view tile_kernels = "auto");

  absl::string_view name() const override { return "cpu"; }
  bool serves_inline() const override { return true; }
  std::string device() const override;
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;

 private:
  // A head-packed view: batch b, token t, head h starts at data + (b * T + t) * row_stride + h * d_k.
  struct Packed {
    const float* data;
    int64_t row_stride;
  };

  explicit CpuBackend(std::vector<const kernels::TileKernels*> tile_kernels)
      : tile_kernels_(std::move(tile_kernels)) {}

  // Writes attention over q, k, v into out (head-packed, row stride out_stride) and, when non-null, the
  // probabilities into weights [B, H, Tq, Tk]. Throws dnnl::error.
  void Attend(const AttentionDims& d, const AttentionMask& mask, Packed q, Packed k, Packed v, float* out,
              int64_t out_stride, float* weights);
  // y[m, n] (row stride ldy) = x[m, k] (row stride ldx) w[k, n] + bias[n] (bias may be null). Throws dnnl::error.
  void Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, const float* bias, int64_t n,
              float* y, int64_t ldy);

  const std::vector<const kernels::TileKernels*> tile_kernels_;  // in order of preference; empty: sgemm only
};

}  // namespace mha

#endif  // MHA_SERVER_CPU_BACKEND_H_
