// Attention on the host CPU: projections through oneDNN's sgemm (one fused Q|K|V product for self-attention with a
// fused layer), or for bf16 requests on a CPU with native bf16 arithmetic through oneDNN's bf16 matmul with the
// layer's weights packed once (bf16_matmul.h); the attention core on hand-written tile kernels (attention_core.h),
// chosen per call among the instruction sets this CPU runs: fp32, or for those bf16 calls AMX-BF16's tiles or
// AVX512-BF16's dot products.
//
// Thread-safe: scratch buffers belong to the calling thread. Each call parallelises over the calling thread's
// OpenMP threads (omp_set_num_threads on that thread sets how many); calls up to kSerialFlops run on the calling
// thread alone.
#ifndef MHA_SERVER_BACKENDS_CPU_CPU_BACKEND_H_
#define MHA_SERVER_BACKENDS_CPU_CPU_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha {

class CpuBackend final : public Backend {
 public:
  // Calls of at most this many FLOPs run single-threaded. A team of threads pays a wake-up and a barrier per
  // parallel region, and on cores shared with other work (another process, Kubernetes neighbours, gRPC's own
  // threads) each barrier waits for the team's slowest, descheduled thread, which costs small calls more than a
  // second thread gains them.
  static constexpr double kSerialFlops = 5e7;
  // Calls of at most this many FLOPs take tens of microseconds, so the server may run them on gRPC's threads.
  static constexpr double kInlineMaxFlops = 8e6;

  // The tile kernels the attention core may use: "auto" (every set this CPU runs, widest first; a call takes the
  // first whose vector width divides head_dim, else the widest; a bf16 call with head_dim a multiple of 32 takes
  // the amx set where the CPU has it, else the avx512bf16 set where it has that), "amx" or "avx512bf16" (the same,
  // requiring that bf16 set), or one of the fp32 sets "avx512", "avx2", "portable" for every call. UNAVAILABLE if
  // oneDNN does not run here or the CPU lacks the requested instructions; INVALID_ARGUMENT for any other name.
  // bf16: bf16 requests project on oneDNN's bf16 matmul (bf16_matmul.h) when this CPU computes bf16 natively
  // (AVX512-BF16 or AMX); false, or a CPU without it, computes every request in fp32.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(absl::string_view tile_kernels = "auto",
                                                            bool bf16 = true);

  absl::string_view name() const override { return kCpuBackend; }
  std::string device() const override;
  // Every shape, dtype and option (16-bit tensors are converted to fp32 at the edges; any head_dim runs on the tile
  // kernels).
  absl::Status Supports(const AttentionProblem& problem) const override { return absl::OkStatus(); }
  // BF16 for a bf16 layer call when the bf16 projections are on (its attention core multiplies in bf16 where a bf16
  // set takes its head_dim), and for a bf16 attention-core call (ScaledDotProductAttention) whose head_dim the bf16
  // set takes; FP32 otherwise.
  v1::DataType ComputeDtype(const AttentionProblem& problem) const override;
  // Projections, the concatenated heads, fp32 copies of 16-bit inputs and outputs, and each thread's tile scratch.
  int64_t WorkspaceBytes(const AttentionProblem& problem) const override;
  double inline_max_flops() const override { return kInlineMaxFlops; }
  // A 256-token layer of width 512 (0.67 GFLOP): large enough to run on every thread and show the backend's rate.
  absl::StatusOr<double> WarmUp() override;
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;
  // Sessions: every sequence's new tokens projected together (fp32, oneDNN's sgemm), rotated, written into their
  // caches, then the decode path or the gather path of paged_attention.h, and W_O for all of them at once.
  absl::Status SupportsPaged(const PagedProblem& problem) const override { return absl::OkStatus(); }
  int64_t PagedWorkspaceBytes(const PagedProblem& problem) const override;
  absl::Status PagedAttention(const PagedArgs& args) override;

 private:
  // MultiHeadAttention's head contributions (args.stats.contribution, when asked for) from its fp32 heads, after
  // the output is written.
  absl::Status Contributions(const MhaArgs& args, const float* heads, const StopSignal* stop);
  CpuBackend(std::vector<const kernels::TileKernels*> tile_kernels, const kernels::TileKernels* bf16_tiles, bool bf16,
             const kernels::PagedKernels* bf16_cache_decode)
      : tile_kernels_(std::move(tile_kernels)), bf16_tiles_(bf16_tiles), bf16_(bf16),
        bf16_cache_decode_(bf16_cache_decode) {}

  // The fp32 kernels a call with this head_dim runs on.
  const kernels::TileKernels& KernelsFor(int64_t head_dim) const;
  // The same, or the bf16 set when the attention operands are bf16 (from bf16 projections or the wire) and head_dim
  // suits it.
  const kernels::TileKernels& KernelsFor(int64_t head_dim, bool bf16_operands) const;
  // The decode kernels for a cache of `dtype` beside the fp32 set `tiles`.
  const kernels::PagedKernels& DecodeKernelsFor(const kernels::TileKernels& tiles, v1::DataType dtype) const;

  const std::vector<const kernels::TileKernels*> tile_kernels_;  // in order of preference; never empty
  const kernels::TileKernels* const bf16_tiles_;  // amx or avx512bf16, for bf16 calls; null when off or not here
  const bool bf16_;  // bf16 requests project in bf16
  // A bf16 set's decode kernels by cache dtype (tile_kernels.h's kPagedDtypes), which take bf16 and FP8 caches
  // (dot products on bf16 pairs: q and the weights rounded to bf16); null where no bf16 set runs or an fp32 set was
  // named, and those caches are widened to fp32.
  const kernels::PagedKernels* const bf16_cache_decode_;
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CPU_CPU_BACKEND_H_
