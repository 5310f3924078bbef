#include "server/rpc/kserve/model_info.h"

#include <string>
#include <vector>

#include "server/rpc/kserve/infer_request.h"

namespace mha {
namespace {

struct TensorSpec {
  const char* name;
  const char* datatype;  // the one metadata names; FP16 and BF16 are taken too where FP32 is
  std::vector<int64_t> dims;
  bool optional;
};

struct ModelSpec {
  std::string name;
  std::vector<TensorSpec> inputs, outputs;
};

ModelSpec SpecOf(const Layer* layer) {
  if (layer == nullptr) {
    return {kSdpaModel,
            {{"q", "FP32", {-1, -1, -1, -1}, false},
             {"k", "FP32", {-1, -1, -1, -1}, false},
             {"v", "FP32", {-1, -1, -1, -1}, false},
             {"key_lengths", "INT32", {-1}, true},
             {"attn_mask", "FP32", {-1, -1}, true}},
            {{"output", "FP32", {-1, -1, -1, -1}, false},
             {"attention_weights", "FP32", {-1, -1, -1, -1}, true},
             {"lse", "FP32", {-1, -1, -1}, true},
             {"head_entropy", "FP32", {-1, -1}, true},
             {"head_normalized_entropy", "FP32", {-1, -1}, true},
             {"head_confidence", "FP32", {-1, -1}, true},
             {"head_distance", "FP32", {-1, -1}, true},
             {"head_sink_mass", "FP32", {-1, -1}, true}}};
  }
  const LayerShape& shape = layer->shape;
  const int64_t heads = shape.heads.num_heads;
  return {layer->name,
          {{"query", "FP32", {-1, -1, shape.d_model}, false},
           {"key", "FP32", {-1, -1, shape.d_kv_in}, true},
           {"value", "FP32", {-1, -1, shape.d_v_in}, true},
           {"key_lengths", "INT32", {-1}, true},
           {"attn_mask", "FP32", {-1, -1}, true},
           {"head_mask", "FP32", {heads}, true}},
          {{"output", "FP32", {-1, -1, shape.d_model}, false},
           {"attention_weights", "FP32", {-1, heads, -1, -1}, true},
           {"lse", "FP32", {-1, heads, -1}, true},
           {"head_entropy", "FP32", {-1, heads}, true},
           {"head_normalized_entropy", "FP32", {-1, heads}, true},
           {"head_confidence", "FP32", {-1, heads}, true},
           {"head_distance", "FP32", {-1, heads}, true},
           {"head_sink_mass", "FP32", {-1, heads}, true},
           {"head_contribution", "FP32", {-1, heads}, true}}};
}

inference::DataType ConfigType(const std::string& datatype) {
  inference::DataType type = inference::TYPE_INVALID;
  inference::DataType_Parse("TYPE_" + datatype, &type);
  return type;
}

}  // namespace

inference::ModelMetadataResponse ModelMetadataOf(const Layer* layer) {
  const ModelSpec spec = SpecOf(layer);
  inference::ModelMetadataResponse metadata;
  metadata.set_name(spec.name);
  metadata.add_versions(kModelVersion);
  metadata.set_platform(kPlatform);
  for (const auto* list : {&spec.inputs, &spec.outputs}) {
    for (const TensorSpec& tensor : *list) {
      auto* to = list == &spec.inputs ? metadata.add_inputs() : metadata.add_outputs();
      to->set_name(tensor.name);
      to->set_datatype(tensor.datatype);
      to->mutable_shape()->Assign(tensor.dims.begin(), tensor.dims.end());
    }
  }
  return metadata;
}

inference::ModelConfig ModelConfigOf(const Layer* layer) {
  const ModelSpec spec = SpecOf(layer);
  inference::ModelConfig config;
  config.set_name(spec.name);
  config.set_platform(kPlatform);
  config.set_backend(kPlatform);
  config.set_max_batch_size(0);
  for (const TensorSpec& tensor : spec.inputs) {
    inference::ModelInput* input = config.add_input();
    input->set_name(tensor.name);
    input->set_data_type(ConfigType(tensor.datatype));
    input->mutable_dims()->Assign(tensor.dims.begin(), tensor.dims.end());
    input->set_optional(tensor.optional);
  }
  for (const TensorSpec& tensor : spec.outputs) {
    inference::ModelOutput* output = config.add_output();
    output->set_name(tensor.name);
    output->set_data_type(ConfigType(tensor.datatype));
    output->mutable_dims()->Assign(tensor.dims.begin(), tensor.dims.end());
  }
  return config;
}

}  // namespace mha
