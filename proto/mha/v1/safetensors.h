// Reads one attention layer from a .safetensors file (https://github.com/huggingface/safetensors):
// an 8-byte little-endian header length N, N bytes of JSON, then the tensor bytes.
//
// Tensors: w_q, w_k, w_v, w_o (required) and b_q, b_k, b_v, b_o (optional), dtype F32, F16 or BF16, shapes as in
// AttentionWeights (Y = X W). The head configuration comes from "__metadata__" (string values, as the format
// requires): num_heads (required), num_kv_heads, head_dim, causal ("true"/"false"), scale, and RoPE's rope_theta,
// rope_dim and rope_interleaved ("true"/"false"), as in HeadConfig, and rope_scaling: transformers' rope_scaling
// object as JSON text (e.g. "{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}"), read into HeadConfig.rope_scaling.
//
// Shared by the server (--layers_dir) and the clients (mha_client call --weights_file), like tensor_codec.h.
#ifndef MHA_PROTO_SAFETENSORS_H_
#define MHA_PROTO_SAFETENSORS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

struct SafetensorsLayer {
  v1::AttentionWeights weights;
  v1::HeadConfig heads;
};

// INVALID_ARGUMENT (naming the file and what is wrong) for a malformed file: among others a header nesting JSON more
// than 8 deep or holding more than 65536 JSON values (refused before parsing, so that a hostile header costs little
// beyond its own bytes), or tensors whose
// data_offsets overlap or leave holes in the data section (the format forbids both). NOT_FOUND if it cannot be opened.
absl::StatusOr<SafetensorsLayer> ReadSafetensorsLayer(const std::string& path);

// The same from the file's bytes; `origin` names the source in error messages.
absl::StatusOr<SafetensorsLayer> ParseSafetensorsLayer(absl::string_view bytes, absl::string_view origin);

// A header larger than this is not a safetensors file's (safetensors itself caps it at 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100 << 20;

// A safetensors header (the JSON between the length and the data) parsed, once its nesting and count of values are
// found within bounds that keep the parser's memory to a few MB beyond the text: INVALID_ARGUMENT (prefixed
// "safetensors <origin>: ") for a header past them or one that is not a JSON object.
absl::StatusOr<nlohmann::json> ParseSafetensorsHeader(absl::string_view text, absl::string_view origin);

// A tensor dtype of the format as the wire's: F32, F16, BF16; DATA_TYPE_UNSPECIFIED for any other.
v1::DataType SafetensorsDtype(absl::string_view name);

// transformers' rope_scaling (config.json's object, or transformers 5's rope_parameters) as JSON text, into *out:
// its keys by their names, "type" as an old name of rope_type; rope_theta and partial_rotary_factor (HeadConfig's own
// fields) and nulls skipped. INVALID_ARGUMENT for what is not an object or holds a key RopeScaling lacks. The values
// are checked where the heads are resolved (ResolveHeads).
absl::Status RopeScalingFromJson(absl::string_view text, v1::RopeScaling* out);

}  // namespace mha

#endif  // MHA_PROTO_SAFETENSORS_H_
