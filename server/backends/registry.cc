// The registry's lookups; which backends it holds is compiled_backends.cc's to say.
#include "server/backends/registry.h"

#include "absl/strings/str_cat.h"

namespace mha {

absl::StatusOr<Backend*> BackendRegistry::Find(absl::string_view name, absl::string_view field) const {
  for (const BackendEntry& entry : entries_) {
    if (entry.name != name) continue;
    if (!entry.compiled_in) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": backend '", name, "' is not compiled into this server"));
    }
    if (!entry.available()) {
      return absl::UnavailableError(
          absl::StrCat(field, ": backend '", name, "' is unavailable on this machine: ", entry.detail));
    }
    return entry.backend.get();
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": unknown backend '", name, "' (expected ", kCpuBackend,
                                                 ", ", kCudaBackend, " or ", kReferenceBackend, ")"));
}

std::string BackendRegistry::NameFor(v1::Backend backend) const {
  switch (backend) {
    case v1::BACKEND_CPU:
      return std::string(kCpuBackend);
    case v1::BACKEND_CUDA:
      return std::string(kCudaBackend);
    case v1::BACKEND_REFERENCE:
      return std::string(kReferenceBackend);
    default:
      return DefaultName();
  }
}

absl::Status BackendRegistry::SetDefault(absl::string_view name, absl::string_view field) {
  if (name == "auto") {
    default_.clear();
    return absl::OkStatus();
  }
  absl::StatusOr<Backend*> backend = Find(name, field);
  if (!backend.ok()) return backend.status();
  default_ = std::string(name);
  return absl::OkStatus();
}

std::string BackendRegistry::DefaultName() const {
  if (!default_.empty()) return default_;
  for (const BackendEntry& entry : entries_) {
    if (entry.name == kCudaBackend && entry.available()) return entry.name;
  }
  return std::string(kCpuBackend);
}

}  // namespace mha
