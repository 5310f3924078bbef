// Named layers registered with the server: the built-in "demo", files from --layers_dir, and LoadLayer calls.
// Thread-safe. Layers are immutable and shared: a request keeps its layer alive even if it is unloaded meanwhile.
#ifndef MHA_SERVER_LAYERS_LAYER_STORE_H_
#define MHA_SERVER_LAYERS_LAYER_STORE_H_

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/layers/layer.h"

namespace mha {

class LayerStore {
 public:
  // max_total_bytes bounds the fp32 bytes of all layers together and max_layers their number (the demo layer
  // included in both).
  LayerStore(int64_t max_total_bytes, int max_layers);

  // INVALID_ARGUMENT for a bad name, ALREADY_EXISTS if taken, RESOURCE_EXHAUSTED past either limit.
  absl::Status Add(std::shared_ptr<const Layer> layer);
  // Checks `weights` against `heads` from their shapes (errors name `field`), checks the name and that the layer
  // fits the limits before anything is decoded, then decodes and adds it. Returns the layer or Add's errors.
  absl::StatusOr<std::shared_ptr<const Layer>> Load(absl::string_view name, absl::string_view source,
                                                    const v1::AttentionWeights& weights, const v1::HeadConfig& heads,
                                                    absl::string_view field);
  // NOT_FOUND if absent; FAILED_PRECONDITION for a built-in layer.
  absl::Status Remove(absl::string_view name);
  // NOT_FOUND (naming the field "layer") if absent.
  absl::StatusOr<std::shared_ptr<const Layer>> Get(absl::string_view name) const;
  std::vector<std::shared_ptr<const Layer>> List() const;  // sorted by name
  int64_t max_total_bytes() const { return max_total_bytes_; }
  int max_layers() const { return max_layers_; }

  // Loads every *.safetensors file in `dir` (sorted by name) as a layer named after the file's stem, and every
  // folder in it that holds a transformers checkpoint (config.json; proto/mha/v1/checkpoint.h) as layers
  // "<folder>.<i>". Returns the first error, naming the file or folder.
  absl::Status LoadDirectory(const std::string& dir);

 private:
  // A checkpoint folder's layers, named "<folder name>.<i>".
  absl::Status LoadCheckpoint(const std::filesystem::path& folder);

  const int64_t max_total_bytes_;
  // RESOURCE_EXHAUSTED (naming the layer) when `count` layers and `bytes` more would pass a limit.
  absl::Status CheckRoom(absl::string_view name, int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_layers_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Layer>, std::less<>> layers_ ABSL_GUARDED_BY(mu_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_LAYERS_LAYER_STORE_H_
