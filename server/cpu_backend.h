// Attention on the host CPU through oneDNN primitives, fp32.
//
// Projections are matmuls (one fused Q|K|V matmul for self-attention); the attention core runs over all heads at
// once as batched matmuls [B, Hkv, G, T, d_k] that read the head-packed [B, T, H, d_k] layout through strided
// memory descriptors (GQA/MQA broadcast K/V over the group G without copying), with the scale fused as an output
// scale and the softmax primitive on dense tiles. Work is tiled over (batch, query block) so that score memory
// is bounded by kScoreTileBytes rather than O(T^2); with causal or key_lengths, keys no query of a tile can see
// are skipped. Primitives are created once per shape and cached.
//
// Not thread-safe: one computation at a time (the server's scheduler guarantees it). oneDNN parallelises each
// primitive over the calling thread's OpenMP threads (omp_set_num_threads on that thread sets how many).
#ifndef MHA_SERVER_CPU_BACKEND_H_
#define MHA_SERVER_CPU_BACKEND_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "server/backend.h"

namespace mha {

class CpuBackend final : public Backend {
 public:
  // Upper bound on the score tile (and so on the attention core's scratch), in bytes. A single query row that
  // needs more than this still runs, as a one-row tile.
  static constexpr int64_t kScoreTileBytes = 32 << 20;

  // UNAVAILABLE if oneDNN cannot create a CPU engine.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create();

  absl::string_view name() const override { return "cpu"; }
  std::string device() const override;
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;

 private:
  // A head-packed view: batch b, token t, head h starts at data + (b * T + t) * row_stride + h * d_k.
  struct Packed {
    const float* data;
    int64_t row_stride;
  };
  // A memory descriptor as plain numbers (dims and strides), which is also its cache key.
  struct Layout {
    std::vector<int64_t> dims;
    std::vector<int64_t> strides;
  };

  CpuBackend(dnnl::engine engine, dnnl::stream stream);

  // Writes attention over q, k, v into out (head-packed, row stride out_stride) and, when non-null, the
  // probabilities into weights [B, H, Tq, Tk]. Throws dnnl::error.
  void Attend(const AttentionDims& d, const AttentionMask& mask, Packed q, Packed k, Packed v, float* out,
              int64_t out_stride, float* weights);
  // y[m, n] (row stride ldy) = x[m, k] (row stride ldx) w[k, n] + bias[n] (bias may be null). Throws dnnl::error.
  void Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, const float* bias, int64_t n,
              float* y, int64_t ldy);
  // dst = output_scale * src x weights (+ bias), through a cached primitive.
  void RunMatmul(const Layout& src, const float* src_data, const Layout& weights, const float* weights_data,
                 const float* bias_data, const Layout& dst, float* dst_data, float output_scale);
  void RunSoftmax(int64_t rows, int64_t cols, float* data);

  dnnl::engine engine_;
  dnnl::stream stream_;
  std::map<std::vector<int64_t>, dnnl::matmul> matmuls_;
  std::map<std::vector<int64_t>, dnnl::softmax_forward> softmaxes_;
  // Scratch reused across calls (grown on demand, never shrunk below the largest request seen).
  std::vector<float> scores_;     // score tile
  std::vector<char> dead_rows_;   // rows of the tile with no visible key
  std::vector<float> projected_;  // Q|K|V projections
  std::vector<float> heads_;      // concatenated head outputs [B*Tq, H*d_k]
  std::vector<float> fused_w_;    // fused Q|K|V weights and bias, when the layer has none precomputed
};

}  // namespace mha

#endif  // MHA_SERVER_CPU_BACKEND_H_
