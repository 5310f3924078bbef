// A validated attention layer: fp32 projection weights plus the resolved head configuration.
#ifndef MHA_SERVER_LAYER_H_
#define MHA_SERVER_LAYER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backend.h"

namespace mha {

// Head configuration with every default resolved.
struct HeadSpec {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool causal = false;
  float scale = 0.0f;  // never 0 once resolved
};

// Immutable once built; shared by reference between the store and in-flight requests.
struct Layer {
  std::string name;
  std::string source;  // "builtin", "file:<path>", "rpc" or "inline"
  HeadSpec heads;
  int64_t d_model = 0, d_kv_in = 0, d_v_in = 0;
  std::vector<float> w_q, w_k, w_v, w_o;  // shapes as in LayerWeights
  std::vector<float> b_q, b_k, b_v, b_o;  // empty when absent
  std::vector<float> w_qkv, b_qkv;        // fused projection when d_kv_in == d_v_in == d_model

  LayerWeights Weights() const;
  int64_t SizeBytes() const;
  v1::LayerInfo Info() const;
};

// Resolves a HeadConfig against d_model: num_kv_heads 0 -> num_heads, head_dim 0 -> d_model / num_heads,
// scale 0 -> 1/sqrt(head_dim). INVALID_ARGUMENT naming `field` (e.g. "heads") on any inconsistency.
absl::StatusOr<HeadSpec> ResolveHeads(const v1::HeadConfig& config, int64_t d_model, absl::string_view field);

// Validates weights against the head configuration and converts them to fp32. Every error is INVALID_ARGUMENT
// and names the field under `field` (e.g. "inline_weights.w_k"), with expected and given shapes.
absl::StatusOr<std::shared_ptr<const Layer>> BuildLayer(absl::string_view name, absl::string_view source,
                                                        const v1::AttentionWeights& weights,
                                                        const v1::HeadConfig& heads, absl::string_view field);

// The built-in "demo" layer: d_model 512, 8 heads, weights uniform in +-1/sqrt(512) from a fixed seed, no bias.
std::shared_ptr<const Layer> MakeDemoLayer();

}  // namespace mha

#endif  // MHA_SERVER_LAYER_H_
