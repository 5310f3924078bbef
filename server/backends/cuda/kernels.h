// Launchers of the CUDA backend's kernels (attention_kernels.cu). Every pointer is device memory; every launcher
// enqueues on `stream` and returns the launch's error (cudaGetLastError), which the caller converts to a Status.
// Not thread-safe per stream: one caller per stream at a time.
#ifndef MHA_SERVER_BACKENDS_CUDA_KERNELS_H_
#define MHA_SERVER_BACKENDS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "server/backends/cuda/flash_plan.h"

namespace mha {
namespace cuda {

// Element types on the device, numbered as the wire's v1::DataType (FP32 = 1, FP16 = 2, BF16 = 3), so that the
// kernels need no protobuf header.
enum DeviceDType : int { kF32 = 1, kF16 = 2, kBF16 = 3 };

// One attention call on head-packed rows. Token t of batch item b starts at (b * T + t) * row_stride elements;
// head h's d_k values follow at h * head_dim (kv head for k and v). Rows may be wider than the heads (the fused
// Q|K|V projection output).
struct AttentionParams {
  const void* q = nullptr;  // [B, Tq, .. H d_k ..] in `dtype`
  const void* k = nullptr;  // [B, Tk, .. Hkv d_k ..] in `dtype`
  const void* v = nullptr;
  int64_t q_row_stride = 0, kv_row_stride = 0;
  int dtype = kF32;
  void* out = nullptr;          // [B, Tq, H, d_k] contiguous, in out_dtype (dtype or kF32)
  int out_dtype = kF32;
  // [B, H, Tq, 2]: each row's max score and sum of exp(score - max), natural units (-inf and 0 for a row with no
  // visible key), or null.
  float* row_stats = nullptr;
  const int32_t* key_lengths = nullptr;  // [B] or null
  const float* additive = nullptr;       // [Tq, Tk] or [B, Tq, Tk] (additive_per_batch), or null
  bool additive_per_batch = false;
  const float* head_mask = nullptr;      // [H] factors on each head's output, or null
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = false;
  float scale = 1.0f;
};

// softmax(q k^T scale + mask) v for every (batch, head, query row), as `plan` (PlanFlash) says; writes
// p.row_stats when set. A row with no visible key gets zeros.
cudaError_t LaunchAttention(const AttentionParams& p, const FlashPlan& plan, cudaStream_t stream);

// The attention weights [B, H, Tq, Tk] in weights_dtype, from the row statistics a LaunchAttention with
// p.row_stats set wrote: the second pass of the weights-requested path.
cudaError_t LaunchAttentionWeights(const AttentionParams& p, void* weights, int weights_dtype, cudaStream_t stream);

// rows x n of y (row stride ldy elements, `dtype`) = bias[n] (fp32) on every row.
cudaError_t LaunchBroadcastRows(const float* bias, int64_t n, int64_t rows, void* y, int64_t ldy, int dtype,
                                cudaStream_t stream);

// n elements from src_dtype to dst_dtype (round to nearest even).
cudaError_t LaunchConvert(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_KERNELS_H_
