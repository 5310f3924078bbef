// A serialized LoadLayerRequest through what the server's LoadLayer does (service.cc): parse, check the name, load
// into a layer store (which checks the weights from their shapes, the store's limits, then decodes), then describe,
// list and unload it; a layer that loads runs one tiny call on the reference and CPU backends (fuzz_env.h). Each
// input gets a fresh store holding one layer, "tiny", so that ALREADY_EXISTS is reachable and inputs stay
// independent.
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  v1::LoadLayerRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  Count(Stage::kParsed);
  // A store as a server with --max_layer_mb 64 --max_layers 3 has it.
  LayerStore store(64 << 20, 3);
  if (!store.Add(*env.layers->Get("tiny")).ok()) std::abort();

  absl::StatusOr<std::shared_ptr<const Layer>> layer =
      store.Load(request.name(), "rpc", request.weights(), request.heads(), "weights");
  if (!layer.ok()) {
    switch (layer.status().code()) {
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kAlreadyExists:
      case absl::StatusCode::kResourceExhausted:
        return 0;
      default:
        Fail("Load returned a code the contract does not name", layer.status());
    }
  }
  Count(Stage::kValid);
  const v1::LayerInfo info = (*layer)->Info();
  if (info.name() != request.name() || info.size_bytes() != (*layer)->shape.HeldBytes()) {
    Fail("LayerInfo disagrees with the layer", absl::InternalError(info.ShortDebugString()));
  }
  if (store.List().size() != 2) Fail("List", absl::InternalError(absl::StrCat(store.List().size())));
  RunLayer(*layer, env.BackendsFor(size));
  if (absl::Status removed = store.Remove(request.name()); !removed.ok()) Fail("Remove", removed);
  return 0;
}
