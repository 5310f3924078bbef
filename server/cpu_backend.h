// Attention on the host CPU, fp32, with oneDNN doing the matmuls.
//
// Projections are oneDNN sgemm calls (one fused Q|K|V product for self-attention), which JIT and cache their
// kernels inside oneDNN; measured here they beat the matmul primitive on every projection shape. The attention
// core keeps the head-packed [B, T, H, d_k] layout and reads it in place through row strides (GQA/MQA point each
// query head at its shared K/V head; nothing is copied or repeated). It runs as one
// OpenMP region over (batch, head, query block of kQueryBlock rows); each item computes its score tiles with
// oneDNN's sgemm (scale fused as alpha) on its own thread so tiles stay in that core's cache:
//  - weights off: FlashAttention's online softmax over key blocks of kKeyBlock, so memory is O(T) per head;
//  - weights on: exact row softmax written in place in the returned [B, H, Tq, Tk] tensor, then P V from it.
// Key blocks that causal masking or key_lengths hide from every row of a query block are never computed.
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
  // Tile sizes of the attention core: a [kQueryBlock, kKeyBlock] fp32 score tile is 128 KiB, and with its K and V
  // blocks stays within a core's L2 (tuned with tests/bench/attention_bench; docs/PERFORMANCE.md).
  static constexpr int64_t kQueryBlock = 128;
  static constexpr int64_t kKeyBlock = 256;
  // Keys per block of the tile kernels' online softmax: a panel of a few query rows against 512 keys keeps its
  // scores in L1, and the block's K^T and V (128 KiB each at d_k = 64) in L2.
  static constexpr int64_t kTileKeyBlock = 512;

  // The matmuls of the attention core: "auto" (the widest tile kernels this CPU runs whose vector width divides
  // head_dim), "avx512", "avx2" or "sgemm" (oneDNN's, on the head-packed tensors in place). A call whose head_dim
  // is not a multiple of any allowed kernels' vector width uses sgemm. UNAVAILABLE if oneDNN does not run here or the CPU lacks the requested
  // instructions; INVALID_ARGUMENT for any other name.
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
