// The CUDA backend's launchers: the attention kernels of attention_kernels.cuh, and element-wise helpers (bias rows,
// dtype conversions). Under MHA_CUDA_EMULATION (tests/emulated_cuda) g++ compiles this file too, with Enqueue
// provided by the emulated runtime.
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

#ifndef MHA_CUDA_EMULATION
// kernel<<<grid, threads, 0, stream>>>(args...) and the launch's error: the one place this file launches from.
template <typename... Params, typename... Args>
cudaError_t Enqueue(void (*kernel)(Params...), dim3 grid, unsigned threads, cudaStream_t stream, Args... args) {
  kernel<<<grid, threads, 0, stream>>>(args...);
  return cudaGetLastError();
}
#endif

// Blocks for a grid-stride loop over n elements.
unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
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
