// A .safetensors file's bytes through the layer reader (proto/mha/v1/safetensors.h) and, as --layers_dir does
// (LayerStore::LoadDirectory), into a layer store; a layer that loads runs one tiny call on the reference and CPU
// backends (fuzz_env.h). Findings: sanitizer reports, memory past -rss_limit_mb, an error code other than
// INVALID_ARGUMENT from the reader.
#include <cstdio>
#include <cstdlib>

#include "proto/mha/v1/safetensors.h"
#include "tests/fuzz/fuzz_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<SafetensorsLayer> file = ParseSafetensorsLayer(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    if (file.status().code() != absl::StatusCode::kInvalidArgument || file.status().message().empty()) {
      std::fprintf(stderr, "fuzz_safetensors: %s\n", file.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  Count(Stage::kParsed);
  LayerStore store(64 << 20, 2);
  absl::StatusOr<std::shared_ptr<const Layer>> layer =
      store.Load("fuzz", "file:fuzz.safetensors", file->weights, file->heads, "fuzz.safetensors");
  if (layer.ok()) Count(Stage::kValid);
  if (layer.ok()) RunLayer(*layer, env.BackendsFor(size));
  return 0;
}
