// The session store's KV-cache arena on the CUDA backend (CudaBackend::AllocateCacheArena): managed memory that
// prefers the backend's device, so that the paged kernels read blocks in place from HBM while the store still
// writes and copies blocks from the host.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/cuda/cuda_backend_impl.h"
#include "server/backends/cuda/cuda_status.h"

namespace mha {
namespace {

// Owns one cudaMallocManaged allocation; cudaFree on destruction (which waits for the device: no kernel still
// reads it).
class ManagedCacheArena final : public CacheArena {
 public:
  ManagedCacheArena(char* base, int64_t bytes, std::string description)
      : base_(base), bytes_(bytes), description_(std::move(description)) {}
  ~ManagedCacheArena() override { cudaFree(base_); }
  ManagedCacheArena(const ManagedCacheArena&) = delete;
  ManagedCacheArena& operator=(const ManagedCacheArena&) = delete;

  char* base() const override { return base_; }
  int64_t bytes() const override { return bytes_; }
  std::string describe() const override { return description_; }

 private:
  char* const base_;
  const int64_t bytes_;
  const std::string description_;
};

// The runtime's error as a Status, with the error cleared: a failed allocation or advice is not sticky.
absl::Status Failed(cudaError_t error, absl::string_view what) {
  cudaGetLastError();
  return cuda::CudaStatus(error, what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CacheArena>> CudaBackend::AllocateCacheArena(int64_t bytes) {
  if (bytes < 1) return absl::InvalidArgumentError(absl::StrCat("a cache arena of ", bytes, " bytes"));
  const int device = impl_->device();
  if (const cudaError_t error = cudaSetDevice(device); error != cudaSuccess) {
    return Failed(error, absl::StrCat("selecting CUDA device ", device));
  }
  // The store writes blocks from the host (a fork's copy) while kernels of other calls run: that needs a device
  // that lets the host touch managed memory concurrently (Linux on Pascal and later; not Windows, WSL or Jetson).
  int concurrent = 0;
  if (const cudaError_t error = cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, device);
      error != cudaSuccess) {
    return Failed(error, "asking for concurrent managed access");
  }
  if (concurrent == 0) {
    return absl::UnimplementedError(absl::StrCat("CUDA device ", device, " (", impl_->props().name,
                                                 ") lets the host touch managed memory only while no kernel runs"));
  }
  void* base = nullptr;
  if (const cudaError_t error = cudaMallocManaged(&base, static_cast<size_t>(bytes), cudaMemAttachGlobal);
      error != cudaSuccess) {
    return Failed(error, absl::StrCat("allocating ", bytes, " bytes of managed memory"));
  }
  // Pages live on the device once touched, and move to the host only when the host needs them.
  cudaMemLocation location = {};
  location.type = cudaMemLocationTypeDevice;
  location.id = device;
  if (const cudaError_t error = cudaMemAdvise(base, static_cast<size_t>(bytes), cudaMemAdviseSetPreferredLocation,
                                              location);
      error != cudaSuccess) {
    cudaFree(base);
    return Failed(error, absl::StrCat("advising managed memory to prefer CUDA device ", device));
  }
  return std::make_unique<ManagedCacheArena>(
      static_cast<char*>(base), bytes,
      absl::StrCat("CUDA managed memory on ", impl_->props().name, " (device ", device, ")"));
}

}  // namespace mha
