#include "server/backend_registry.h"

#include "absl/strings/str_cat.h"
#include "server/cpu_backend.h"
#include "server/reference_backend.h"

namespace mha {

std::unique_ptr<BackendRegistry> BackendRegistry::Create() {
  auto registry = std::make_unique<BackendRegistry>();
  auto add = [&](std::string name, bool compiled_in, absl::StatusOr<std::unique_ptr<Backend>> backend) {
    BackendEntry entry;
    entry.name = std::move(name);
    entry.compiled_in = compiled_in;
    if (backend.ok()) {
      entry.backend = *std::move(backend);
      entry.device = entry.backend->device();
    } else {
      entry.detail = std::string(backend.status().message());
    }
    registry->entries_.push_back(std::move(entry));
  };

  add("reference", true, std::unique_ptr<Backend>(new ReferenceBackend()));
  {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
    if (cpu.ok()) {
      add("cpu", true, std::unique_ptr<Backend>(std::move(*cpu)));
    } else {
      add("cpu", true, cpu.status());
    }
  }
  // No CUDA backend is compiled into this build yet.
  add("cuda", false, absl::UnimplementedError("not compiled into this build"));
  return registry;
}

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
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown backend '", name, "' (expected cpu, cuda or reference)"));
}

std::string BackendRegistry::DefaultName() const {
  for (const BackendEntry& entry : entries_) {
    if (entry.name == "cuda" && entry.available()) return "cuda";
  }
  return "cpu";
}

}  // namespace mha
