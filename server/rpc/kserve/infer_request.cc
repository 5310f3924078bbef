#include "server/rpc/kserve/infer_request.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

using InferInput = inference::ModelInferRequest::InferInputTensor;
using Parameters = google::protobuf::Map<std::string, inference::InferParameter>;

// An input's bytes when it is not in shared memory: its raw_input_contents entry, else its typed contents.
struct Source {
  InferInput* input = nullptr;
  std::string* raw = nullptr;  // null: typed contents (or shared memory)
};

bool InSharedMemory(const InferInput& input) { return input.parameters().count("shared_memory_region") > 0; }

int ElementBytes(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "FP16" || datatype == "BF16") return 2;
  if (datatype == "INT64") return 8;
  if (datatype == "BOOL") return 1;
  return 0;
}

// The element count of `input`'s shape: every dim >= 1, the product bounded.
absl::StatusOr<int64_t> ElementCount(const InferInput& input) {
  int64_t count = 1;
  for (int64_t dim : input.shape()) {
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), ": shape [", absl::StrJoin(input.shape(), ", "),
                                                     "] has a dimension below 1"));
    }
    if (count > (int64_t{1} << 40) / dim) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), ": shape [", absl::StrJoin(input.shape(), ", "),
                                                     "] is too large"));
    }
    count *= dim;
  }
  return count;
}

// A parameter from `params` when present; INVALID_ARGUMENT naming it (`where` is "parameters" or an input's name)
// when it has another type.
absl::StatusOr<const inference::InferParameter*> Param(const Parameters& params, const std::string& name,
                                                       inference::InferParameter::ParameterChoiceCase type,
                                                       absl::string_view where, absl::string_view type_name) {
  const auto it = params.find(name);
  if (it == params.end()) return nullptr;
  if (it->second.parameter_choice_case() != type) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": parameter '", name, "' must be a ", type_name));
  }
  return &it->second;
}

// Copies `input`'s shared-memory parameters into `ref` after checking its byte size is `bytes`.
absl::Status ReadSharedMemory(const InferInput& input, int64_t bytes, v1::SharedMemoryRef* ref) {
  const Parameters& params = input.parameters();
  ASSIGN_OR_RETURN(const inference::InferParameter* region,
                   Param(params, "shared_memory_region", inference::InferParameter::kStringParam, input.name(),
                         "string"));
  ASSIGN_OR_RETURN(const inference::InferParameter* size,
                   Param(params, "shared_memory_byte_size", inference::InferParameter::kInt64Param, input.name(),
                         "int64"));
  ASSIGN_OR_RETURN(const inference::InferParameter* offset,
                   Param(params, "shared_memory_offset", inference::InferParameter::kInt64Param, input.name(),
                         "int64"));
  if (size == nullptr || size->int64_param() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(input.name(), ": shared_memory_byte_size must be ", bytes,
                                                   " (the shape's bytes), not ",
                                                   size == nullptr ? "absent" : absl::StrCat(size->int64_param())));
  }
  if (offset != nullptr && offset->int64_param() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(input.name(), ": shared_memory_offset must be >= 0"));
  }
  ref->set_region(region->string_param());
  ref->set_offset(offset == nullptr ? 0 : static_cast<uint64_t>(offset->int64_param()));
  return absl::OkStatus();
}

absl::Status CheckDatatype(const InferInput& input, std::initializer_list<const char*> taken) {
  for (const char* datatype : taken) {
    if (input.datatype() == datatype) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(input.name(), ": datatype '", input.datatype(),
                                                 "' is not taken; send ", absl::StrJoin(taken, ", ")));
}

