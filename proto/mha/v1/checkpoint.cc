#include "proto/mha/v1/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "proto/mha/v1/safetensors.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

using Json = nlohmann::json;

absl::Status Invalid(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

// Member `key` of `o`, or null when `o` is no object or lacks it (nlohmann's const operator[] must not see a missing
// key).
const Json& Field(const Json& o, const char* key) {
  static const Json kNull;
  if (!o.is_object()) return kNull;
  const auto it = o.find(key);
  return it == o.end() ? kNull : *it;
}
std::string String(const Json& o, const char* key, const std::string& fallback) {
  const Json& v = Field(o, key);
  return v.is_string() ? v.get<std::string>() : fallback;
}
bool Bool(const Json& o, const char* key, bool fallback) {
  const Json& v = Field(o, key);
  return v.is_boolean() ? v.get<bool>() : fallback;
}

// A matrix or vector of one checkpoint tensor, in its stored dtype; a vector is one row.
struct Matrix {
  v1::DataType dtype = v1::FP32;
  int64_t rows = 0, cols = 0;
  std::string bytes;

  size_t element() const { return DTypeSize(dtype); }
  // Rows [first, first + n).
  Matrix Rows(int64_t first, int64_t n) const {
    return {dtype, n, cols, bytes.substr(first * cols * element(), n * cols * element())};
  }
  // Columns [first, first + n) of every row.
  Matrix Columns(int64_t first, int64_t n) const {
    Matrix out{dtype, rows, n, {}};
    for (int64_t r = 0; r < rows; ++r) out.bytes += bytes.substr((r * cols + first) * element(), n * element());
    return out;
  }
  Matrix Transposed() const {
    Matrix out{dtype, cols, rows, std::string(bytes.size(), '\0')};
    const size_t e = element();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) std::memcpy(&out.bytes[(c * rows + r) * e], &bytes[(r * cols + c) * e], e);
    }
    return out;
  }
  void Append(const Matrix& below) {
    rows += below.rows;
    bytes += below.bytes;
  }
  v1::Tensor Tensor(bool vector) const {
    v1::Tensor t;
    t.set_dtype(dtype);
    if (!vector) t.add_shape(rows);
    t.add_shape(vector ? rows * cols : cols);
    t.set_data(bytes);
    return t;
  }
};

// The checkpoint's safetensors files: which holds each tensor, and their headers, read once each.
class Shards {
 public:
  static absl::StatusOr<Shards> Open(const std::string& dir);
  bool Has(const std::string& name) const { return file_of_.count(name) != 0; }
  absl::StatusOr<Matrix> Read(const std::string& name);

 private:
  absl::StatusOr<const Json*> Header(const std::string& file);

  std::string dir_;
  std::map<std::string, std::string> file_of_;  // tensor -> file in dir_
  std::map<std::string, std::pair<Json, uint64_t>> headers_;  // file -> (header, its length)
};

absl::StatusOr<Json> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be opened"));
  Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Invalid(path, "is not a JSON object");
  return j;
}

absl::StatusOr<Shards> Shards::Open(const std::string& dir) {
  Shards shards;
  shards.dir_ = dir;
  const std::string index = dir + "/model.safetensors.index.json";
  if (std::ifstream(index)) {
    absl::StatusOr<Json> j = ReadJson(index);
    if (!j.ok()) return j.status();
    if (!(*j)["weight_map"].is_object()) return Invalid(index, "has no weight_map object");
    for (const auto& [tensor, file] : (*j)["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        return Invalid(index, absl::StrCat("weight_map.", tensor, " must name a file in the folder"));
      }
      shards.file_of_[tensor] = file.get<std::string>();
    }
    return shards;
  }
  absl::StatusOr<const Json*> header = shards.Header("model.safetensors");
  if (!header.ok()) return header.status();
  for (const auto& [tensor, unused] : (*header)->items()) {
    if (tensor != "__metadata__") shards.file_of_[tensor] = "model.safetensors";
  }
  return shards;
}

absl::StatusOr<const Json*> Shards::Header(const std::string& file) {
  if (auto it = headers_.find(file); it != headers_.end()) return &it->second.first;
  const std::string path = dir_ + "/" + file;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be opened"));
  uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), 8);
  if (!in || length > kMaxSafetensorsHeaderBytes) return Invalid(path, "has no safetensors header");
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  if (!in) return Invalid(path, "has no safetensors header");
  absl::StatusOr<Json> header = ParseSafetensorsHeader(text, path);
  if (!header.ok()) return header.status();
  return &(headers_[file] = {std::move(*header), length}).first;
}

