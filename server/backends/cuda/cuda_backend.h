// Attention on an NVIDIA GPU: projections with cuBLAS (fp16/bf16 on tensor cores with fp32 accumulation, fp32 in
// fp32 without TF32 unless allowed), the attention core on this backend's flash kernels (attention_kernels.cu),
// stored layers uploaded once and kept resident on the device.
//
// Precision contract (stated in the proto): a request computes in its wire dtype. fp16/bf16 inputs go to the
// device as sent and every product runs on tensor cores with fp32 accumulators; softmax statistics are fp32.
// fp32 requests compute in fp32 throughout. Outputs are written in the requested dtype.
//
// Memory: each of a few lanes owns a CUDA stream, a cuBLAS handle, a device buffer and a pinned host buffer, grown
// on demand and reused across requests (cudaMalloc, never managed memory); concurrent calls take different lanes,
// so the copies of one overlap the compute of another. A call whose buffers exceed the device's memory is refused
// with RESOURCE_EXHAUSTED before anything is copied. Every CUDA and cuBLAS error becomes a Status.
//
// Thread-safe.
#ifndef MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_H_
#define MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"

namespace mha {

class CudaBackend final : public Backend {
 public:
  struct Options {
    int device = 0;              // CUDA device ordinal
    int lanes = 2;               // concurrent calls (streams)
    bool allow_tf32 = false;     // fp32 projections on TF32 tensor cores (about 10 bits of mantissa)
    // Resident layer weights kept on the device, least recently used evicted beyond it. 0: a quarter of the
    // device's memory.
    int64_t layer_cache_bytes = 0;
  };

  // UNAVAILABLE, with the driver's or the loader's reason, when there is no usable GPU (any error from the device
  // query), when this build carries no kernel image for the GPU, or when cuBLAS cannot be loaded.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create() { return Create(Options()); }
  ~CudaBackend() override;

  absl::string_view name() const override { return kCudaBackend; }
  std::string device() const override;
  // head_dim up to 256 and sizes cuBLAS's 32-bit dimensions hold; every dtype, mask and option.
  absl::Status Supports(const AttentionProblem& problem) const override;
  // The wire dtype: 16-bit requests compute on tensor cores in their dtype.
  v1::DataType ComputeDtype(const AttentionProblem& problem) const override { return problem.input_dtype; }
  // Device bytes beyond inputs and outputs (projections, heads, statistics); host staging equals inputs plus
  // outputs.
  int64_t WorkspaceBytes(const AttentionProblem& problem) const override;
  // One call per lane at a time: the server's concurrent threads keep every lane busy.
  int concurrent_calls() const override;
  absl::StatusOr<double> WarmUp() override;
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;
  // Sessions: the paged kernels (paged_kernels.h) read blocks in place when they are device-accessible (the arena
  // below), and otherwise stage the blocks a call reads through the device and write its new tokens back.
  absl::Status SupportsPaged(const PagedProblem& problem) const override;
  int64_t PagedWorkspaceBytes(const PagedProblem& problem) const override;
  absl::Status PagedAttention(const PagedArgs& args) override;
  // CUDA managed memory preferring this backend's device: the cache stays in HBM, and host code may still touch it.
  absl::StatusOr<std::unique_ptr<CacheArena>> AllocateCacheArena(int64_t bytes) override;

  class Impl;

 private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_H_