// `source`'s bytes in little-endian element order: the raw entry (moved out) or the typed contents converted.
// INVALID_ARGUMENT when their size is not `count` elements.
absl::StatusOr<std::string> TakeBytes(const Source& source, int64_t count) {
  const InferInput& input = *source.input;
  const int64_t bytes = count * ElementBytes(input.datatype());
  if (source.raw != nullptr) {
    if (static_cast<int64_t>(source.raw->size()) != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), ": ", source.raw->size(),
                                                     " bytes in raw_input_contents; its shape [",
                                                     absl::StrJoin(input.shape(), ", "), "] of ", input.datatype(),
                                                     " needs ", bytes));
    }
    return std::move(*source.raw);
  }
  const inference::InferTensorContents& contents = input.contents();
  std::string out;
  int64_t given = -1;
  auto copy = [&](const auto& values) {
    given = values.size();
    if (given == count) out.assign(reinterpret_cast<const char*>(values.data()), bytes);
  };
  if (input.datatype() == "FP32") copy(contents.fp32_contents());
  if (input.datatype() == "INT32") copy(contents.int_contents());
  if (input.datatype() == "INT64") copy(contents.int64_contents());
  if (input.datatype() == "BOOL") {
    given = contents.bool_contents_size();
    for (bool value : contents.bool_contents()) out.push_back(value ? 1 : 0);
  }
  if (given < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(input.name(), ": ", input.datatype(), " tensors travel in raw_input_contents"));
  }
  if (given != count) {
    return absl::InvalidArgumentError(absl::StrCat(input.name(), ": ", given, " values in its contents; its shape [",
                                                   absl::StrJoin(input.shape(), ", "), "] needs ", count));
  }
  return out;
}

v1::DataType FloatType(const std::string& datatype) {
  if (datatype == "FP16") return v1::FP16;
  if (datatype == "BF16") return v1::BF16;
  return v1::FP32;
}

// An activation (query, key, value; q, k, v): FP32, FP16 or BF16, its bytes or its shared memory.
absl::Status ReadActivation(const Source& source, v1::Tensor* tensor) {
  const InferInput& input = *source.input;
  RETURN_IF_ERROR(CheckDatatype(input, {"FP32", "FP16", "BF16"}));
  ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
  tensor->mutable_shape()->Assign(input.shape().begin(), input.shape().end());
  tensor->set_dtype(FloatType(input.datatype()));
  if (InSharedMemory(input)) {
    return ReadSharedMemory(input, count * ElementBytes(input.datatype()), tensor->mutable_shared_memory());
  }
  ASSIGN_OR_RETURN(std::string bytes, TakeBytes(source, count));
  tensor->set_data(std::move(bytes));
  return absl::OkStatus();
}

// attn_mask: a float tensor read as additive, or BOOL read as keep (1 attends), sent as BF16 0 and 1 (exact; half
// of fp32's bytes, so that a mask grows the request it came in at most twice over).
absl::Status ReadMask(const Source& source, v1::Tensor* tensor, v1::MaskType* type) {
  const InferInput& input = *source.input;
  RETURN_IF_ERROR(CheckDatatype(input, {"FP32", "FP16", "BF16", "BOOL"}));
  if (input.datatype() != "BOOL") {
    *type = v1::MASK_ADDITIVE;
    return ReadActivation(source, tensor);
  }
  ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
  ASSIGN_OR_RETURN(const std::string bytes, TakeBytes(source, count));
  constexpr uint16_t kBf16One = 0x3F80;
  std::string values(bytes.size() * sizeof(uint16_t), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != 0 && bytes[i] != 1) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), "[", i, "] is ", static_cast<int>(bytes[i]),
                                                     ", not a BOOL (0 or 1)"));
    }
    const uint16_t value = bytes[i] == 1 ? kBf16One : 0;
    std::memcpy(&values[i * sizeof(value)], &value, sizeof(value));
  }
  tensor->mutable_shape()->Assign(input.shape().begin(), input.shape().end());
  tensor->set_dtype(v1::BF16);
  tensor->set_data(std::move(values));
  *type = v1::MASK_KEEP;
  return absl::OkStatus();
}