// A size of a tensor's shape: an integer in [1, 2^24].
bool Dim(const Json& v, int64_t* out) {
  if (!v.is_number_unsigned() || v.get<uint64_t>() < 1 || v.get<uint64_t>() > (uint64_t{1} << 24)) return false;
  *out = v.get<int64_t>();
  return true;
}

absl::StatusOr<Matrix> Shards::Read(const std::string& name) {
  const auto file = file_of_.find(name);
  if (file == file_of_.end()) return absl::NotFoundError(absl::StrCat("the checkpoint has no tensor ", name));
  absl::StatusOr<const Json*> header = Header(file->second);
  if (!header.ok()) return header.status();
  const std::string path = dir_ + "/" + file->second, where = absl::StrCat(path, ": ", name);
  const Json& entry = Field(**header, name.c_str());
  Matrix m;
  m.dtype = SafetensorsDtype(String(entry, "dtype", ""));
  if (m.dtype == v1::DATA_TYPE_UNSPECIFIED) return Invalid(where, "must be a tensor of the file, F32, F16 or BF16");
  const Json& shape = Field(entry, "shape");
  if (!shape.is_array() || shape.empty() || shape.size() > 2 || !Dim(shape.back(), &m.cols) ||
      !(shape.size() == 1 ? (m.rows = 1) : Dim(shape[0], &m.rows))) {
    return Invalid(where, "must be 1-d or 2-d, each size in [1, 2^24]");
  }
  const Json& offsets = Field(entry, "data_offsets");
  const uint64_t bytes = static_cast<uint64_t>(m.rows * m.cols) * m.element();
  std::error_code ec;
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned() || offsets[1].get<uint64_t>() < offsets[0].get<uint64_t>() ||
      offsets[1].get<uint64_t>() - offsets[0].get<uint64_t>() != bytes || ec ||
      8 + headers_[file->second].second + offsets[1].get<uint64_t>() > file_bytes) {
    return Invalid(where, "has data_offsets that do not match its shape or lie past the end of its file");
  }
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(8 + headers_[file->second].second + offsets[0].get<uint64_t>()));
  m.bytes.resize(bytes);
  in.read(m.bytes.data(), static_cast<std::streamsize>(bytes));
  if (!in) return Invalid(where, "could not be read");
  return m;
}

// 1-row matrices side by side (pieces of a bias vector).
Matrix JoinColumns(const std::vector<Matrix>& pieces) {
  Matrix out{pieces.front().dtype, 1, 0, {}};
  for (const Matrix& m : pieces) {
    out.cols += m.cols;
    out.bytes += m.bytes;
  }
  return out;
}

// config.json's number under the first of `keys` it holds (null counts as absent); `fallback` when none does.
double Number(const Json& c, std::initializer_list<const char*> keys, double fallback) {
  for (const char* key : keys) {
    if (Field(c, key).is_number()) return Field(c, key).get<double>();
  }
  return fallback;
}

absl::StatusOr<int64_t> Count(const Json& c, std::initializer_list<const char*> keys) {
  const double n = Number(c, keys, -1);
  if (n < 1 || n != std::floor(n)) {
    return Invalid("config.json", absl::StrCat(absl::StrJoin(keys, " or "), " must be a positive integer"));
  }
  return static_cast<int64_t>(n);
}

// The model's rope_scaling as RopeScaling (none for rope_type default): transformers 4's rope_scaling or 5's
// rope_parameters, with max_position_embeddings and original_max_position_embeddings filled in as transformers'
// standardize_rope_params fills them.
absl::Status RopeScalingOf(const Json& c, v1::RopeScaling* out) {
  Json scaling = Field(c, "rope_scaling").is_object()      ? Field(c, "rope_scaling")
                 : Field(c, "rope_parameters").is_object() ? Field(c, "rope_parameters")
                                                           : Json::object();
  const std::string type = String(scaling, "rope_type", String(scaling, "type", "default"));
  if (type == "default") return absl::OkStatus();
  const double max_positions = Number(c, {"max_position_embeddings", "n_positions"}, 0);
  if ((type == "dynamic" || type == "yarn" || type == "longrope") && !scaling.contains("max_position_embeddings")) {
    scaling["max_position_embeddings"] = static_cast<int64_t>(max_positions);
  }
  if (type == "llama3" || type == "yarn" || type == "longrope") {
    const double original = Number(c, {"original_max_position_embeddings"}, 0);
    if (original > 0) {
      scaling["original_max_position_embeddings"] = static_cast<int64_t>(original);  // Phi-3's, which wins
    } else if (!scaling.contains("original_max_position_embeddings")) {
      scaling["original_max_position_embeddings"] = static_cast<int64_t>(max_positions);
    }
  }
  const absl::Status status = RopeScalingFromJson(scaling.dump(), out);
  return status.ok() ? status : Invalid("config.json: rope_scaling", status.message());
}

