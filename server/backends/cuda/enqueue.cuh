// kernel<<<grid, threads, 0, stream>>>(args...) and the launch's error: the one way the CUDA backend's launchers
// (attention_kernels.cu, paged_kernels.cu) start a kernel. Under MHA_CUDA_EMULATION the emulated runtime supplies
// Enqueue instead (tests/emulated_cuda/enqueue.h), and this header adds nothing.
#ifndef MHA_SERVER_BACKENDS_CUDA_ENQUEUE_CUH_
#define MHA_SERVER_BACKENDS_CUDA_ENQUEUE_CUH_

#include <cuda_runtime.h>

namespace mha {
namespace cuda {

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
