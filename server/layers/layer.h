// Attention layers: projection weights in fp32 plus the resolved head configuration, checked from the wire's
// shapes before any byte is decoded.
#ifndef MHA_SERVER_LAYERS_LAYER_H_
#define MHA_SERVER_LAYERS_LAYER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/mha/v1/attention.pb.h"
#include "proto/mha/v1/attention_shape.h"
#include "server/backends/backend.h"

namespace mha {

// What a set of weights fixes about a call, known from their shapes alone.
struct LayerShape {
  int64_t d_model = 0, d_kv_in = 0, d_v_in = 0;
  HeadSpec heads;
  // d_kv_in == d_v_in == d_model: w_q | w_k | w_v are held as one matrix (and b_q | b_k | b_v as one bias), so that
  // a self-attention call projects Q, K and V in one product. Decided here, once.
  bool fused_qkv() const { return d_kv_in == d_model && d_v_in == d_model; }
  bool input_bias = false;   // any of b_q, b_k, b_v given
  bool output_bias = false;  // b_o given
  // The fp32 bytes a layer of this shape holds (Layer::SizeBytes), known before decoding.
  int64_t HeldBytes() const;
};

// Immutable once built; shared by reference between the store and in-flight requests.
struct Layer {
  std::string name;
  std::string source;  // "builtin", "file:<path>", "rpc" or "inline"
  uint64_t id = 0;     // process-unique and never reused; 0 for inline weights (LayerWeights::resident_id)
  LayerShape shape;
  bool has_bias = false;
  // The input projections, one copy: fused, [d_model, (H + 2 Hkv) d_k]; otherwise w_q, w_k, w_v back to back.
  std::vector<float> w_in;
  std::vector<float> b_in;  // b_q | b_k | b_v (zeros for an absent one), empty when none is given
  std::vector<float> w_o;   // [H d_k, d_model]
  std::vector<float> b_o;   // [d_model] or empty

  LayerWeights Weights() const;
  int64_t SizeBytes() const;  // fp32 bytes held
  v1::LayerInfo Info() const;
};

// The feature widths a request's inputs set, which inline weights must match (LoadLayer has no inputs: there the
// weights set them).
struct InputWidths {
  int64_t d_model = 0;  // the query's last dimension
  int64_t d_kv_in = 0;  // the key's (the query's when the request has no key)
  int64_t d_v_in = 0;   // the value's (the key's when the request has no value)
};

// Checks weights against a head configuration from their shapes, dtypes, byte counts and a scan for non-finite
// values, decoding nothing. d_model, d_kv_in and d_v_in come from `inputs` when given, else from w_q, w_k and w_v's
// first dimensions. Heads resolve with ResolveHeads; a head_dim left 0 is inferred from w_q's columns when they are
// not d_model but divide by num_heads. Every error is INVALID_ARGUMENT, names the field under `field` (e.g.
// "inline_weights.w_k") with expected and given shapes, and says which tensor or field sets each expected size.
absl::StatusOr<LayerShape> CheckLayerWeights(const v1::AttentionWeights& weights, const v1::HeadConfig& heads,
                                             absl::string_view field, const InputWidths* inputs = nullptr);

// Decodes weights that passed CheckLayerWeights with `shape` into a layer.
std::shared_ptr<const Layer> DecodeLayer(absl::string_view name, absl::string_view source,
                                         const v1::AttentionWeights& weights, const LayerShape& shape);

// CheckLayerWeights, then DecodeLayer.
absl::StatusOr<std::shared_ptr<const Layer>> BuildLayer(absl::string_view name, absl::string_view source,
                                                        const v1::AttentionWeights& weights,
                                                        const v1::HeadConfig& heads, absl::string_view field);

// The built-in "demo" layer: d_model 512, 8 heads, weights uniform in +-1/sqrt(512) from a fixed seed, no bias.
std::shared_ptr<const Layer> MakeDemoLayer();

}  // namespace mha

#endif  // MHA_SERVER_LAYERS_LAYER_H_
