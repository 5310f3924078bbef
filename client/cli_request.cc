#include "client/cli_request.h"

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/npy.h"
#include "proto/mha/v1/safetensors.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(std::string, query, "", "query [B, Tq, d_model] from this .npy file (float32 or float16); default random");
ABSL_FLAG(std::string, key, "", "key [B, Tk, d_kv_in] from this .npy file; default: self-attention (or --kv_seq)");
ABSL_FLAG(std::string, value, "", "value [B, Tk, d_v_in] from this .npy file; default: the key");
ABSL_FLAG(int64_t, batch, 0, "B of random inputs (default 1); not with --query");
ABSL_FLAG(int64_t, seq, 0, "Tq of the random query (default 16); not with --query");
ABSL_FLAG(int64_t, kv_seq, 0, "Tk of random key and value (cross-attention); 0 = self-attention; not with --key");
ABSL_FLAG(int, seed, 1, "seed of the random inputs (uniform in [-1, 1])");
ABSL_FLAG(std::string, layer, "", "registered layer to use (default demo); not with --weights_file");
ABSL_FLAG(std::string, weights_file, "",
          "send the weights inline from this .safetensors file (w_q w_k w_v w_o, optional b_*, num_heads etc. in "
          "__metadata__)");
ABSL_FLAG(int, heads, 0, "H query heads (overrides the weights file; checked against a named layer)");
ABSL_FLAG(int, kv_heads, 0, "Hkv key/value heads: 1 = MQA, a divisor of H = GQA; 0 = H");
ABSL_FLAG(int, head_dim, 0, "d_k; 0 = d_model / H");
ABSL_FLAG(bool, causal, false, "causal (bottom-right aligned) masking");
ABSL_FLAG(double, scale, 0, "multiplies Q K^T; 0 = 1 / sqrt(d_k)");
ABSL_FLAG(std::string, key_lengths, "", "comma-separated valid key count per batch item, e.g. 16,5");
ABSL_FLAG(std::string, head_mask, "", "comma-separated factor per head, e.g. 1,0,1,1 (head ablation)");
ABSL_FLAG(bool, weights, false, "also return the per-head attention weights [B, H, Tq, Tk]");
ABSL_FLAG(std::string, dtype, "",
          "wire dtype of the inputs: fp32, fp16 or bf16 (default: each .npy's own dtype; fp32 for random inputs)");
ABSL_FLAG(std::string, output_dtype, "", "dtype of the response tensors: fp32, fp16 or bf16 (default: the query's)");
ABSL_FLAG(std::string, backend, "auto", "auto, cpu, reference or cuda");

ABSL_DECLARE_FLAG(std::string, weights_output);

namespace mha::cli {
namespace {

constexpr int64_t kDefaultBatch = 1, kDefaultSeq = 16;

absl::Status Usage(absl::string_view message) { return absl::InvalidArgumentError(message); }

// n values uniform in [-1, 1) from `seed` (a fixed LCG, so a seed means the same inputs on every machine).
std::vector<float> RandomUniform(int64_t n, uint32_t seed) {
  std::vector<float> values(n);
  uint32_t state = seed * 2654435761u + 1;
  for (float& x : values) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) / static_cast<float>(1 << 23) - 1.0f;
  }
  return values;
}

// Random inputs of `shape` (named `what` in errors, e.g. "the random query [--batch, --seq, d_model]"). The size is
// checked with overflow-safe arithmetic before anything is allocated: at most what one gRPC message can carry.
absl::Status RandomTensor(std::vector<int64_t> shape, absl::string_view what, uint32_t seed, v1::DataType dtype,
                          v1::Tensor* tensor) {
  constexpr int64_t kMaxMessageBytes = int64_t{2047} << 20;  // gRPC's limit is below 2 GiB
  absl::StatusOr<int64_t> n = CheckedElementCount(shape, what);
  if (!n.ok()) return n.status();
  const int64_t bytes_per_element = static_cast<int64_t>(DTypeSize(dtype));
  if (*n > kMaxMessageBytes / bytes_per_element) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", ShapeString(shape), " would be ", *n, " elements of ",
                                                   bytes_per_element, " bytes, over the 2047 MiB one gRPC message "
                                                   "can carry"));
  }
  FloatsToTensor(RandomUniform(*n, seed), shape, dtype, tensor);
  return absl::OkStatus();
}