// The layer's heads as the model computes them: counts, the scale, RoPE.
absl::StatusOr<v1::HeadConfig> HeadsOf(const Json& c, const std::string& type, int64_t layer) {
  v1::HeadConfig h;
  absl::StatusOr<int64_t> heads = Count(c, {"num_attention_heads", "n_head"});
  absl::StatusOr<int64_t> hidden = Count(c, {"hidden_size", "n_embd"});
  if (!heads.ok()) return heads.status();
  if (!hidden.ok()) return hidden.status();
  const double head_dim = Number(c, {"head_dim"}, static_cast<double>(*hidden / *heads));
  const double kv_heads = Number(c, {"num_key_value_heads"}, static_cast<double>(*heads));
  if (*heads > 65536 || !(head_dim >= 1 && head_dim <= 65536) || !(kv_heads >= 1 && kv_heads <= *heads)) {
    return Invalid("config.json", "num_attention_heads, num_key_value_heads and head_dim must be in [1, 65536] (and "
                                  "num_key_value_heads at most num_attention_heads)");
  }
  h.set_num_heads(static_cast<int32_t>(*heads));
  h.set_num_kv_heads(static_cast<int32_t>(kv_heads));
  h.set_head_dim(static_cast<int32_t>(head_dim));
  h.set_causal(true);
  if (type == "gpt2") {  // no RoPE; GPT-2's optional scalings of the scores
    const double scale = Bool(c, "scale_attn_weights", true) ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
    h.set_scale(static_cast<float>(Bool(c, "scale_attn_by_inverse_layer_idx", false) ? scale / (layer + 1) : scale));
    return h;
  }
  const Json& params = Field(c, "rope_parameters");  // Number() reads nothing from a null
  h.set_rope_theta(Number(c, {"rope_theta", "rotary_emb_base"}, Number(params, {"rope_theta"}, 10000)));
  const double partial =
      Number(c, {"partial_rotary_factor", "rotary_pct"}, Number(params, {"partial_rotary_factor"}, 1));
  h.set_rope_dim(static_cast<int32_t>(std::clamp(head_dim * partial, 0.0, head_dim)));  // transformers: int(d x factor)
  if (absl::Status s = RopeScalingOf(c, h.mutable_rope_scaling()); !s.ok()) return s;
  if (h.rope_scaling().rope_type().empty()) h.clear_rope_scaling();
  return h;
}

// The service attends to every earlier token; a model with a sliding window does not, past the window.
absl::Status CheckWindow(const Json& c, const std::string& type, bool ignore_window) {
  const bool windowed = type == "qwen2" ? Bool(c, "use_sliding_window", false) : Field(c, "sliding_window").is_number();
  if (!windowed || ignore_window) return absl::OkStatus();
  return Invalid("config.json", absl::StrCat("sliding_window is ", Field(c, "sliding_window").dump(),
                                             ": the model attends within a window of that many tokens, which the "
                                             "service does not compute (its layers see every earlier token); "
                                             "contexts within the window compute the same (mha_client load "
                                             "--ignore_sliding_window loads it anyway)"));
}

// nn.Linear `name` ([out, in], optional bias) as W [in, out] into *w, and its bias, when it has one, into *b.
absl::Status Linear(Shards& shards, const std::string& name, v1::Tensor* w, std::optional<v1::Tensor>* b) {
  absl::StatusOr<Matrix> weight = shards.Read(name + ".weight");
  if (!weight.ok()) return weight.status();
  *w = weight->Transposed().Tensor(false);
  if (!shards.Has(name + ".bias")) return absl::OkStatus();
  absl::StatusOr<Matrix> bias = shards.Read(name + ".bias");
  if (!bias.ok()) return bias.status();
  *b = bias->Tensor(true);
  return absl::OkStatus();
}

