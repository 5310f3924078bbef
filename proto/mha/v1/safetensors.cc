#include "proto/mha/v1/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {


// What a header may hold, checked before parsing, since the JSON parser builds a value (tens of bytes) per bracket or
// element: 10 MB of '[' cost it 783 MB, 10 MB of "0," hundreds. A layer header nests three deep
// ({"w_q": {"shape": [4, 4]}}) and holds about a hundred values; these bounds leave room for files with many more
// tensors and keep the parser's memory to a few MB beyond the header's own bytes.
constexpr int kMaxHeaderDepth = 8;
constexpr int64_t kMaxHeaderValues = 1 << 16;

struct HeaderExtent {
  int depth = 0;       // deepest nesting of [ and {
  int64_t values = 0;  // JSON values, counted as the brackets and commas that open them, plus one
};

// The extent of JSON `text`, counting outside strings only; stops once either bound is passed. Malformed JSON gives
// some extent; the parser rejects it afterwards.
HeaderExtent Extent(absl::string_view text) {
  HeaderExtent extent;
  extent.values = 1;
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{' || c == ',') {
      if (c != ',') extent.depth = std::max(extent.depth, ++depth);
      if (++extent.values > kMaxHeaderValues || extent.depth > kMaxHeaderDepth) return extent;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return extent;
}

absl::Status Bad(absl::string_view origin, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors ", origin, ": ", what));
}

absl::StatusOr<int32_t> MetadataInt(const nlohmann::json& meta, const char* key, absl::string_view origin) {
  if (!meta.contains(key)) return 0;
  const auto& value = meta[key];
  int32_t n = 0;
  if (!value.is_string() || !absl::SimpleAtoi(value.get<std::string>(), &n)) {
    return Bad(origin, absl::StrCat("__metadata__.", key, " must be a string holding an integer"));
  }
  return n;
}

// A "true" / "false" string of the metadata into *value (unchanged when absent).
absl::Status MetadataBool(const nlohmann::json& meta, const char* key, absl::string_view origin, bool* value) {
  if (!meta.contains(key)) return absl::OkStatus();
  const auto& text = meta[key];
  if (!text.is_string() || (text.get<std::string>() != "true" && text.get<std::string>() != "false")) {
    return Bad(origin, absl::StrCat("__metadata__.", key, " must be \"true\" or \"false\""));
  }
  *value = text.get<std::string>() == "true";
  return absl::OkStatus();
}

// A string holding a finite number into *value (unchanged when absent).
template <typename T>
absl::Status MetadataNumber(const nlohmann::json& meta, const char* key, absl::string_view origin, T* value) {
  if (!meta.contains(key)) return absl::OkStatus();
  const auto& text = meta[key];
  if (!text.is_string() || !absl::SimpleAtod(text.get<std::string>(), value) || !std::isfinite(*value)) {
    return Bad(origin, absl::StrCat("__metadata__.", key, " must be a string holding a finite number"));
  }
  return absl::OkStatus();
}

// "__metadata__".rope_scaling: a string holding transformers' rope_scaling as JSON, into heads->rope_scaling.
absl::Status MetadataRopeScaling(const nlohmann::json& meta, absl::string_view origin, v1::HeadConfig* heads) {
  if (!meta.contains("rope_scaling")) return absl::OkStatus();
  const auto& text = meta["rope_scaling"];
  const absl::Status status = text.is_string()
                                  ? RopeScalingFromJson(text.get<std::string>(), heads->mutable_rope_scaling())
                                  : absl::InvalidArgumentError("must be a string holding a JSON object");
  if (!status.ok()) return Bad(origin, absl::StrCat("__metadata__.rope_scaling: ", status.message()));
  return absl::OkStatus();
}

// The head configuration of "__metadata__": num_heads (required), num_kv_heads, head_dim, causal, scale,
// rope_theta, rope_dim, rope_interleaved, rope_scaling.
absl::StatusOr<v1::HeadConfig> MetadataHeads(const nlohmann::json& meta, absl::string_view origin) {
  v1::HeadConfig heads;
  for (const auto& [key, set] : {std::pair{"num_heads", &v1::HeadConfig::set_num_heads},
                                 std::pair{"num_kv_heads", &v1::HeadConfig::set_num_kv_heads},
                                 std::pair{"head_dim", &v1::HeadConfig::set_head_dim},
                                 std::pair{"rope_dim", &v1::HeadConfig::set_rope_dim}}) {
    absl::StatusOr<int32_t> n = MetadataInt(meta, key, origin);
    if (!n.ok()) return n.status();
    (heads.*set)(*n);
  }
  if (heads.num_heads() <= 0) return Bad(origin, "__metadata__.num_heads is required and must be >= 1");
  bool causal = false, interleaved = false;
  double scale = 0, rope_theta = 0;
  for (absl::Status status : {MetadataBool(meta, "causal", origin, &causal),
                              MetadataBool(meta, "rope_interleaved", origin, &interleaved),
                              MetadataNumber(meta, "scale", origin, &scale),
                              MetadataNumber(meta, "rope_theta", origin, &rope_theta)}) {
    if (!status.ok()) return status;
  }
  if (!std::isfinite(static_cast<float>(scale))) {
    return Bad(origin, "__metadata__.scale must be a string holding a finite number");
  }
  heads.set_causal(causal);
  heads.set_scale(static_cast<float>(scale));
  heads.set_rope_theta(rope_theta);
  heads.set_rope_interleaved(interleaved);
  if (absl::Status status = MetadataRopeScaling(meta, origin, &heads); !status.ok()) return status;
  return heads;
}

// The format's layout rule, over every tensor in the header (those a layer does not use too): data_offsets lie in
// the data section, no two ranges overlap, and together they cover it without holes. The safetensors library
// refuses other files (InvalidOffset); a reader that accepted them would read one byte as two weights.
absl::Status CheckLayout(const nlohmann::json& header, uint64_t data_size, absl::string_view origin) {
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") continue;
    const nlohmann::json& entry = item.value();
    if (!entry.is_object() || !entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2 || !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned()) {
      return Bad(origin, absl::StrCat("tensor '", item.key(), "' needs two non-negative integer data_offsets"));
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>(), end = entry["data_offsets"][1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return Bad(origin, absl::StrCat("tensor '", item.key(), "' data_offsets [", begin, ", ", end,
                                      ") fall outside the ", data_size, "-byte data section"));
    }
    ranges.push_back({begin, end, item.key()});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t covered = 0;  // the data section's bytes [0, covered) belong to the ranges so far
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    if (r.begin < covered) {
      const Range& previous = ranges[i - 1];
      return Bad(origin, absl::StrCat("tensors '", previous.name, "' [", previous.begin, ", ", previous.end,
                                      ") and '", r.name, "' [", r.begin, ", ", r.end, ") overlap in the data section"));
    }
    if (r.begin > covered) {
      return Bad(origin, absl::StrCat("bytes [", covered, ", ", r.begin,
                                      ") of the data section belong to no tensor (the format allows no holes)"));
    }
    covered = r.end;
  }
  if (covered != data_size) {
    return Bad(origin, absl::StrCat("bytes [", covered, ", ", data_size,
                                    ") at the end of the data section belong to no tensor (the format allows no "
                                    "holes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseSafetensorsHeader(absl::string_view text, absl::string_view origin) {
  const HeaderExtent extent = Extent(text);
  if (extent.depth > kMaxHeaderDepth) {
    return Bad(origin, absl::StrCat("header nests JSON arrays or objects more than ", kMaxHeaderDepth,
                                    " deep; a layer header needs 3"));
  }
  if (extent.values > kMaxHeaderValues) {
    return Bad(origin, absl::StrCat("header holds more than ", kMaxHeaderValues,
                                    " JSON values; a layer header needs about 100"));
  }
  nlohmann::json header = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return Bad(origin, "header is not a JSON object");
  return header;
}

v1::DataType SafetensorsDtype(absl::string_view name) {
  return name == "F32" ? v1::FP32 : name == "F16" ? v1::FP16 : name == "BF16" ? v1::BF16 : v1::DATA_TYPE_UNSPECIFIED;
}

absl::Status RopeScalingFromJson(absl::string_view text, v1::RopeScaling* out) {
  const nlohmann::json object = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!object.is_object()) return absl::InvalidArgumentError("must hold a JSON object (transformers' rope_scaling)");
  nlohmann::json fields = nlohmann::json::object();
  for (const auto& [key, value] : object.items()) {
    if (key == "rope_theta" || key == "partial_rotary_factor" || value.is_null()) continue;
    fields[key == "type" ? "rope_type" : key] = value;
  }
  google::protobuf::util::JsonParseOptions options;
  const auto status = google::protobuf::util::JsonStringToMessage(fields.dump(), out, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("does not read as RopeScaling: ", status.ToString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsLayer> ParseSafetensorsLayer(absl::string_view bytes, absl::string_view origin) {
  if (bytes.size() < 8) return Bad(origin, "shorter than the 8-byte header length");
  uint64_t header_len;
  std::memcpy(&header_len, bytes.data(), 8);
  if (header_len > kMaxSafetensorsHeaderBytes || header_len > bytes.size() - 8) {
    return Bad(origin, absl::StrCat("header length ", header_len, " exceeds the file (", bytes.size(), " bytes)"));
  }
  absl::StatusOr<nlohmann::json> parsed = ParseSafetensorsHeader(bytes.substr(8, header_len), origin);
  if (!parsed.ok()) return parsed.status();
  const nlohmann::json& header = *parsed;
  const absl::string_view body = bytes.substr(8 + header_len);

  SafetensorsLayer layer;
  const std::pair<const char*, v1::Tensor*> slots[] = {
      {"w_q", layer.weights.mutable_w_q()}, {"w_k", layer.weights.mutable_w_k()},
      {"w_v", layer.weights.mutable_w_v()}, {"w_o", layer.weights.mutable_w_o()},
      {"b_q", nullptr},                     {"b_k", nullptr},
      {"b_v", nullptr},                     {"b_o", nullptr}};
  for (const auto& [name, required_slot] : slots) {
    if (!header.contains(name)) {
      if (required_slot != nullptr) return Bad(origin, absl::StrCat("missing tensor '", name, "'"));
      continue;
    }
    const nlohmann::json& entry = header[name];
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets") || !entry["dtype"].is_string() || !entry["shape"].is_array() ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
      return Bad(origin, absl::StrCat("tensor '", name, "' needs dtype, shape and two data_offsets"));
    }
    v1::Tensor* tensor = required_slot;
    if (tensor == nullptr) {
      auto* w = &layer.weights;
      const std::string n = name;
      tensor = n == "b_q" ? w->mutable_b_q() : n == "b_k" ? w->mutable_b_k() : n == "b_v" ? w->mutable_b_v()
                                                                                          : w->mutable_b_o();
    }
    const std::string dtype = entry["dtype"].get<std::string>();
    tensor->set_dtype(SafetensorsDtype(dtype));
    if (tensor->dtype() == v1::DATA_TYPE_UNSPECIFIED) {
      return Bad(origin, absl::StrCat("tensor '", name, "' has dtype ", dtype, "; expected F32, F16 or BF16"));
    }
    for (const auto& dim : entry["shape"]) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 1) {
        return Bad(origin, absl::StrCat("tensor '", name, "' has a shape entry that is not a positive integer"));
      }
      tensor->add_shape(dim.get<int64_t>());
    }
    const auto& offsets = entry["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return Bad(origin, absl::StrCat("tensor '", name, "' has non-integer data_offsets"));
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > body.size()) {
      return Bad(origin, absl::StrCat("tensor '", name, "' data_offsets [", begin, ", ", end,
                                      ") fall outside the ", body.size(), "-byte data section"));
    }
    tensor->set_data(std::string(body.substr(begin, end - begin)));
    absl::Status valid = CheckTensor(*tensor, name).status();
    if (!valid.ok()) return Bad(origin, valid.message());
  }

  if (absl::Status layout = CheckLayout(header, body.size(), origin); !layout.ok()) return layout;

  if (!header.contains("__metadata__") || !header["__metadata__"].is_object()) {
    return Bad(origin, "missing __metadata__ with num_heads");
  }
  absl::StatusOr<v1::HeadConfig> heads = MetadataHeads(header["__metadata__"], origin);
  if (!heads.ok()) return heads.status();
  layer.heads = *std::move(heads);
  return layer;
}

absl::StatusOr<SafetensorsLayer> ReadSafetensorsLayer(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  const std::string bytes = contents.str();
  return ParseSafetensorsLayer(bytes, path);
}

}  // namespace mha
