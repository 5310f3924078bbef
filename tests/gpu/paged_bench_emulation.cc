// The runtime entry points paged_bench calls beyond those the CUDA backend calls, for paged_bench_emulated: the
// bench on tests/emulated_cuda's runtime (device memory is host memory; a stream's work runs when the host waits).
// Events take the host's clock when their stream's work reaches them, so the times are the emulation's and mean
// nothing; what the run checks is the bench's host side and its parameters against the kernels. Weak definitions:
// the emulated runtime's own win, should it gain these.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>

#include "tests/emulated_cuda/runtime.h"

struct CUevent_st {
  std::chrono::steady_clock::time_point at;
};

extern "C" {

__attribute__((weak)) cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  mha::emulation::EnqueueWork(stream, [event] {
    event->at = std::chrono::steady_clock::now();
    return cudaSuccess;
  });
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaDeviceSynchronize(); }

__attribute__((weak)) cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  cudaDeviceProp props;
  if (const cudaError_t e = cudaGetDeviceProperties(&props, 0); e != cudaSuccess) return e;
  *total_bytes = props.totalGlobalMem;
  *free_bytes = props.totalGlobalMem - static_cast<size_t>(mha::emulation::DeviceMemoryInUse());
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (!mha::emulation::IsDeviceRange(p, static_cast<int64_t>(bytes))) return cudaErrorInvalidValue;
  mha::emulation::EnqueueWork(stream, [p, value, bytes] {
    std::memset(p, value, bytes);
    return cudaSuccess;
  });
  return cudaSuccess;
}

__attribute__((weak)) cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr); e != cudaSuccess) return e;
  return cudaStreamSynchronize(nullptr);
}

}  // extern "C"
