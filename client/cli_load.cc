// mha_client load: registers every attention layer of a transformers checkpoint folder (client/checkpoint.h) as
// "<name>.<i>", one LoadLayer call per layer, and prints what each became.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "proto/mha/v1/checkpoint.h"
#include "client/cli.h"

ABSL_FLAG(std::string, checkpoint, "",
          "load: a transformers checkpoint folder (config.json and model.safetensors or its shards with their index)");
ABSL_FLAG(std::string, name, "model", "load: the layers' names are <name>.<layer index>");
ABSL_FLAG(bool, ignore_sliding_window, false,
          "load: register a sliding-window model's layers anyway (they attend to every earlier token, which equals "
          "the model within its window)");

namespace mha::cli {

int RunLoad(const ClientOptions& options) {
  const std::string dir = absl::GetFlag(FLAGS_checkpoint);
  if (dir.empty()) return UsageError(absl::InvalidArgumentError("load needs --checkpoint FOLDER"));
  absl::StatusOr<Checkpoint> checkpoint =
      ReadCheckpoint(dir, absl::GetFlag(FLAGS_name), absl::GetFlag(FLAGS_ignore_sliding_window));
  if (!checkpoint.ok()) return Fail(checkpoint.status());
  AttentionClient client(options);
  int64_t bytes = 0;
  for (const v1::LoadLayerRequest& layer : checkpoint->layers) {
    absl::StatusOr<v1::LoadLayerResponse> loaded = client.LoadLayer(layer);
    if (!loaded.ok()) return Fail(absl::Status(loaded.status().code(), absl::StrCat(layer.name(), ": ",
                                                                                     loaded.status().message())));
    const v1::LayerInfo& info = loaded->layer();
    const v1::HeadConfig& h = info.heads();
    std::printf("loaded %s: d_model %lld, heads %d (kv %d, d_k %d), scale %g, %s\n", info.name().c_str(),
                static_cast<long long>(info.d_model()), h.num_heads(), h.num_kv_heads(), h.head_dim(), h.scale(),
                h.rope_theta() == 0 ? "no RoPE"
                                    : absl::StrCat("RoPE theta ", h.rope_theta(), " on ", h.rope_dim(), " dims",
                                                   h.has_rope_scaling() ? ", " + h.rope_scaling().rope_type() : "")
                                          .c_str());
    bytes += static_cast<int64_t>(layer.ByteSizeLong());
  }
  std::printf("%s: %zu layers of %s, %.1f MiB sent\n", dir.c_str(), checkpoint->layers.size(),
              checkpoint->model_type.c_str(), static_cast<double>(bytes) / (1 << 20));
  return kExitOk;
}

}  // namespace mha::cli