// Reads a rank-3 input; re-encodes it when a wire dtype is given.
absl::Status LoadInput(const std::string& path, const char* flag, const char* layout, v1::DataType wire_dtype,
                       v1::Tensor* tensor) {
  absl::StatusOr<NpyArray> array = ReadNpy(path);
  if (!array.ok()) return array.status();
  if (absl::Status s = NpyToTensor(*array, 3, absl::StrCat("--", flag, " ", path), layout, tensor); !s.ok()) {
    return s;
  }
  if (wire_dtype != v1::DATA_TYPE_UNSPECIFIED && wire_dtype != tensor->dtype()) {
    const std::vector<float> values = TensorToFloats(*tensor);
    const std::vector<int64_t> shape(tensor->shape().begin(), tensor->shape().end());
    FloatsToTensor(values, shape, wire_dtype, tensor);
  }
  return absl::OkStatus();
}

absl::Status CheckMatrix(const v1::Tensor& tensor, const char* name, absl::string_view origin) {
  if (tensor.shape_size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": tensor '", name, "' has shape ",
                                                   ShapeString(tensor.shape()), "; expected [in, out]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Backend> ParseBackend(const std::string& name) {
  if (name == "auto") return v1::BACKEND_AUTO;
  if (name == "cpu") return v1::BACKEND_CPU;
  if (name == "reference") return v1::BACKEND_REFERENCE;
  if (name == "cuda") return v1::BACKEND_CUDA;
  return Usage(absl::StrCat("--backend must be auto, cpu, reference or cuda; got '", name, "'"));
}

absl::StatusOr<v1::DataType> ParseDtype(const std::string& name, const std::string& flag) {
  if (name.empty()) return v1::DATA_TYPE_UNSPECIFIED;
  if (name == "fp32") return v1::FP32;
  if (name == "fp16") return v1::FP16;
  if (name == "bf16") return v1::BF16;
  return Usage(absl::StrCat("--", flag, " must be fp32, fp16 or bf16; got '", name, "'"));
}

absl::StatusOr<v1::DataType> ParseCacheDtype(const std::string& name, const std::string& flag) {
  if (name == "int8") return v1::INT8;
  if (name == "fp8_e4m3") return v1::FP8_E4M3;
  if (name == "fp8_e5m2") return v1::FP8_E5M2;
  if (name == "fp32" || name == "fp16" || name == "bf16") return ParseDtype(name, flag);
  return Usage(absl::StrCat("--", flag, " must be fp32, fp16, bf16, int8, fp8_e4m3 or fp8_e5m2; got '", name, "'"));
}

absl::StatusOr<RequestFlags> RequestFlagsFromCommandLine() {
  RequestFlags f;
  f.query_path = absl::GetFlag(FLAGS_query);
  f.key_path = absl::GetFlag(FLAGS_key);
  f.value_path = absl::GetFlag(FLAGS_value);
  f.batch = absl::GetFlag(FLAGS_batch);
  f.seq = absl::GetFlag(FLAGS_seq);
  f.kv_seq = absl::GetFlag(FLAGS_kv_seq);
  f.seed = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed));
  f.layer = absl::GetFlag(FLAGS_layer);
  f.weights_file = absl::GetFlag(FLAGS_weights_file);
  f.heads = absl::GetFlag(FLAGS_heads);
  f.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  f.head_dim = absl::GetFlag(FLAGS_head_dim);
  f.causal = absl::GetFlag(FLAGS_causal);
  f.return_weights = absl::GetFlag(FLAGS_weights) || !absl::GetFlag(FLAGS_weights_output).empty();

  for (const auto& [value, name] : {std::pair<int64_t, const char*>{f.batch, "batch"}, {f.seq, "seq"},
                                    {f.kv_seq, "kv_seq"}, {f.heads, "heads"}, {f.kv_heads, "kv_heads"},
                                    {f.head_dim, "head_dim"}}) {
    if (value < 0) return Usage(absl::StrCat("--", name, " must be >= 0; got ", value));
  }
  if (!f.query_path.empty() && (f.batch != 0 || f.seq != 0)) {
    return Usage("--batch and --seq shape the random query; they cannot be combined with --query");
  }
  if (!f.key_path.empty() && f.kv_seq != 0) {
    return Usage("--kv_seq shapes the random key; it cannot be combined with --key");
  }
  if (!f.value_path.empty() && f.key_path.empty()) return Usage("--value needs --key");
  if (!f.layer.empty() && !f.weights_file.empty()) {
    return Usage("give either --layer or --weights_file, not both");
  }
  const double scale = absl::GetFlag(FLAGS_scale);
  if (!std::isfinite(scale) || scale < 0) {
    return Usage(absl::StrCat("--scale must be a finite number >= 0; got ", scale));
  }
  f.scale = static_cast<float>(scale);
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_key_lengths), ',', absl::SkipEmpty())) {
    int32_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 0) {
      return Usage(absl::StrCat("--key_lengths: '", part, "' is not a non-negative integer"));
    }
    f.key_lengths.push_back(n);
  }
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_head_mask), ',', absl::SkipEmpty())) {
    float x = 0;
    if (!absl::SimpleAtof(part, &x) || !std::isfinite(x)) {
      return Usage(absl::StrCat("--head_mask: '", part, "' is not a finite number"));
    }
    f.head_mask.push_back(x);
  }
  absl::StatusOr<v1::DataType> dtype = ParseDtype(absl::GetFlag(FLAGS_dtype), "dtype");
  if (!dtype.ok()) return dtype.status();
  f.wire_dtype = *dtype;
  absl::StatusOr<v1::DataType> output_dtype = ParseDtype(absl::GetFlag(FLAGS_output_dtype), "output_dtype");
  if (!output_dtype.ok()) return output_dtype.status();
  f.output_dtype = *output_dtype;
  absl::StatusOr<v1::Backend> backend = ParseBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return backend.status();
  f.backend = *backend;
  return f;
}

