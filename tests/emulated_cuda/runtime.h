// A CUDA runtime and cuBLAS that run on the host, so that the whole CUDA backend (cuda_backend.cc, its launchers
// and its kernels, all compiled by g++ under MHA_CUDA_EMULATION) runs its tests on machines without a GPU.
//
// One emulated device whose memory is host memory, counted against a capacity the test may set; fresh allocations
// are filled with 0xff bytes (NaN in every float dtype), so that a read of memory nothing wrote shows. Streams keep
// their work (copies, kernels, cuBLAS products) in order and run it only when the host waits for it
// (cudaStreamSynchronize, cudaDeviceSynchronize, cudaFree, cudaStreamDestroy): host code that reads an output
// before waiting, or rewrites a pinned staging buffer before its copy ran, gets what it would get from a GPU that
// had not got there yet. Copies and products are checked against the bounds of the allocations they touch
// (cudaErrorInvalidValue, CUBLAS_STATUS_INVALID_VALUE). Managed memory (cudaMallocManaged) is host memory too, not
// counted against the capacity (a GPU oversubscribes it), device-accessible for copies, cuBLAS and kernels, and
// told apart by cudaPointerGetAttributes: Device for cudaMalloc's ranges, Managed for cudaMallocManaged's, Host for
// cudaMallocHost's, Unregistered for anything else. Work runs one item at a time, on whichever thread waits,
// under one lock (the kernels' emulation, tests/cuda_emulation.h, is single-threaded).
//
// What it cannot show: speed, overlap between streams, the hardware's rounding order, and what the real runtime
// and cuBLAS accept beyond the calls the backend makes (anything else returns an error here).
#ifndef MHA_TESTS_EMULATED_CUDA_RUNTIME_H_
#define MHA_TESTS_EMULATED_CUDA_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace mha {
namespace emulation {

// The device memory cudaMalloc hands out before it fails with cudaErrorMemoryAllocation, and the totalGlobalMem
// cudaGetDeviceProperties reports. 1 GiB unless set. Thread-safe.
void SetDeviceMemory(int64_t bytes);
// Bytes of device memory allocated and not freed.
int64_t DeviceMemoryInUse();

// Appends `work` to `stream` (null: the default stream). It runs when the host waits for the stream; an error it
// returns becomes the device's sticky error, which every later wait returns and which skips all later work.
void EnqueueWork(cudaStream_t stream, std::function<cudaError_t()> work);

// Whether [p, p + bytes) lies inside one live allocation a kernel may read: cudaMalloc's or cudaMallocManaged's.
bool IsDeviceRange(const void* p, int64_t bytes);
// Bytes of managed memory allocated and not freed (not part of DeviceMemoryInUse).
int64_t ManagedMemoryInUse();

}  // namespace emulation
}  // namespace mha

#endif  // MHA_TESTS_EMULATED_CUDA_RUNTIME_H_
