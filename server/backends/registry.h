// Which backends were compiled into this binary (compiled_backends.cc, the only file that names them) and which
// work on this machine.
#ifndef MHA_SERVER_BACKENDS_REGISTRY_H_
#define MHA_SERVER_BACKENDS_REGISTRY_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"

namespace mha {

// One way to build a backend: every backend's default, and each variant a test should cover (e.g. every tile
// kernel set of the CPU backend).
struct BackendFactory {
  std::string name;     // a k*Backend constant
  std::string variant;  // empty for the backend as the server runs it
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> create;

  std::string label() const { return variant.empty() ? name : name + "/" + variant; }
};

// How the server configures its backends (its --cuda_* flags); the defaults are what tests and tools get.
struct BackendOptions {
  // The CUDA backend's, ignored where it is not compiled in (CudaBackend::Options): device ordinal; calls computed
  // side by side, each with its own stream, cuBLAS handle and buffers; TF32 tensor cores for fp32 projections;
  // device memory for stored layers kept resident, 0 meaning a quarter of the device's.
  int cuda_device = 0;
  int cuda_streams = 2;
  bool cuda_allow_tf32 = false;
  int64_t cuda_layer_cache_bytes = 0;
};

struct BackendEntry {
  std::string name;                  // a k*Backend constant
  bool compiled_in = false;
  std::unique_ptr<Backend> backend;  // null when not compiled in or not usable here
  std::string device;                // from the backend, when available
  std::string detail;                // why it is unavailable
  bool available() const { return backend != nullptr; }
};

class BackendRegistry {
 public:
  // Every compiled-in backend with its variants, defaults first. Creating one may fail (UNAVAILABLE: not on this
  // machine).
  static std::vector<BackendFactory> Factories(const BackendOptions& options = BackendOptions());
  // Whether this build carries the backend `name` (a k*Backend constant), usable here or not.
  static bool CompiledIn(absl::string_view name);

  // Instantiates the default of every compiled-in backend that works here. Never fails: unusable ones are listed
  // with a reason.
  static std::unique_ptr<BackendRegistry> Create(const BackendOptions& options = BackendOptions());

  // INVALID_ARGUMENT for an unknown name or one not compiled in; UNAVAILABLE for one compiled in but unusable on
  // this machine (e.g. CUDA without a GPU). Both messages name `field`.
  absl::StatusOr<Backend*> Find(absl::string_view name, absl::string_view field) const;
  // The backend name a request's enum asks for; BACKEND_AUTO gives DefaultName().
  std::string NameFor(v1::Backend backend) const;
  // What BACKEND_AUTO means: the backend given to SetDefault, else "cuda" when available, else "cpu".
  std::string DefaultName() const;
  // Makes `name` ("auto" restores the rule above) what BACKEND_AUTO means; Find's errors, naming `field`, if it
  // cannot serve. Not thread-safe: call before serving.
  absl::Status SetDefault(absl::string_view name, absl::string_view field);
  const std::vector<BackendEntry>& entries() const { return entries_; }

 private:
  std::vector<BackendEntry> entries_;
  std::string default_;  // empty: the rule of DefaultName
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_REGISTRY_H_