namespace {

// The inline weights of a .safetensors file (--weights), with the head configuration the flags ask for.
absl::Status UseWeightsFile(const RequestFlags& flags, PreparedRequest* prepared) {
  v1::MultiHeadAttentionRequest& request = prepared->request;
  AttentionShape& shape = prepared->shape;
  absl::StatusOr<SafetensorsLayer> layer = ReadSafetensorsLayer(flags.weights_file);
  if (!layer.ok()) return layer.status();
  const v1::AttentionWeights& w = layer->weights;
  for (const auto& [tensor, name] : {std::pair<const v1::Tensor*, const char*>{&w.w_q(), "w_q"},
                                     {&w.w_k(), "w_k"}, {&w.w_v(), "w_v"}}) {
    if (absl::Status s = CheckMatrix(*tensor, name, flags.weights_file); !s.ok()) return s;
  }
  v1::HeadConfig heads = layer->heads;
  if (flags.heads != 0) heads.set_num_heads(flags.heads);
  if (flags.kv_heads != 0) heads.set_num_kv_heads(flags.kv_heads);
  if (flags.head_dim != 0) heads.set_head_dim(flags.head_dim);
  if (flags.causal) heads.set_causal(true);
  if (flags.scale != 0) heads.set_scale(flags.scale);
  *request.mutable_inline_weights() = w;
  *request.mutable_heads() = heads;
  shape.d_model = w.w_q().shape(0);
  shape.d_kv_in = w.w_k().shape(0);
  shape.d_v_in = w.w_v().shape(0);
  absl::StatusOr<HeadSpec> resolved = ResolveHeads(heads, HeadSpec(), "", shape.d_model, "heads");
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flags.weights_file, ": ", resolved.status().message()));
  }
  shape.heads = *resolved;
  prepared->weights = absl::StrCat("file ", flags.weights_file);
  return absl::OkStatus();
}

// A layer registered on the server (--layer, default "demo"), with the heads the flags ask for.
absl::Status UseLayer(const RequestFlags& flags, AttentionClient& client, PreparedRequest* prepared) {
  v1::MultiHeadAttentionRequest& request = prepared->request;
  AttentionShape& shape = prepared->shape;
  const bool heads_given =
      flags.heads != 0 || flags.kv_heads != 0 || flags.head_dim != 0 || flags.causal || flags.scale != 0;
  const std::string name = flags.layer.empty() ? "demo" : flags.layer;
  absl::StatusOr<v1::ListLayersResponse> layers = client.ListLayers();
  if (!layers.ok()) return layers.status();
  const v1::LayerInfo* info = nullptr;
  for (const v1::LayerInfo& layer : layers->layers()) {
    if (layer.name() == name) info = &layer;
  }
  if (info == nullptr) return absl::NotFoundError(absl::StrCat("no layer named ", name));
  request.set_layer(name);
  if (heads_given) {
    v1::HeadConfig* heads = request.mutable_heads();
    heads->set_num_heads(flags.heads);
    heads->set_num_kv_heads(flags.kv_heads);
    heads->set_head_dim(flags.head_dim);
    heads->set_causal(flags.causal);
    heads->set_scale(flags.scale);
  }
  shape.d_model = info->d_model();
  shape.d_kv_in = info->d_kv_in();
  shape.d_v_in = info->d_v_in();
  // The layer's heads as the server resolved them, with what the flags ask for; flags the layer contradicts are
  // still sent, for the server to refuse (so that `bench` measures that answer too).
  HeadSpec layer_heads;
  layer_heads.num_heads = info->heads().num_heads();
  layer_heads.num_kv_heads = info->heads().num_kv_heads();
  layer_heads.head_dim = info->heads().head_dim();
  layer_heads.scale = info->heads().scale();
  layer_heads.causal = info->heads().causal();
  absl::StatusOr<HeadSpec> resolved = ResolveHeads(
      request.heads(), layer_heads, absl::StrCat("layer '", name, "'"), shape.d_model, "heads");
  shape.heads = resolved.ok() ? *resolved : layer_heads;
  prepared->weights = absl::StrCat("layer ", name);
  return absl::OkStatus();
}

