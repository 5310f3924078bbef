// The only place that knows which backends were compiled into this binary and which work on this machine.
#ifndef MHA_SERVER_BACKEND_REGISTRY_H_
#define MHA_SERVER_BACKEND_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend.h"

namespace mha {

struct BackendEntry {
  std::string name;               // "cpu", "reference", "cuda"
  bool compiled_in = false;
  std::unique_ptr<Backend> backend;  // null when not compiled in or not usable here
  std::string device;             // from the backend, when available
  std::string detail;             // why it is unavailable
  bool available() const { return backend != nullptr; }
};

class BackendRegistry {
 public:
  // Instantiates every compiled-in backend that works here. Never fails: unusable ones are listed with a reason.
  static std::unique_ptr<BackendRegistry> Create();

  // INVALID_ARGUMENT for an unknown name or one not compiled in; UNAVAILABLE for one compiled in but unusable on
  // this machine (e.g. CUDA without a GPU). Both messages name `field`.
  absl::StatusOr<Backend*> Find(absl::string_view name, absl::string_view field) const;
  // What BACKEND_AUTO means here: "cuda" when available, else "cpu".
  std::string DefaultName() const;
  const std::vector<BackendEntry>& entries() const { return entries_; }

 private:
  std::vector<BackendEntry> entries_;
};

}  // namespace mha

#endif  // MHA_SERVER_BACKEND_REGISTRY_H_
