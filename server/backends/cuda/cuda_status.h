// CUDA runtime and cuBLAS errors as absl::Status: the backend's boundary, where no third-party error passes.
#ifndef MHA_SERVER_BACKENDS_CUDA_CUDA_STATUS_H_
#define MHA_SERVER_BACKENDS_CUDA_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mha {
namespace cuda {

// OK for cudaSuccess. Otherwise "<what>: <error name>: <the runtime's message>" with the code: RESOURCE_EXHAUSTED
// when device memory ran out, UNAVAILABLE when there is no usable device or driver (no GPU, a driver older than
// the runtime, no kernel image for this GPU), INTERNAL for anything else (a failed launch, a fault).
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// Why there is no usable device, given cudaGetDeviceCount's error: "no NVIDIA driver found (libcuda.so.1 not
// loaded)" where the driver's library cannot be loaded at all (the runtime would say "CUDA driver version is
// insufficient for CUDA runtime version", which reads as "upgrade your driver"), and the runtime's own words where a
// driver is present.
std::string NoDeviceReason(cudaError_t error);

// The same for cuBLAS: RESOURCE_EXHAUSTED for CUBLAS_STATUS_ALLOC_FAILED, UNIMPLEMENTED for
// CUBLAS_STATUS_NOT_SUPPORTED, INTERNAL otherwise; the message names the status.
absl::Status CublasStatus(cublasStatus_t status, absl::string_view what);

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_CUDA_STATUS_H_
