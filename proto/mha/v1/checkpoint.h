// A transformers checkpoint folder as it is stored (config.json, and model.safetensors or its shards listed in
// model.safetensors.index.json), read into one LoadLayerRequest per decoder layer: the attention's projections in
// the layer's Y = X W convention (nn.Linear's [out, in] transposed, GPT-2's Conv1D [in, out] as it is, fused
// projections split: GPT-2's c_attn by columns, Phi-3's qkv_proj by rows, GPT-NeoX's query_key_value per head),
// their biases, and the heads: counts, RoPE (theta, partial rotary, scaling) and the scale as the model computes them.
// Architectures (config.json's model_type): llama, mistral, qwen2, phi3, gpt2, gpt_neox. Anything else, or a feature
// the service does not compute (a sliding window), is INVALID_ARGUMENT naming it. Tensors keep their dtype (F32,
// F16 or BF16) and are read one at a time from the shards. Shared by the server (--layers_dir's checkpoint folders)
// and mha_client load, like safetensors.h.
#ifndef MHA_PROTO_CHECKPOINT_H_
#define MHA_PROTO_CHECKPOINT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

struct Checkpoint {
  std::string model_type;
  std::vector<v1::LoadLayerRequest> layers;  // layer i named "<name>.<i>"
};

// The architectures ReadCheckpoint understands, as config.json's model_type names them.
const std::vector<std::string>& CheckpointModelTypes();

// NOT_FOUND when the folder lacks config.json, a tensor or a tensor's file; INVALID_ARGUMENT for what it cannot read
// or represent, naming the file, key or tensor. `ignore_window`: load a sliding-window model anyway (the service
// attends to every earlier token, which equals the model within its window).
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, const std::string& name, bool ignore_window = false);

}  // namespace mha

#endif  // MHA_PROTO_CHECKPOINT_H_
