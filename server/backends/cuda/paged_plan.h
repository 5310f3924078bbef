// How the CUDA backend cuts a paged call (sessions) into work units and key splits, decided on the host and
// testable without a GPU (tests/cuda_backend_test.cc). paged_kernels.h says what a unit and a split are.
#ifndef MHA_SERVER_BACKENDS_CUDA_PAGED_PLAN_H_
#define MHA_SERVER_BACKENDS_CUDA_PAGED_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/backends/cuda/paged_kernels.h"

namespace mha {
namespace cuda {

// Below this many keys per split, splitting costs more in merging than it gains in parallelism.
inline constexpr int64_t kMinSplitKeys = 256;
// Blocks of the split kernel the planner aims for per streaming multiprocessor: a decode step is bound by memory
// bandwidth, and each resident block has one tile (8 KiB in bf16 at head_dim 128) in flight, so about 8 of them
// (the kernel's registers allow 7 at head_dim 128) keep enough bytes in flight to cover HBM's latency.
inline constexpr int kBlocksPerMultiprocessor = 8;
// New tokens from which a sequence's chunk takes the dense path: 4 query tiles of the tensor-core kernel's 16 rows.
inline constexpr int64_t kDenseMinTokens = 64;
// Keys per split of the cascade kernel at least: each of its blocks rotates and rounds its 64 query rows before
// reading a key, which 16 tiles of 64 keys amortise.
inline constexpr int64_t kMinCascadeSplitKeys = 1024;

struct PagedPlan {
  std::vector<PagedUnit> units;
  std::vector<int32_t> cascade;      // the shared units' members (PagedParams::cascade); empty: no shared units
  int64_t mma_units = 0;             // the last mma_units of `units`: shared units of the cascade kernel
  std::vector<int64_t> shared_keys;  // per sequence: PagedSequenceDesc::shared_keys
  std::vector<bool> dense;           // per sequence: PagedSequenceDesc::dense
  int64_t dense_scratch_bytes = 0;   // the largest dense sequence's q, k and v (LaunchPagedDenseInputs)
  int splits = 1;
  int64_t split_keys = kPagedTileKeys;  // a multiple of kPagedTileKeys
  int shared_splits = 0;                // PagedParams' shared_splits and shared_split_keys (0 without shared units)
  int64_t shared_split_keys = 0;
  int64_t rows = 0;                     // new tokens over all sequences
  int64_t weights_elements = 0;         // sum of H n keys over the sequences, when weights are asked for
};

// Units: for every sequence and KV head, its group's query heads times as many new tokens as fit
// PagedRowsPerUnit (a group larger than that is cut by heads, one token per unit). Splits: enough for about
// kBlocksPerMultiprocessor blocks per streaming multiprocessor (`multiprocessors`), at least kMinSplitKeys keys each.
// Dense sequences (TakesDensePath) get no units: the tensor-core flash kernel computes them over their gathered K
// and V, one after another in one scratch.
// Cascade groups: sequences decoding one token each whose caches start with the same full blocks (forks, sessions
// that attached one prompt's blocks by prefix key), at least two, when a unit holds the rows of two or more of them:
// shared units read those blocks once per kCascadeRows / group members on the cascade kernel (CascadeOnTensorCores),
// else once per PagedRowsPerUnit / group on the split kernel (GQA group <= PagedRowsPerUnit / 2). The cascade
// kernel's splits of the shared keys are its own: enough for about kBlocksPerMultiprocessor blocks per
// multiprocessor, at least kMinCascadeSplitKeys keys each.
PagedPlan PlanPaged(const PagedProblem& problem, absl::Span<const PagedSequence> sequences, int multiprocessors);

// Whether the call's shared units run on the cascade kernel (tensor cores, kCascadeRows stacked rows): a 16-bit or
// 8-bit cache (an 8-bit one's codes times their scales rounded to bf16, as the dense path rounds them), head_dim 64 or
// 128, a GQA group of at most kCascadeRows / 2, no weights asked for (the split kernel's shared units write those).
bool CascadeOnTensorCores(const PagedProblem& problem);

// Whether `seq`'s chunk takes the dense path: kDenseMinTokens or more new tokens over at least one visible key, a
// 16-bit or 8-bit cache (the tensor cores take 16-bit operands: an fp32 cache stays on the split kernel), a head_dim
// the tensor-core kernel computes (64, 128), and no weights asked for (statistics are computed there too).
bool TakesDensePath(const PagedProblem& problem, const PagedSequence& seq);

// Scratch the kernels need beyond inputs and outputs for `plan`: the splits' partial outputs and states.
int64_t PagedScratchBytes(const PagedProblem& problem, const PagedPlan& plan);

// Scratch slots per (row, head) of `plan`: its splits, and its shared splits with shared units.
inline int64_t PagedSlotsOf(const PagedPlan& plan) {
  return plan.cascade.empty() ? plan.splits : plan.splits + plan.shared_splits;
}

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_PAGED_PLAN_H_
