// The CUDA backend's launchers: the attention kernels of attention_kernels.cuh, RoPE, the heads' contributions to a
// layer's output, and element-wise helpers (bias rows, dtype conversions). Under MHA_CUDA_EMULATION
// (tests/emulated_cuda) g++ compiles this file too, with Enqueue provided by the emulated runtime.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "server/backends/cuda/attention_kernels.cuh"
#include "server/backends/cuda/enqueue.cuh"
#include "server/backends/cuda/kernels.h"

namespace mha {
namespace cuda {
namespace {

using device::FromFloat;
using device::ToFloat;

// ---------------------------------------------------------------------------------------------------------------
template <typename T>
__global__ void BroadcastRows(const float* bias, int64_t n, int64_t rows, T* y, int64_t ldy) {
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[(idx / n) * ldy + idx % n] = FromFloat<T>(bias[idx % n]);
  }
}

template <typename S, typename D>
__global__ void Convert(const S* src, D* dst, int64_t n) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[idx] = FromFloat<D>(ToFloat(src[idx]));
  }
}

// One element of `dtype` at x[index], as fp32.
__device__ __forceinline__ float LoadAsFloat(const void* x, int dtype, int64_t index) {
  switch (dtype) {
    case kF16:
      return ToFloat(static_cast<const __half*>(x)[index]);
    case kBF16:
      return ToFloat(static_cast<const __nv_bfloat16*>(x)[index]);
    default:
      return static_cast<const float*>(x)[index];
  }
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE (LaunchRope): one thread per rotated pair, grid-stride.
template <typename T>
__global__ void Rope(T* x, int64_t batch, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                     int64_t first_position, RopeTable table) {
  const int64_t half = table.rope_dim / 2;
  const int64_t total = batch * rows * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = idx % half, head = idx / half % heads, row = idx / (half * heads);  // row: b * rows + r
    const double angle = static_cast<double>(first_position + row % rows) * table.inv_freq[pair];
    const float cosine = static_cast<float>(cos(angle) * table.attention_factor);
    const float sine = static_cast<float>(sin(angle) * table.attention_factor);
    T* v = x + row * row_stride + head * head_dim;
    const int64_t a = table.interleaved ? 2 * pair : pair, b = table.interleaved ? 2 * pair + 1 : pair + half;
    const float x0 = ToFloat(v[a]), x1 = ToFloat(v[b]);
    v[a] = FromFloat<T>(x0 * cosine - x1 * sine);
    v[b] = FromFloat<T>(x1 * cosine + x0 * sine);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Head contributions (LaunchHeadContributions): a block per kContributionRows output rows, so that each W_O element
// read serves that many rows. For each head, thread t computes the head's term heads[r, h] W_O[h] at output columns
// t, t + kContributionThreads, ... and its squares; the block adds them up.
constexpr int kContributionRows = 8, kContributionThreads = 256;

// sums[r] over the block's threads, for every thread (shared: [kContributionThreads][kContributionRows]).
__device__ __forceinline__ void BlockSums(double (&sums)[kContributionRows],
                                          double (*shared)[kContributionRows]) {
  const int t = threadIdx.x;
  #pragma unroll
  for (int r = 0; r < kContributionRows; ++r) shared[t][r] = sums[r];
  __syncthreads();
  for (int stride = kContributionThreads / 2; stride > 0; stride >>= 1) {
    if (t < stride) {
      #pragma unroll
      for (int r = 0; r < kContributionRows; ++r) shared[t][r] += shared[t + stride][r];
    }
    __syncthreads();
  }
  #pragma unroll
  for (int r = 0; r < kContributionRows; ++r) sums[r] = shared[0][r];
  __syncthreads();  // shared is free again
}

template <typename TW>
__global__ void __launch_bounds__(kContributionThreads)
    HeadContributions(const void* heads, int heads_dtype, int64_t rows, int64_t num_heads, int64_t head_dim,
                      const TW* w_o, const void* out, int out_dtype, int64_t d_model, float* contribution) {
  __shared__ float x_shared[kContributionRows][kMaxHeadDim];
  __shared__ double sums_shared[kContributionThreads][kContributionRows];
  const int t = threadIdx.x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kContributionRows;
  const int valid = rows - row0 < kContributionRows ? static_cast<int>(rows - row0) : kContributionRows;
  const int d_k = static_cast<int>(head_dim);
  double out_norm[kContributionRows];
  #pragma unroll
  for (int r = 0; r < kContributionRows; ++r) out_norm[r] = 0.0;
  for (int64_t o = t; o < d_model; o += kContributionThreads) {
    #pragma unroll
    for (int r = 0; r < kContributionRows; ++r) {
      const double y = r < valid ? LoadAsFloat(out, out_dtype, (row0 + r) * d_model + o) : 0.0;
      out_norm[r] += y * y;
    }
  }
  BlockSums(out_norm, sums_shared);
  // Thread t < valid writes row t's values: its row's output norm, picked with constant indices (registers).
  double my_out_norm = 0.0;
  #pragma unroll
  for (int r = 0; r < kContributionRows; ++r) {
    if (r == t) my_out_norm = sqrt(out_norm[r]);
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int idx = t; idx < kContributionRows * d_k; idx += kContributionThreads) {
      const int r = idx / d_k, c = idx % d_k;
      x_shared[r][c] = r < valid ? LoadAsFloat(heads, heads_dtype, (row0 + r) * num_heads * d_k + h * d_k + c) : 0.0f;
    }
    __syncthreads();
    double squares[kContributionRows];
    #pragma unroll
    for (int r = 0; r < kContributionRows; ++r) squares[r] = 0.0;
    const TW* w = w_o + h * d_k * d_model;
    for (int64_t o = t; o < d_model; o += kContributionThreads) {
      float term[kContributionRows];
      #pragma unroll
      for (int r = 0; r < kContributionRows; ++r) term[r] = 0.0f;
      for (int c = 0; c < d_k; ++c) {
        const float weight = ToFloat(w[c * d_model + o]);
        #pragma unroll
        for (int r = 0; r < kContributionRows; ++r) term[r] = fmaf(x_shared[r][c], weight, term[r]);
      }
      #pragma unroll
      for (int r = 0; r < kContributionRows; ++r) squares[r] += static_cast<double>(term[r]) * term[r];
    }
    BlockSums(squares, sums_shared);  // its barriers also keep x_shared until every thread is done with it
    double my_squares = 0.0;
    #pragma unroll
    for (int r = 0; r < kContributionRows; ++r) {
      if (r == t) my_squares = squares[r];
    }
    if (t < valid) {
      contribution[(row0 + t) * num_heads + h] =
          my_out_norm > 0.0 ? static_cast<float>(sqrt(my_squares) / my_out_norm) : 0.0f;
    }
  }
}



template <typename S>
cudaError_t ConvertFrom(const S* src, void* dst, int dst_dtype, int64_t n, cudaStream_t stream) {
  switch (dst_dtype) {
    case kF32:
      return Enqueue(Convert<S, float>, GridFor(n), 256, stream, src, static_cast<float*>(dst), n);
    case kF16:
      return Enqueue(Convert<S, __half>, GridFor(n), 256, stream, src, static_cast<__half*>(dst), n);
    case kBF16:
      return Enqueue(Convert<S, __nv_bfloat16>, GridFor(n), 256, stream, src, static_cast<__nv_bfloat16*>(dst), n);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchAttention(const AttentionParams& p, const FlashPlan& plan, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0) return cudaSuccess;
  const device::AttentionLaunch launch = device::ChooseAttentionKernel(p, plan);
  if (launch.kernel == nullptr) return cudaErrorInvalidValue;
  return Enqueue(launch.kernel, launch.grid, launch.threads, stream, p);
}

cudaError_t LaunchAttentionWeights(const AttentionParams& p, void* weights, int weights_dtype, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0 || p.kv_len == 0) return cudaSuccess;
  const device::WeightsLaunch launch = device::ChooseWeightsKernel(p, weights_dtype);
  if (launch.kernel == nullptr) return cudaErrorInvalidValue;
  return Enqueue(launch.kernel, launch.grid, launch.threads, stream, p, weights);
}

cudaError_t LaunchRope(void* x, int dtype, int64_t batch, int64_t rows, int64_t row_stride, int64_t heads,
                       int64_t head_dim, int64_t first_position, const RopeTable& table, cudaStream_t stream) {
  const int64_t rope_dim = table.rope_dim;
  if (rope_dim > head_dim || rope_dim % 2 != 0 || rope_dim < 0 || rope_dim > 2 * kMaxRopePairs) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = batch * rows * heads * (rope_dim / 2);
  if (pairs == 0) return cudaSuccess;
  const unsigned grid = GridFor(pairs);
  switch (dtype) {
    case kF32:
      return Enqueue(Rope<float>, grid, 256, stream, static_cast<float*>(x), batch, rows, row_stride, heads, head_dim,
                     first_position, table);
    case kF16:
      return Enqueue(Rope<__half>, grid, 256, stream, static_cast<__half*>(x), batch, rows, row_stride, heads,
                     head_dim, first_position, table);
    case kBF16:
      return Enqueue(Rope<__nv_bfloat16>, grid, 256, stream, static_cast<__nv_bfloat16*>(x), batch, rows, row_stride,
                     heads, head_dim, first_position, table);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchHeadContributions(const void* heads, int heads_dtype, int64_t rows, int64_t num_heads,
                                    int64_t head_dim, const void* w_o, int w_dtype, const void* out, int out_dtype,
                                    int64_t d_model, float* contribution_rows_by_heads, cudaStream_t stream) {
  if (rows == 0 || num_heads == 0) return cudaSuccess;
  if (head_dim > kMaxHeadDim) return cudaErrorInvalidValue;
  const int64_t blocks = (rows + kContributionRows - 1) / kContributionRows;
  if (blocks > int64_t{0x7fffffff}) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (w_dtype) {
    case kF32:
      return Enqueue(HeadContributions<float>, grid, kContributionThreads, stream, heads, heads_dtype, rows,
                     num_heads, head_dim, static_cast<const float*>(w_o), out, out_dtype, d_model,
                     contribution_rows_by_heads);
    case kF16:
      return Enqueue(HeadContributions<__half>, grid, kContributionThreads, stream, heads, heads_dtype, rows,
                     num_heads, head_dim, static_cast<const __half*>(w_o), out, out_dtype, d_model,
                     contribution_rows_by_heads);
    case kBF16:
      return Enqueue(HeadContributions<__nv_bfloat16>, grid, kContributionThreads, stream, heads, heads_dtype, rows,
                     num_heads, head_dim, static_cast<const __nv_bfloat16*>(w_o), out, out_dtype, d_model,
                     contribution_rows_by_heads);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchBroadcastRows(const float* bias, int64_t n, int64_t rows, void* y, int64_t ldy, int dtype,
                                cudaStream_t stream) {
  if (rows * n == 0) return cudaSuccess;
  const unsigned grid = GridFor(rows * n);
  switch (dtype) {
    case kF32:
      return Enqueue(BroadcastRows<float>, grid, 256, stream, bias, n, rows, static_cast<float*>(y), ldy);
    case kF16:
      return Enqueue(BroadcastRows<__half>, grid, 256, stream, bias, n, rows, static_cast<__half*>(y), ldy);
    case kBF16:
      return Enqueue(BroadcastRows<__nv_bfloat16>, grid, 256, stream, bias, n, rows,
                     static_cast<__nv_bfloat16*>(y), ldy);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchConvert(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (src_dtype) {
    case kF32:
      return ConvertFrom(static_cast<const float*>(src), dst, dst_dtype, n, stream);
    case kF16:
      return ConvertFrom(static_cast<const __half*>(src), dst, dst_dtype, n, stream);
    case kBF16:
      return ConvertFrom(static_cast<const __nv_bfloat16*>(src), dst, dst_dtype, n, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace mha
