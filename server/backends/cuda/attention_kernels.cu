// The CUDA backend's launchers: the attention kernels of attention_kernels.cuh, and element-wise helpers (bias rows,
// dtype conversions).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "server/backends/cuda/attention_kernels.cuh"
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

// Blocks for a grid-stride loop over n elements.
unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

template <typename S>
cudaError_t ConvertFrom(const S* src, void* dst, int dst_dtype, int64_t n, cudaStream_t stream) {
  switch (dst_dtype) {
    case kF32:
      Convert<<<GridFor(n), 256, 0, stream>>>(src, static_cast<float*>(dst), n);
      break;
    case kF16:
      Convert<<<GridFor(n), 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
      break;
    case kBF16:
      Convert<<<GridFor(n), 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAttention(const AttentionParams& p, const FlashPlan& plan, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0) return cudaSuccess;
  const device::AttentionLaunch launch = device::ChooseAttentionKernel(p, plan);
  if (launch.kernel == nullptr) return cudaErrorInvalidValue;
  launch.kernel<<<launch.grid, launch.threads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchAttentionWeights(const AttentionParams& p, void* weights, int weights_dtype, cudaStream_t stream) {
  if (p.batch == 0 || p.q_len == 0 || p.kv_len == 0) return cudaSuccess;
  const device::WeightsLaunch launch = device::ChooseWeightsKernel(p, weights_dtype);
  if (launch.kernel == nullptr) return cudaErrorInvalidValue;
  launch.kernel<<<launch.grid, launch.threads, 0, stream>>>(p, weights);
  return cudaGetLastError();
}

cudaError_t LaunchBroadcastRows(const float* bias, int64_t n, int64_t rows, void* y, int64_t ldy, int dtype,
                                cudaStream_t stream) {
  if (rows * n == 0) return cudaSuccess;
  const unsigned grid = GridFor(rows * n);
  switch (dtype) {
    case kF32:
      BroadcastRows<<<grid, 256, 0, stream>>>(bias, n, rows, static_cast<float*>(y), ldy);
      break;
    case kF16:
      BroadcastRows<<<grid, 256, 0, stream>>>(bias, n, rows, static_cast<__half*>(y), ldy);
      break;
    case kBF16:
      BroadcastRows<<<grid, 256, 0, stream>>>(bias, n, rows, static_cast<__nv_bfloat16*>(y), ldy);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
