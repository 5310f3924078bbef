#include "server/layers/layer_store.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "proto/mha/v1/checkpoint.h"
#include "proto/mha/v1/safetensors.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"

namespace mha {

LayerStore::LayerStore(int64_t max_total_bytes, int max_layers)
    : max_total_bytes_(max_total_bytes), max_layers_(max_layers) {}

absl::Status LayerStore::Add(std::shared_ptr<const Layer> layer) {
  RETURN_IF_ERROR(CheckName(layer->name, "layer name"));
  const int64_t size = layer->SizeBytes();
  absl::MutexLock lock(&mu_);
  if (layers_.count(layer->name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("layer '", layer->name, "' already exists; unload it first"));
  }
  RETURN_IF_ERROR(CheckRoom(layer->name, size));
  total_bytes_ += size;
  layers_.emplace(layer->name, std::move(layer));
  return absl::OkStatus();
}

absl::Status LayerStore::CheckRoom(absl::string_view name, int64_t bytes) const {
  if (static_cast<int>(layers_.size()) >= max_layers_) {
    return absl::ResourceExhaustedError(absl::StrCat("layer '", name, "': ", layers_.size(),
                                                     " layers are registered, the limit (--max_layers)"));
  }
  if (total_bytes_ + bytes > max_total_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("layer '", name, "' needs ", bytes,
                                                     " bytes; registered layers hold ", total_bytes_, " of ",
                                                     max_total_bytes_, " (--max_layer_mb)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Layer>> LayerStore::Load(absl::string_view name, absl::string_view source,
                                                              const v1::AttentionWeights& weights,
                                                              const v1::HeadConfig& heads, absl::string_view field) {
  RETURN_IF_ERROR(CheckName(name, "name"));
  ASSIGN_OR_RETURN(const LayerShape shape, CheckLayerWeights(weights, heads, field));
  {
    absl::MutexLock lock(&mu_);
    if (layers_.count(name) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("layer '", name, "' already exists; unload it first"));
    }
    RETURN_IF_ERROR(CheckRoom(name, shape.HeldBytes()));
  }
  std::shared_ptr<const Layer> layer = DecodeLayer(name, source, weights, shape);
  RETURN_IF_ERROR(Add(layer));  // again under the lock: another Load may have taken the room meanwhile
  return layer;
}

absl::Status LayerStore::Remove(absl::string_view name) {
  RETURN_IF_ERROR(CheckName(name, "name"));
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) return absl::NotFoundError(absl::StrCat("name: no layer '", name, "'"));
  if (it->second->source == "builtin") {
    return absl::FailedPreconditionError(absl::StrCat("name: layer '", name, "' is built in"));
  }
  total_bytes_ -= it->second->SizeBytes();
  layers_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Layer>> LayerStore::Get(absl::string_view name) const {
  RETURN_IF_ERROR(CheckName(name, "layer"));
  absl::MutexLock lock(&mu_);
  auto it = layers_.find(name);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("layer: no layer named '", name, "' (see ListLayers)"));
  }
  return it->second;
}

std::vector<std::shared_ptr<const Layer>> LayerStore::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Layer>> out;
  for (const auto& [name, layer] : layers_) out.push_back(layer);
  return out;
}

absl::Status LayerStore::LoadCheckpoint(const std::filesystem::path& folder) {
  ASSIGN_OR_RETURN(Checkpoint checkpoint, ReadCheckpoint(folder.string(), folder.filename().string()));
  for (const v1::LoadLayerRequest& request : checkpoint.layers) {
    absl::StatusOr<std::shared_ptr<const Layer>> layer =
        Load(request.name(), absl::StrCat("checkpoint:", folder.string()), request.weights(), request.heads(),
             request.name());
    if (!layer.ok()) {
      return absl::Status(layer.status().code(),
                          absl::StrCat("layer ", request.name(), ": ", layer.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerStore::LoadDirectory(const std::string& dir) {
  std::error_code ec;
  std::vector<std::filesystem::path> files, checkpoints;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") files.push_back(entry.path());
    if (entry.is_directory() && std::filesystem::is_regular_file(entry.path() / "config.json")) {
      checkpoints.push_back(entry.path());
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat("--layers_dir ", dir, ": ", ec.message()));
  std::sort(files.begin(), files.end());
  std::sort(checkpoints.begin(), checkpoints.end());
  for (const auto& folder : checkpoints) {
    if (absl::Status s = LoadCheckpoint(folder); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(folder.string(), ": ", s.message()));
    }
  }
  for (const auto& path : files) {
    ASSIGN_OR_RETURN(SafetensorsLayer file, ReadSafetensorsLayer(path.string()));
    absl::StatusOr<std::shared_ptr<const Layer>> layer =
        Load(path.stem().string(), absl::StrCat("file:", path.string()), file.weights, file.heads,
             path.filename().string());
    if (!layer.ok()) {
      return absl::Status(layer.status().code(), absl::StrCat(path.string(), ": ", layer.status().message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace mha