// A rank-1 input read as values of type T: key_lengths (INT32 or INT64, each within int32) or head_mask (FP32).
template <typename T>
absl::Status ReadVector(const Source& source, std::initializer_list<const char*> taken,
                        google::protobuf::RepeatedField<T>* out) {
  const InferInput& input = *source.input;
  RETURN_IF_ERROR(CheckDatatype(input, taken));
  if (input.shape_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(input.name(), ": shape [", absl::StrJoin(input.shape(), ", "),
                                                   "] must have one dimension"));
  }
  ASSIGN_OR_RETURN(const int64_t count, ElementCount(input));
  ASSIGN_OR_RETURN(const std::string bytes, TakeBytes(source, count));
  out->Resize(static_cast<int>(count), T{});
  if (input.datatype() != "INT64") {
    std::memcpy(out->mutable_data(), bytes.data(), bytes.size());
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < count; ++i) {
    int64_t value;
    std::memcpy(&value, &bytes[i * sizeof(value)], sizeof(value));
    if (value < 0 || value > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), "[", i, "] is ", value, ", outside [0, 2^31)"));
    }
    (*out)[static_cast<int>(i)] = static_cast<T>(value);
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The most inputs a model takes (the layers': query, key, value, key_lengths, attn_mask, head_mask).
constexpr int kMaxInputs = 6;

// Each input with where its bytes are. INVALID_ARGUMENT for more inputs than a model takes, for a repeated name, for
// raw_input_contents whose count is not that of the inputs outside shared memory, and for an input with both a raw
// entry and typed contents. Linear in the request's size: a client sends as many names as it likes.
absl::StatusOr<std::vector<Source>> Sources(inference::ModelInferRequest* request) {
  if (request->inputs_size() > kMaxInputs) {
    return absl::InvalidArgumentError(absl::StrCat("inputs: ", request->inputs_size(), " given; a model takes at most ",
                                                   kMaxInputs));
  }
  std::vector<Source> sources;
  absl::flat_hash_set<absl::string_view> names;
  int raw_used = 0;
  const bool raw = request->raw_input_contents_size() > 0;
  for (InferInput& input : *request->mutable_inputs()) {
    if (!names.insert(input.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("inputs: '", input.name(), "' is given twice"));
    }
    Source source{&input, nullptr};
    if (raw && !InSharedMemory(input)) {
      if (raw_used < request->raw_input_contents_size()) {
        source.raw = request->mutable_raw_input_contents(raw_used);
      }
      ++raw_used;
      if (input.contents().ByteSizeLong() > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(input.name(), ": has contents and a raw_input_contents entry; send one"));
      }
    }
    sources.push_back(source);
  }
  if (raw && raw_used != request->raw_input_contents_size()) {
    return absl::InvalidArgumentError(absl::StrCat("raw_input_contents: ", request->raw_input_contents_size(),
                                                   " entries for ", raw_used, " inputs outside shared memory"));
  }
  return sources;
}

// What a model's inputs are called and how each is read into the native request.
struct InputRule {
  const char* name;
  bool required;
  bool shared_memory;  // may lie in shared memory
  std::function<absl::Status(const Source&)> read;
};

absl::Status ReadInputs(absl::Span<const Source> sources, absl::Span<const InputRule> rules) {
  std::vector<std::string> names;
  for (const InputRule& rule : rules) names.push_back(rule.name);
  for (const Source& source : sources) {
    if (std::find(names.begin(), names.end(), source.input->name()) == names.end()) {
      return absl::InvalidArgumentError(absl::StrCat("inputs: the model takes no input '", source.input->name(),
                                                     "'; it takes ", absl::StrJoin(names, ", ")));
    }
  }
  for (const InputRule& rule : rules) {
    const Source* found = nullptr;
    for (const Source& source : sources) {
      if (source.input->name() == rule.name) found = &source;
    }
    if (found == nullptr) {
      if (!rule.required) continue;
      return absl::InvalidArgumentError(absl::StrCat("inputs: '", rule.name, "' is missing"));
    }
    if (!rule.shared_memory && InSharedMemory(*found->input)) {
      return absl::InvalidArgumentError(absl::StrCat(rule.name, ": cannot lie in shared memory; only ",
                                                     rules[0].name, ", ", rules[1].name, " and ", rules[2].name,
                                                     " can"));
    }
    RETURN_IF_ERROR(rule.read(*found));
  }
  return absl::OkStatus();
}

