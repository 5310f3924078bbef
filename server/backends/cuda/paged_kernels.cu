// The sessions' launchers (paged_kernels.h) around the device code of paged_kernels.cuh. Under MHA_CUDA_EMULATION
// (tests/emulated_cuda) g++ compiles this file too, with the emulated runtime's Enqueue.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "server/backends/cuda/enqueue.cuh"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_cascade.cuh"
#include "server/backends/cuda/paged_kernels.cuh"
#include "server/backends/cuda/paged_kernels.h"

namespace mha {
namespace cuda {
namespace {

constexpr int64_t kMaxGridX = 0x7fffffff;

// The cascade kernel for p's cache dtype, head_dim and statistics (paged_cascade.cuh), or null.
void (*CascadeKernelOf(const PagedParams& p))(PagedParams) {
  const bool stats = p.lse != nullptr || p.entropy != nullptr;
  switch (p.cache_dtype) {
    case kF16:
      return device::CascadeKernelFor<__half, __half>(p.head_dim, stats);
    case kBF16:
      return device::CascadeKernelFor<__nv_bfloat16, __nv_bfloat16>(p.head_dim, stats);
    case kI8:
      return device::CascadeKernelFor<device::Code8<kI8>, __nv_bfloat16>(p.head_dim, stats);
    case kE4M3:
      return device::CascadeKernelFor<device::Code8<kE4M3>, __nv_bfloat16>(p.head_dim, stats);
    case kE5M2:
      return device::CascadeKernelFor<device::Code8<kE5M2>, __nv_bfloat16>(p.head_dim, stats);
    default:
      return nullptr;
  }
}

// The shared units of the cascade kernel, when the plan has them.
cudaError_t LaunchCascade(const PagedParams& p, cudaStream_t stream) {
  if (p.num_mma_units == 0) return cudaSuccess;
  void (*cascade)(PagedParams) = CascadeKernelOf(p);
  if (cascade == nullptr || p.cascade == nullptr || p.num_mma_units > kMaxGridX || p.shared_splits < 1 ||
      p.shared_splits > kMaxGridYZ || p.shared_split_keys % kCascadeTileKeys != 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(p.num_mma_units), static_cast<unsigned>(p.shared_splits));
  return Enqueue(cascade, grid, device::kCascadeThreads, stream, p);
}

}  // namespace

cudaError_t LaunchPagedAppend(const PagedParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.kv_heads == 0) return cudaSuccess;
  if (p.rows > kMaxGridX || p.kv_heads > kMaxGridYZ) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.kv_heads));
  const dim3 sequences_grid(static_cast<unsigned>(p.num_sequences), static_cast<unsigned>(p.kv_heads));
  const bool code8 = p.cache_dtype == kI8 || p.cache_dtype == kE4M3 || p.cache_dtype == kE5M2;
  if (code8 && (p.key_part_bytes <= 0 || p.head_part_bytes <= p.key_part_bytes)) return cudaErrorInvalidValue;
  switch (p.cache_dtype) {
    case kF32:
      return Enqueue(device::PagedAppendKernel<float>, grid, device::kPagedThreads, stream, p);
    case kF16:
      return Enqueue(device::PagedAppendKernel<__half>, grid, device::kPagedThreads, stream, p);
    case kBF16:
      return Enqueue(device::PagedAppendKernel<__nv_bfloat16>, grid, device::kPagedThreads, stream, p);
    case kI8:
      return Enqueue(device::PagedQuantAppendKernel<kI8>, sequences_grid, device::kPagedThreads, stream, p);
    case kE4M3:
      return Enqueue(device::PagedQuantAppendKernel<kE4M3>, sequences_grid, device::kPagedThreads, stream, p);
    case kE5M2:
      return Enqueue(device::PagedQuantAppendKernel<kE5M2>, sequences_grid, device::kPagedThreads, stream, p);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchPagedAttention(const PagedParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.num_units > kMaxGridX || p.num_mma_units < 0 || p.num_mma_units > p.num_units || p.splits < 1 ||
      p.splits > kMaxGridYZ || p.split_keys % kPagedTileKeys != 0) {
    return cudaErrorInvalidValue;
  }
  void (*split)(PagedParams) = nullptr;
  switch (p.cache_dtype) {
    case kF32:
      split = device::SplitKernelFor<float>(p.head_dim);
      break;
    case kF16:
      split = device::SplitKernelFor<__half>(p.head_dim);
      break;
    case kBF16:
      split = device::SplitKernelFor<__nv_bfloat16>(p.head_dim);
      break;
    case kI8:
      split = device::SplitKernelFor<device::Code8<kI8>>(p.head_dim);
      break;
    case kE4M3:
      split = device::SplitKernelFor<device::Code8<kE4M3>>(p.head_dim);
      break;
    case kE5M2:
      split = device::SplitKernelFor<device::Code8<kE5M2>>(p.head_dim);
      break;
    default:
      break;
  }
  if (split == nullptr) return cudaErrorInvalidValue;
  const int64_t split_units = p.num_units - p.num_mma_units;
  const dim3 grid(static_cast<unsigned>(split_units), static_cast<unsigned>(p.splits));
  if (split_units > 0) {  // none when every sequence is dense
    if (const cudaError_t error = Enqueue(split, grid, device::kPagedThreads, stream, p); error != cudaSuccess) {
      return error;
    }
  }
  if (const cudaError_t error = LaunchCascade(p, stream); error != cudaSuccess) return error;
  const int64_t merge_blocks = (p.rows * p.heads + device::kPagedWarps - 1) / device::kPagedWarps;
  if (merge_blocks > kMaxGridX) return cudaErrorInvalidValue;
  return Enqueue(device::PagedMergeKernel, dim3(static_cast<unsigned>(merge_blocks)), device::kPagedThreads, stream,
                 p);
}

