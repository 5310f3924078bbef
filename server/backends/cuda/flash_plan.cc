#include "server/backends/cuda/flash_plan.h"

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace cuda {

absl::StatusOr<FlashPlan> PlanFlash(const AttentionShape& s, v1::DataType dtype) {
  const HeadSpec& h = s.heads;
  if (h.head_dim > kMaxHeadDim) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA kernels compute head_dim up to ", kMaxHeadDim, ", got ", h.head_dim));
  }
  FlashPlan plan;
  plan.grid_x = s.batch * h.num_heads;
  const bool tensor_cores =
      (dtype == v1::FP16 || dtype == v1::BF16) && (h.head_dim == 64 || h.head_dim == 128);
  if (tensor_cores) {
    plan.kernel = FlashKernel::kTensorCore;
    plan.block_n = kTcBlockN;
    plan = TensorCoreVariant(plan, s.q_len, kTcBlockM, true);
    // One K tile and one V tile in 16-bit (the Q tile passes through their room on its way to registers), each
    // row padded by 8 elements (16 bytes) so that the fragment loads of a warp's 8 row groups fall on different
    // banks.
    const int64_t row = (h.head_dim + 8) * 2;
    plan.smem_bytes = 2 * kTcBlockN * row;
  } else {
    plan.kernel = FlashKernel::kSimt;
    plan.block_m = kSimtWarps;
    plan.block_n = 32;
    plan.threads = kSimtThreads;
    // Each warp's query row in fp32, padded to the kernel's register chunks of 32.
    plan.smem_bytes = kSimtWarps * ((h.head_dim + 31) / 32 * 32) * 4;
    plan.grid_y = (s.q_len + plan.block_m - 1) / plan.block_m;
  }
  if (plan.grid_y > kMaxGridYZ) {
    return absl::UnimplementedError(absl::StrCat("the CUDA kernels run up to ", kMaxGridYZ * plan.block_m,
                                                 " query rows at this head_dim and dtype, got ", s.q_len));
  }
  if (plan.grid_x > int64_t{0x7fffffff}) {
    return absl::UnimplementedError(absl::StrCat("batch * num_heads above 2^31 - 1: ", plan.grid_x));
  }
  return plan;
}

FlashPlan TensorCoreVariant(FlashPlan plan, int64_t q_len, int block_m, bool async_copies) {
  plan.block_m = block_m;
  plan.threads = 2 * block_m;  // a warp per 16 rows
  plan.grid_y = (q_len + block_m - 1) / block_m;
  plan.async_copies = async_copies;
  return plan;
}

absl::Status CudaSupports(const AttentionProblem& problem) {
  if (problem.mixed_inputs) {
    return absl::UnimplementedError(
        "the CUDA backend computes query, key and value of one dtype; this call mixes them");
  }
  // The kernel runs on the dtype of q/k/v on the device: the wire's.
  absl::StatusOr<FlashPlan> plan = PlanFlash(problem.shape, problem.input_dtype);
  return plan.ok() ? absl::OkStatus() : plan.status();
}

int64_t CudaWorkspaceBytes(const AttentionProblem& problem) {
  const AttentionShape& s = problem.shape;
  const HeadSpec& h = s.heads;
  const int64_t compute = DTypeSize(problem.input_dtype);
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  int64_t bytes = 0;
  if (s.has_projections()) {
    bytes += (q_rows * 2 * h.q_width() + 2 * kv_rows * h.kv_width()) * compute;  // Q, K, V, concatenated heads
    bytes += q_rows * s.d_model * 4;                                              // fp32 output before conversion
  } else {
    bytes += q_rows * h.q_width() * 4;  // fp32 output before conversion
  }
  if (problem.return_weights) bytes += s.batch * h.num_heads * s.q_len * 8;  // row max and sum
  // lse, entropy, confidence, distance, sink and contribution ([rows, H] before it is rearranged), fp32.
  if (problem.return_stats) bytes += 6 * s.batch * h.num_heads * s.q_len * 4;
  return bytes;
}

}  // namespace cuda
}  // namespace mha