// The request's parameters into `heads` (and `backend`, `sink_tokens`): causal, scale, backend, sink_tokens, and
// for sdpa the head configuration. Triton's "priority" and "timeout" are accepted and have no effect here.
absl::Status ReadParameters(const Parameters& params, bool sdpa, v1::HeadConfig* heads, v1::Backend* backend,
                            int32_t* sink_tokens) {
  using P = inference::InferParameter;
  std::vector<std::string> known = {"causal",   "scale",          "backend",    "rope_theta",
                                    "rope_dim", "rope_interleaved", "sink_tokens"};
  if (sdpa) known.insert(known.end(), {"num_heads", "num_kv_heads", "head_dim"});
  for (const auto& [name, value] : params) {
    if (name == "priority" || name == "timeout") continue;
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(absl::StrCat("parameters: '", name, "' is not taken; the model takes ",
                                                     absl::StrJoin(known, ", ")));
    }
    const bool integer = name == "rope_dim" || name == "num_heads" || name == "num_kv_heads" || name == "head_dim" ||
                         name == "sink_tokens";
    const bool real = name == "scale" || name == "rope_theta";
    const bool boolean = name == "causal" || name == "rope_interleaved";
    const P::ParameterChoiceCase want = integer ? P::kInt64Param : real ? P::kDoubleParam
                                        : boolean ? P::kBoolParam : P::kStringParam;
    const bool ok = value.parameter_choice_case() == want ||
                    (real && value.parameter_choice_case() == P::kInt64Param);
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("parameters: '", name, "' must be a ",
                                                     integer ? "int64" : real ? "double" : boolean ? "bool"
                                                                                            : "string"));
    }
    const double number = value.parameter_choice_case() == P::kInt64Param ? value.int64_param() : value.double_param();
    if (integer && (value.int64_param() < 0 || value.int64_param() > std::numeric_limits<int32_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("parameters: '", name, "' is ", value.int64_param(),
                                                     ", outside [0, 2^31)"));
    }
    // The wire's scale is a float: a double that does not survive the conversion (0 or inf from a nonzero finite
    // number) would silently become the default scale, or an error that names no cause.
    const float narrowed = static_cast<float>(number);
    if (name == "scale" && number != 0 && std::isfinite(number) && (narrowed == 0 || !std::isfinite(narrowed))) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters: 'scale' is ", number, ", outside float's range (0 means the default)"));
    }
    if (name == "causal") heads->set_causal(value.bool_param());
    if (name == "scale") heads->set_scale(narrowed);
    if (name == "rope_theta") heads->set_rope_theta(number);
    if (name == "rope_dim") heads->set_rope_dim(static_cast<int32_t>(value.int64_param()));
    if (name == "rope_interleaved") heads->set_rope_interleaved(value.bool_param());
    if (name == "num_heads") heads->set_num_heads(static_cast<int32_t>(value.int64_param()));
    if (name == "num_kv_heads") heads->set_num_kv_heads(static_cast<int32_t>(value.int64_param()));
    if (name == "head_dim") heads->set_head_dim(static_cast<int32_t>(value.int64_param()));
    if (name == "sink_tokens") *sink_tokens = static_cast<int32_t>(value.int64_param());
    if (name == "backend" &&
        !v1::Backend_Parse(absl::StrCat("BACKEND_", absl::AsciiStrToUpper(value.string_param())), backend)) {
      return absl::InvalidArgumentError(absl::StrCat("parameters: backend '", value.string_param(),
                                                     "' is none of auto, cpu, cuda, reference"));
    }
  }
  return absl::OkStatus();
}

