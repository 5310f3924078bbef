// Which backends this binary carries: the only file that names them (and the only #ifdef for CUDA). Compiled once
// per registry library (mha_backends; the tests' mha_backends_emulated_cuda, whose CUDA backend runs on the CPU), so
// that everything above the backends is compiled once for both.
#include "server/backends/registry.h"

#include "server/backends/cpu/cpu_backend.h"
#include "server/backends/reference/reference_backend.h"
#ifdef MHA_HAVE_CUDA
#include "server/backends/cuda/cuda_backend.h"
#endif

namespace mha {
namespace {

template <typename T>
absl::StatusOr<std::unique_ptr<Backend>> Upcast(absl::StatusOr<std::unique_ptr<T>> backend) {
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(*std::move(backend));
}

}  // namespace

std::vector<BackendFactory> BackendRegistry::Factories([[maybe_unused]] const BackendOptions& options) {
  std::vector<BackendFactory> factories;
  factories.push_back({std::string(kReferenceBackend), "",
                       [] { return absl::StatusOr<std::unique_ptr<Backend>>(std::make_unique<ReferenceBackend>()); }});
  factories.push_back({std::string(kCpuBackend), "", [] { return Upcast(CpuBackend::Create()); }});
  // The bf16 attention core on AVX512-BF16's dot products, which "auto" passes over where the CPU has AMX; then the
  // fp32 sets.
  for (const char* isa : {"avx512bf16", "avx512", "avx2", "portable"}) {
    factories.push_back({std::string(kCpuBackend), isa, [isa] { return Upcast(CpuBackend::Create(isa)); }});
  }
  // Every request in fp32: the path of CPUs without native bf16, tested on those with it too.
  factories.push_back({std::string(kCpuBackend), "fp32", [] { return Upcast(CpuBackend::Create("auto", false)); }});
#ifdef MHA_HAVE_CUDA
  CudaBackend::Options cuda;
  cuda.device = options.cuda_device;
  cuda.lanes = options.cuda_streams;
  cuda.allow_tf32 = options.cuda_allow_tf32;
  cuda.layer_cache_bytes = options.cuda_layer_cache_bytes;
  factories.push_back({std::string(kCudaBackend), "", [cuda] { return Upcast(CudaBackend::Create(cuda)); }});
#endif
  return factories;
}

bool BackendRegistry::CompiledIn(absl::string_view name) {
  for (const BackendFactory& factory : Factories()) {
    if (factory.name == name) return true;
  }
  return false;
}

std::unique_ptr<BackendRegistry> BackendRegistry::Create(const BackendOptions& options) {
  auto registry = std::make_unique<BackendRegistry>();
  for (const BackendFactory& factory : Factories(options)) {
    if (!factory.variant.empty()) continue;
    BackendEntry entry;
    entry.name = factory.name;
    entry.compiled_in = true;
    absl::StatusOr<std::unique_ptr<Backend>> backend = factory.create();
    if (backend.ok()) {
      entry.backend = *std::move(backend);
      entry.device = entry.backend->device();
    } else {
      entry.detail = std::string(backend.status().message());
    }
    registry->entries_.push_back(std::move(entry));
  }
  if (!CompiledIn(kCudaBackend)) {
    BackendEntry cuda;
    cuda.name = std::string(kCudaBackend);
    cuda.detail = "not compiled into this build";
    registry->entries_.push_back(std::move(cuda));
  }
  return registry;
}

}  // namespace mha