namespace {

// The dense inputs in T (the attention's dtype) from a cache of CacheT.
template <typename CacheT, typename T>
cudaError_t DenseInputs(const PagedParams& p, int64_t seq, int64_t new_tokens, int64_t keys, void* q, void* k,
                        void* v, cudaStream_t stream) {
  const cudaError_t error = Enqueue(device::PagedDenseQueryKernel<T>, GridFor(new_tokens * p.heads * p.head_dim), 256,
                                    stream, p, seq, static_cast<T*>(q));
  if (error != cudaSuccess) return error;
  return Enqueue(device::PagedDenseGatherKernel<CacheT, T>, GridFor(keys * p.kv_heads * p.head_dim), 256, stream, p,
                 seq, keys, static_cast<T*>(k), static_cast<T*>(v));
}

}  // namespace

int PagedDenseDtype(int cache_dtype) { return cache_dtype == kF16 ? kF16 : kBF16; }

cudaError_t LaunchPagedDenseInputs(const PagedParams& p, int64_t seq, int64_t new_tokens, int64_t keys, void* q,
                                   void* k, void* v, cudaStream_t stream) {
  if (seq < 0 || seq >= p.num_sequences || new_tokens <= 0 || keys <= 0) return cudaErrorInvalidValue;
  switch (p.cache_dtype) {
    case kF16:
      return DenseInputs<__half, __half>(p, seq, new_tokens, keys, q, k, v, stream);
    case kBF16:
      return DenseInputs<__nv_bfloat16, __nv_bfloat16>(p, seq, new_tokens, keys, q, k, v, stream);
    case kI8:
      return DenseInputs<device::Code8<kI8>, __nv_bfloat16>(p, seq, new_tokens, keys, q, k, v, stream);
    case kE4M3:
      return DenseInputs<device::Code8<kE4M3>, __nv_bfloat16>(p, seq, new_tokens, keys, q, k, v, stream);
    case kE5M2:
      return DenseInputs<device::Code8<kE5M2>, __nv_bfloat16>(p, seq, new_tokens, keys, q, k, v, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace mha