// The requested outputs (output alone when none is named); output's shared memory, if any, whose byte size must be
// `output_bytes`, goes to `mutable_ref()`.
template <typename MutableRef>
absl::StatusOr<std::vector<KServeOutput>> ReadOutputs(const inference::ModelInferRequest& request,
                                                      int64_t output_bytes, MutableRef mutable_ref) {
  std::vector<KServeOutput> outputs;
  const bool sdpa = request.model_name() == kSdpaModel;
  for (const auto& wanted : request.outputs()) {
    KServeOutput output = KServeOutput::kOutput;
    bool found = false;
    std::vector<std::string> names;
    for (KServeOutput each : kOutputs) {
      if (sdpa && each == KServeOutput::kContribution) continue;  // there is no W_O
      names.push_back(OutputName(each));
      if (wanted.name() == OutputName(each)) output = each, found = true;
    }
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat("outputs: the model has no output '", wanted.name(),
                                                     "'; it has ", absl::StrJoin(names, ", ")));
    }
    if (std::find(outputs.begin(), outputs.end(), output) != outputs.end()) {
      return absl::InvalidArgumentError(absl::StrCat("outputs: '", wanted.name(), "' is requested twice"));
    }
    for (const auto& [name, value] : wanted.parameters()) {
      if (name == "binary_data") continue;  // HTTP's; gRPC's outputs are always binary
      if (output == KServeOutput::kOutput && absl::StartsWith(name, "shared_memory_")) continue;
      return absl::InvalidArgumentError(absl::StrCat(wanted.name(), ": parameter '", name, "' is not taken",
                                                     absl::StartsWith(name, "shared_memory_")
                                                         ? " (only output can be written to shared memory)"
                                                         : ""));
    }
    if (output == KServeOutput::kOutput && wanted.parameters().count("shared_memory_region") > 0) {
      InferInput as_input;  // ReadSharedMemory reads an input's parameters
      as_input.set_name(wanted.name());
      *as_input.mutable_parameters() = wanted.parameters();
      RETURN_IF_ERROR(ReadSharedMemory(as_input, output_bytes, mutable_ref()));
    }
    outputs.push_back(output);
  }
  if (outputs.empty()) outputs.push_back(KServeOutput::kOutput);
  return outputs;
}

// The bytes of the output, which has the query's (or q's) shape and dtype, as the request's input `name` says.
int64_t OutputBytes(const inference::ModelInferRequest& request, const char* name) {
  for (const InferInput& input : request.inputs()) {
    if (input.name() != name) continue;
    absl::StatusOr<int64_t> count = ElementCount(input);
    return count.ok() ? *count * ElementBytes(input.datatype()) : -1;
  }
  return -1;
}

bool Wants(const std::vector<KServeOutput>& outputs, KServeOutput output) {
  return std::find(outputs.begin(), outputs.end(), output) != outputs.end();
}

// The native request's return_* fields for the outputs a call asked for.
template <typename Request>
void AskFor(const std::vector<KServeOutput>& outputs, Request* r) {
  r->set_return_attention_weights(Wants(outputs, KServeOutput::kAttentionWeights));
  const bool head_stats = std::any_of(outputs.begin(), outputs.end(), IsHeadStat);
  r->set_return_head_stats(head_stats);
  r->set_return_lse(head_stats || Wants(outputs, KServeOutput::kLse));  // the head statistics' [B, H] shape
}

}  // namespace

const char* OutputName(KServeOutput output) {
  switch (output) {
    case KServeOutput::kOutput:
      return "output";
    case KServeOutput::kAttentionWeights:
      return "attention_weights";
    case KServeOutput::kLse:
      return "lse";
    case KServeOutput::kEntropy:
      return "head_entropy";
    case KServeOutput::kNormalizedEntropy:
      return "head_normalized_entropy";
    case KServeOutput::kConfidence:
      return "head_confidence";
    case KServeOutput::kDistance:
      return "head_distance";
    case KServeOutput::kSinkMass:
      return "head_sink_mass";
    case KServeOutput::kContribution:
      return "head_contribution";
  }
  return "output";
}

const char* DatatypeName(v1::DataType dtype) {
  switch (dtype) {
    case v1::FP16:
      return "FP16";
    case v1::BF16:
      return "BF16";
    default:
      return "FP32";
  }
}

