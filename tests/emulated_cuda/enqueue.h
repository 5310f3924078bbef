// What kernel<<<grid, threads, 0, stream>>>(args...) does in the CUDA backend's launchers, for their sources compiled
// by g++ (attention_kernels.cc, paged_kernels.cc): each launch becomes work on its emulated stream that runs the
// kernel through tests/cuda_emulation.h when the host waits for the stream.
#ifndef MHA_TESTS_EMULATED_CUDA_ENQUEUE_H_
#define MHA_TESTS_EMULATED_CUDA_ENQUEUE_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "tests/cuda_emulation.h"
#include "tests/emulated_cuda/runtime.h"

namespace mha {
namespace cuda {

// What kernel<<<grid, threads, 0, stream>>>(args...) does in attention_kernels.cu: checks the configuration, then
// enqueues the kernel with copies of its arguments. A block that cannot finish (threads waiting at a barrier that
// never completes) is the device's sticky cudaErrorLaunchFailure, reported on stderr.
template <typename... Params, typename... Args>
cudaError_t Enqueue(void (*kernel)(Params...), dim3 grid, unsigned threads, cudaStream_t stream, Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 || threads == 0 ||
      threads > 1024) {
    return cudaErrorInvalidConfiguration;
  }
  const std::tuple<Params...> values(args...);
  emulation::EnqueueWork(stream, [kernel, grid, threads, values] {
    const std::string error = std::apply(
        [&](const Params&... a) { return emulation::Launch(kernel, grid, threads, a...); }, values);
    if (error.empty()) return cudaSuccess;
    std::fprintf(stderr, "emulated kernel launch failed: %s\n", error.c_str());
    return cudaErrorLaunchFailure;
  });
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace mha

#endif  // MHA_TESTS_EMULATED_CUDA_ENQUEUE_H_
