// The CUDA backend's session kernels (server/backends/cuda/paged_kernels.cu), compiled by g++ with the emulated
// launch of enqueue.h.
#include "tests/emulated_cuda/enqueue.h"

#include "server/backends/cuda/paged_kernels.cu"  // NOLINT(build/include): the kernels' source, as nvcc sees it