absl::Status CheckModelVersion(const std::string& model, const std::string& version) {
  if (version.empty() || version == kModelVersion) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("model '", model, "' has no version '", version, "'; its one version is ",
                                          kModelVersion));
}

absl::StatusOr<KServeCall> TranslateInferRequest(inference::ModelInferRequest* request) {
  ASSIGN_OR_RETURN(std::vector<Source> sources, Sources(request));
  KServeCall call;
  v1::Backend backend = v1::BACKEND_AUTO;
  if (request->model_name() == kSdpaModel) {
    auto sdpa = std::make_unique<v1::ScaledDotProductAttentionRequest>();
    v1::ScaledDotProductAttentionRequest& r = *sdpa;
    v1::MaskType mask_type = v1::MASK_ADDITIVE;
    const InputRule rules[] = {
        {"q", true, true, [&](const Source& s) { return ReadActivation(s, r.mutable_q()); }},
        {"k", true, true, [&](const Source& s) { return ReadActivation(s, r.mutable_k()); }},
        {"v", true, true, [&](const Source& s) { return ReadActivation(s, r.mutable_v()); }},
        {"key_lengths", false, false,
         [&](const Source& s) { return ReadVector(s, {"INT32", "INT64"}, r.mutable_key_lengths()); }},
        {"attn_mask", false, false, [&](const Source& s) { return ReadMask(s, r.mutable_attn_mask(), &mask_type); }},
    };
    RETURN_IF_ERROR(ReadInputs(sources, rules));
    r.set_attn_mask_type(mask_type);
    int32_t sink_tokens = 0;
    RETURN_IF_ERROR(
        ReadParameters(request->parameters(), /*sdpa=*/true, r.mutable_heads(), &backend, &sink_tokens));
    r.set_backend(backend);
    r.set_sink_tokens(sink_tokens);
    ASSIGN_OR_RETURN(call.outputs, ReadOutputs(*request, OutputBytes(*request, "q"),
                                               [&r] { return r.mutable_output_shared_memory(); }));
    AskFor(call.outputs, &r);
    call.sdpa = std::move(sdpa);
    return call;
  }
  auto mha = std::make_unique<v1::MultiHeadAttentionRequest>();
  v1::MultiHeadAttentionRequest& r = *mha;
  r.set_layer(request->model_name());
  v1::MaskType mask_type = v1::MASK_ADDITIVE;
  const InputRule rules[] = {
      {"query", true, true, [&](const Source& s) { return ReadActivation(s, r.mutable_query()); }},
      {"key", false, true, [&](const Source& s) { return ReadActivation(s, r.mutable_key()); }},
      {"value", false, true, [&](const Source& s) { return ReadActivation(s, r.mutable_value()); }},
      {"key_lengths", false, false,
       [&](const Source& s) { return ReadVector(s, {"INT32", "INT64"}, r.mutable_key_lengths()); }},
      {"attn_mask", false, false, [&](const Source& s) { return ReadMask(s, r.mutable_attn_mask(), &mask_type); }},
      {"head_mask", false, false, [&](const Source& s) { return ReadVector(s, {"FP32"}, r.mutable_head_mask()); }},
  };
  RETURN_IF_ERROR(ReadInputs(sources, rules));
  r.set_attn_mask_type(mask_type);
  v1::HeadConfig heads;
  int32_t sink_tokens = 0;
  RETURN_IF_ERROR(ReadParameters(request->parameters(), /*sdpa=*/false, &heads, &backend, &sink_tokens));
  if (heads.ByteSizeLong() > 0) *r.mutable_heads() = heads;
  r.set_backend(backend);
  r.set_sink_tokens(sink_tokens);
  ASSIGN_OR_RETURN(call.outputs,
                   ReadOutputs(*request, OutputBytes(*request, "query"),
                               [&r] { return r.mutable_output_shared_memory(); }));
  AskFor(call.outputs, &r);
  call.mha = std::move(mha);
  return call;
}

}  // namespace mha