// LLaMA, Mistral, Qwen2: q_proj, k_proj, v_proj, o_proj (Qwen2's with q, k, v biases).
absl::StatusOr<v1::AttentionWeights> SeparateWeights(Shards& shards, const std::string& prefix) {
  v1::AttentionWeights w;
  std::optional<v1::Tensor> b[4];
  for (absl::Status s : {Linear(shards, prefix + "q_proj", w.mutable_w_q(), &b[0]),
                         Linear(shards, prefix + "k_proj", w.mutable_w_k(), &b[1]),
                         Linear(shards, prefix + "v_proj", w.mutable_w_v(), &b[2]),
                         Linear(shards, prefix + "o_proj", w.mutable_w_o(), &b[3])}) {
    if (!s.ok()) return s;
  }
  if (b[0]) *w.mutable_b_q() = *b[0];
  if (b[1]) *w.mutable_b_k() = *b[1];
  if (b[2]) *w.mutable_b_v() = *b[2];
  if (b[3]) *w.mutable_b_o() = *b[3];
  return w;
}

// o_proj (Phi-3) or dense (GPT-NeoX) into w_o and, when it has one, b_o.
absl::Status OutputLinear(Shards& shards, const std::string& name, v1::AttentionWeights* w) {
  std::optional<v1::Tensor> bias;
  if (absl::Status s = Linear(shards, name, w->mutable_w_o(), &bias); !s.ok()) return s;
  if (bias) *w->mutable_b_o() = *bias;
  return absl::OkStatus();
}

// Phi-3: qkv_proj's rows are q (H d_k), then k and v (Hkv d_k each).
absl::StatusOr<v1::AttentionWeights> Phi3Weights(Shards& shards, const std::string& prefix, const v1::HeadConfig& h) {
  v1::AttentionWeights w;
  absl::StatusOr<Matrix> qkv = shards.Read(prefix + "qkv_proj.weight");
  if (!qkv.ok()) return qkv.status();
  const int64_t q = int64_t{h.num_heads()} * h.head_dim(), kv = int64_t{h.num_kv_heads()} * h.head_dim();
  if (qkv->rows != q + 2 * kv) return Invalid(prefix + "qkv_proj.weight", "has other than (H + 2 Hkv) d_k rows");
  *w.mutable_w_q() = qkv->Rows(0, q).Transposed().Tensor(false);
  *w.mutable_w_k() = qkv->Rows(q, kv).Transposed().Tensor(false);
  *w.mutable_w_v() = qkv->Rows(q + kv, kv).Transposed().Tensor(false);
  if (absl::Status s = OutputLinear(shards, prefix + "o_proj", &w); !s.ok()) return s;
  return w;
}

// GPT-2: Conv1D weights are stored [in, out] already; c_attn's columns are q, k, v.
absl::StatusOr<v1::AttentionWeights> Gpt2Weights(Shards& shards, const std::string& prefix) {
  v1::AttentionWeights w;
  absl::StatusOr<Matrix> qkv = shards.Read(prefix + "c_attn.weight"), bias = shards.Read(prefix + "c_attn.bias");
  absl::StatusOr<Matrix> out = shards.Read(prefix + "c_proj.weight"), out_bias = shards.Read(prefix + "c_proj.bias");
  for (const auto* m : {&qkv, &bias, &out, &out_bias}) {
    if (!m->ok()) return m->status();
  }
  const int64_t d = qkv->cols / 3;
  if (qkv->cols % 3 != 0 || bias->rows != 1 || bias->cols != qkv->cols) {
    return Invalid(prefix + "c_attn", "must be [d, 3 d] with a bias of 3 d");
  }
  v1::Tensor* weights[] = {w.mutable_w_q(), w.mutable_w_k(), w.mutable_w_v()};
  v1::Tensor* biases[] = {w.mutable_b_q(), w.mutable_b_k(), w.mutable_b_v()};
  for (int k = 0; k < 3; ++k) {
    *weights[k] = qkv->Columns(k * d, d).Tensor(false);
    *biases[k] = bias->Columns(k * d, d).Tensor(true);
  }
  *w.mutable_w_o() = out->Tensor(false);
  *w.mutable_b_o() = out_bias->Tensor(true);
  return w;
}

