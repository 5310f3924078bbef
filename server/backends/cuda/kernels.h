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

// Element types on the device, numbered as the wire's v1::DataType (FP32 = 1, FP16 = 2, BF16 = 3; the 8-bit cache
// dtypes INT8 = 4, FP8_E4M3 = 5, FP8_E5M2 = 6, for sessions' caches only), so that the kernels need no protobuf header.
enum DeviceDType : int { kF32 = 1, kF16 = 2, kBF16 = 3, kI8 = 4, kE4M3 = 5, kE5M2 = 6 };

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
  // The softmax statistics of backend.h's RowStats (not contribution), fp32 [B, H, Tq] each, or null: lse, entropy,
  // confidence (max p), distance (sum p |pos - j|, pos = i + Tk - Tq) and sink (the p of keys j < sink_tokens). A
  // row with no visible key gets lse -inf and zeros; a NaN row NaN everywhere. Both kernels compute them (the
  // tensor-core kernel in its asynchronous-copy variants, which PlanFlash plans).
  float* lse = nullptr;
  float* entropy = nullptr;
  float* confidence = nullptr;
  float* distance = nullptr;
  float* sink = nullptr;
  int64_t sink_tokens = 0;

  bool wants_stats() const {
    return lse != nullptr || entropy != nullptr || confidence != nullptr || distance != nullptr || sink != nullptr;
  }
};

// softmax(q k^T scale + mask) v for every (batch, head, query row), as `plan` (PlanFlash) says; writes
// p.row_stats when set, and the softmax statistics p asks for (cudaErrorInvalidValue with a tensor-core plan of
// plain copies). A row with no visible key gets zeros.
cudaError_t LaunchAttention(const AttentionParams& p, const FlashPlan& plan, cudaStream_t stream);

// The attention weights [B, H, Tq, Tk] in weights_dtype, from the row statistics a LaunchAttention with
// p.row_stats set wrote: the second pass of the weights-requested path.
cudaError_t LaunchAttentionWeights(const AttentionParams& p, void* weights, int weights_dtype, cudaStream_t stream);

// The rotary frequencies of one call, passed by value to the kernel (rope_frequencies.h computes them on the host:
// one definition of every rope_type for all backends). Pair i < rope_dim / 2 turns by position * inv_freq[i]; cos
// and sin are multiplied by attention_factor.
inline constexpr int kMaxRopePairs = kMaxHeadDim / 2;
struct RopeTable {
  double inv_freq[kMaxRopePairs] = {};
  double attention_factor = 1.0;
  int64_t rope_dim = 0;  // even, at most 2 * kMaxRopePairs
  bool interleaved = false;
};

// RoPE in place on head-packed rows of `dtype`: `batch` items of `rows` rows each, row r of item b at
// (b * rows + r) * row_stride elements, `heads` heads of head_dim values from the row's start, at position
// first_position + r. Pair i < rope_dim / 2 of each head, (i, i + rope_dim / 2) or (2i, 2i + 1) when interleaved,
// turns by position * inv_freq[i]: the angle in double (fp32 is off by 1e-3 rad at position 8192), the rotation in
// fp32 (cos and sin times the attention factor), rounded back to `dtype`.
cudaError_t LaunchRope(void* x, int dtype, int64_t batch, int64_t rows, int64_t row_stride, int64_t heads,
                       int64_t head_dim, int64_t first_position, const RopeTable& table, cudaStream_t stream);

// Each head's share of a layer's output rows (backend.h's RowStats contribution): contribution_rows_by_heads[r, h]
// = ||heads[r, h] W_O[h]|| / ||out[r]|| (0 for a zero output row), [rows, num_heads] row-major fp32 (the caller
// rearranges). heads: [rows, num_heads * head_dim] (after any head mask) in heads_dtype; w_o: [num_heads * head_dim,
// d_model] row-major in w_dtype; out: the layer's output [rows, d_model] (bias included) in out_dtype. fp32
// products, sums of squares in double.
cudaError_t LaunchHeadContributions(const void* heads, int heads_dtype, int64_t rows, int64_t num_heads,
                                    int64_t head_dim, const void* w_o, int w_dtype, const void* out, int out_dtype,
                                    int64_t d_model, float* contribution_rows_by_heads, cudaStream_t stream);

// rows x n of y (row stride ldy elements, `dtype`) = bias[n] (fp32) on every row.
cudaError_t LaunchBroadcastRows(const float* bias, int64_t n, int64_t rows, void* y, int64_t ldy, int dtype,
                                cudaStream_t stream);

// n elements from src_dtype to dst_dtype (round to nearest even).
cudaError_t LaunchConvert(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_KERNELS_H_
