#include "server/backends/cuda/cublas_api.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace mha {
namespace cuda {
namespace {

constexpr char kLibrary[] = "libcublas.so.13";

template <typename F>
absl::Status Resolve(void* library, const char* symbol, F* function) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    return absl::UnavailableError(absl::StrCat(kLibrary, " has no ", symbol, ": ", dlerror()));
  }
  *function = reinterpret_cast<F>(address);
  return absl::OkStatus();
}

absl::StatusOr<CublasApi> LoadOnce() {
  // Never closed: the process keeps cuBLAS until it exits.
  void* library = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot load ", kLibrary, " (the CUDA image carries it; elsewhere put the toolkit's lib/ on "
                     "the loader's path): ", dlerror()));
  }
  CublasApi api;
  for (absl::Status status : {Resolve(library, "cublasCreate_v2", &api.create),
                              Resolve(library, "cublasDestroy_v2", &api.destroy),
                              Resolve(library, "cublasSetStream_v2", &api.set_stream),
                              Resolve(library, "cublasSetMathMode", &api.set_math_mode),
                              Resolve(library, "cublasGetVersion_v2", &api.get_version),
                              Resolve(library, "cublasGemmEx", &api.gemm_ex)}) {
    if (!status.ok()) return status;
  }
  return api;
}

}  // namespace

absl::StatusOr<const CublasApi*> CublasApi::Load() {
  static const absl::StatusOr<CublasApi>* const api = new absl::StatusOr<CublasApi>(LoadOnce());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace cuda
}  // namespace mha
