// kernel<<<grid, threads, 0, stream>>>(args...) and the launch's error: the one way the CUDA backend's launchers
// (attention_kernels.cu, paged_kernels.cu) start a kernel, and the grid of their grid-stride kernels. Under
// MHA_CUDA_EMULATION the emulated runtime supplies Enqueue instead (tests/emulated_cuda/enqueue.h).
#ifndef MHA_SERVER_BACKENDS_CUDA_ENQUEUE_CUH_
#define MHA_SERVER_BACKENDS_CUDA_ENQUEUE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace mha {
namespace cuda {

// Blocks of 256 threads for a grid-stride loop over n elements (at most 4096).
inline unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

#ifndef MHA_CUDA_EMULATION
template <typename... Params, typename... Args>
cudaError_t Enqueue(void (*kernel)(Params...), dim3 grid, unsigned threads, cudaStream_t stream, Args... args) {
  kernel<<<grid, threads, 0, stream>>>(args...);
  return cudaGetLastError();
}
#endif

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_ENQUEUE_CUH_