// GPT-NeoX: query_key_value's rows are, head by head, that head's q, k and v (d_k each).
absl::StatusOr<v1::AttentionWeights> NeoxWeights(Shards& shards, const std::string& prefix, const v1::HeadConfig& h) {
  v1::AttentionWeights w;
  absl::StatusOr<Matrix> qkv = shards.Read(prefix + "query_key_value.weight");
  absl::StatusOr<Matrix> bias = shards.Read(prefix + "query_key_value.bias");
  if (!qkv.ok()) return qkv.status();
  if (!bias.ok()) return bias.status();
  const int64_t dk = h.head_dim();
  if (qkv->rows != 3 * int64_t{h.num_heads()} * dk || bias->rows != 1 || bias->cols != qkv->rows) {
    return Invalid(prefix + "query_key_value", "must be [3 H d_k, d] with a bias of 3 H d_k");
  }
  v1::Tensor* weights[] = {w.mutable_w_q(), w.mutable_w_k(), w.mutable_w_v()};
  v1::Tensor* biases[] = {w.mutable_b_q(), w.mutable_b_k(), w.mutable_b_v()};
  for (int k = 0; k < 3; ++k) {
    Matrix rows{qkv->dtype, 0, qkv->cols, {}};
    std::vector<Matrix> bias_pieces;
    for (int64_t head = 0; head < h.num_heads(); ++head) {
      rows.Append(qkv->Rows((3 * head + k) * dk, dk));
      bias_pieces.push_back(bias->Columns((3 * head + k) * dk, dk));
    }
    *weights[k] = rows.Transposed().Tensor(false);
    *biases[k] = JoinColumns(bias_pieces).Tensor(true);
  }
  if (absl::Status s = OutputLinear(shards, prefix + "dense", &w); !s.ok()) return s;
  return w;
}

// The tensor-name prefix of layer i's attention: with the causal-LM wrapper's prefix, or a bare model's.
std::string PrefixOf(Shards& shards, const std::string& type, int64_t i) {
  const std::string n = std::to_string(i);
  const std::pair<std::string, std::string> forms =
      type == "gpt2"       ? std::pair{"transformer.h." + n + ".attn.", "h." + n + ".attn."}
      : type == "gpt_neox" ? std::pair{"gpt_neox.layers." + n + ".attention.", "layers." + n + ".attention."}
                           : std::pair{"model.layers." + n + ".self_attn.", "layers." + n + ".self_attn."};
  const std::string probe = type == "gpt2" ? "c_attn.weight" : type == "gpt_neox" ? "dense.weight" : "o_proj.weight";
  return shards.Has(forms.first + probe) || !shards.Has(forms.second + probe) ? forms.first : forms.second;
}

}  // namespace

const std::vector<std::string>& CheckpointModelTypes() {
  static const std::vector<std::string> types = {"llama", "mistral", "qwen2", "phi3", "gpt2", "gpt_neox"};
  return types;
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, const std::string& name, bool ignore_window) {
  absl::StatusOr<Json> config = ReadJson(dir + "/config.json");
  if (!config.ok()) return config.status();
  Checkpoint out;
  out.model_type = String(*config, "model_type", "");
  const std::vector<std::string>& known = CheckpointModelTypes();
  if (std::find(known.begin(), known.end(), out.model_type) == known.end()) {
    return Invalid("config.json", absl::StrCat("model_type '", out.model_type,
                                               "' is not an architecture mhaserve reads (", absl::StrJoin(known, ", "),
                                               ")"));
  }
  if (absl::Status s = CheckWindow(*config, out.model_type, ignore_window); !s.ok()) return s;
  absl::StatusOr<int64_t> layers = Count(*config, {"num_hidden_layers", "n_layer"});
  if (!layers.ok()) return layers.status();
  absl::StatusOr<Shards> shards = Shards::Open(dir);
  if (!shards.ok()) return shards.status();
  for (int64_t i = 0; i < *layers; ++i) {
    absl::StatusOr<v1::HeadConfig> heads = HeadsOf(*config, out.model_type, i);
    if (!heads.ok()) return heads.status();
    const std::string prefix = PrefixOf(*shards, out.model_type, i);
    absl::StatusOr<v1::AttentionWeights> weights =
        out.model_type == "gpt2"       ? Gpt2Weights(*shards, prefix)
        : out.model_type == "gpt_neox" ? NeoxWeights(*shards, prefix, *heads)
        : out.model_type == "phi3"     ? Phi3Weights(*shards, prefix, *heads)
                                       : SeparateWeights(*shards, prefix);
    if (!weights.ok()) return weights.status();
    v1::LoadLayerRequest& request = out.layers.emplace_back();
    request.set_name(absl::StrCat(name, ".", i));
    *request.mutable_weights() = std::move(*weights);
    *request.mutable_heads() = std::move(*heads);
  }
  return out;
}

}  // namespace mha