// The query (--query, or random [--batch, --seq, d_model]), key and value (--key/--value, or random with
// --kv_seq, or self-attention), and the rest of the request's fields.
absl::Status FillInputs(const RequestFlags& flags, PreparedRequest* prepared) {
  v1::MultiHeadAttentionRequest& request = prepared->request;
  AttentionShape& shape = prepared->shape;
  const v1::DataType random_dtype = flags.wire_dtype != v1::DATA_TYPE_UNSPECIFIED ? flags.wire_dtype : v1::FP32;
  if (!flags.query_path.empty()) {
    if (absl::Status s = LoadInput(flags.query_path, "query", "[B, Tq, d_model]", flags.wire_dtype,
                                   request.mutable_query());
        !s.ok()) {
      return s;
    }
  } else {
    const int64_t batch = flags.batch != 0 ? flags.batch : kDefaultBatch;
    const int64_t seq = flags.seq != 0 ? flags.seq : kDefaultSeq;
    if (absl::Status s = RandomTensor({batch, seq, shape.d_model}, "the random query [--batch, --seq, d_model]",
                                      flags.seed, random_dtype, request.mutable_query());
        !s.ok()) {
      return s;
    }
  }
  shape.batch = request.query().shape(0);
  shape.q_len = request.query().shape(1);
  if (!flags.key_path.empty()) {
    if (absl::Status s =
            LoadInput(flags.key_path, "key", "[B, Tk, d_kv_in]", flags.wire_dtype, request.mutable_key());
        !s.ok()) {
      return s;
    }
    if (!flags.value_path.empty()) {
      if (absl::Status s = LoadInput(flags.value_path, "value", "[B, Tk, d_v_in]", flags.wire_dtype,
                                     request.mutable_value());
          !s.ok()) {
        return s;
      }
    }
    shape.kv_len = request.key().shape(1);
  } else if (flags.kv_seq != 0) {
    for (auto [dims, what, seed, tensor] :
         {std::tuple{std::vector<int64_t>{shape.batch, flags.kv_seq, shape.d_kv_in},
                     "the random key [--batch, --kv_seq, d_kv_in]", flags.seed + 1, request.mutable_key()},
          std::tuple{std::vector<int64_t>{shape.batch, flags.kv_seq, shape.d_v_in},
                     "the random value [--batch, --kv_seq, d_v_in]", flags.seed + 2, request.mutable_value()}}) {
      if (absl::Status s = RandomTensor(dims, what, seed, random_dtype, tensor); !s.ok()) return s;
    }
    shape.kv_len = flags.kv_seq;
  } else {
    if (shape.d_kv_in != shape.d_model || shape.d_v_in != shape.d_model) {
      return absl::InvalidArgumentError(absl::StrCat(prepared->weights, " takes keys of ", shape.d_kv_in,
                                                     " and values of ", shape.d_v_in, " features, not d_model ",
                                                     shape.d_model, "; give --key or --kv_seq"));
    }
    shape.kv_len = shape.q_len;
  }

  for (int32_t n : flags.key_lengths) request.add_key_lengths(n);
  for (float x : flags.head_mask) request.add_head_mask(x);
  request.set_return_attention_weights(flags.return_weights);
  request.set_output_dtype(flags.output_dtype);
  request.set_backend(flags.backend);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreparedRequest> PrepareRequest(const RequestFlags& flags, AttentionClient& client) {
  PreparedRequest prepared;
  absl::Status status =
      flags.weights_file.empty() ? UseLayer(flags, client, &prepared) : UseWeightsFile(flags, &prepared);
  if (status.ok()) status = FillInputs(flags, &prepared);
  if (!status.ok()) return status;
  return prepared;
}

}  // namespace mha::cli
