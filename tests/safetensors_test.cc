// Reading layers from .safetensors bytes: a valid file, and each malformed part rejected with a clear message.
#include "proto/mha/v1/safetensors.h"

#include <sys/resource.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/layers/layer.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

// Builds a safetensors file: header JSON (given verbatim) then `data`.
std::string File(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string Floats(int n, float value) {
  std::vector<float> v(n, value);
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// d_model 4, 2 heads of 2, F32, no bias; w_o stored as F16.
std::string ValidHeader(const std::string& metadata) {
  return R"({"w_q":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]},)"
         R"("w_k":{"dtype":"F32","shape":[4,4],"data_offsets":[64,128]},)"
         R"("w_v":{"dtype":"F32","shape":[4,4],"data_offsets":[128,192]},)"
         R"("w_o":{"dtype":"F16","shape":[4,4],"data_offsets":[192,224]},)"
         R"("__metadata__":)" + metadata + "}";
}

std::string ValidData() { return Floats(48, 0.5f) + std::string(32, '\0'); }

TEST(Safetensors, ReadsWeightsAndHeadMetadata) {
  const std::string bytes =
      File(ValidHeader(R"({"num_heads":"2","num_kv_heads":"1","causal":"true","scale":"0.25"})"), ValidData());
  absl::StatusOr<SafetensorsLayer> layer = ParseSafetensorsLayer(bytes, "x.safetensors");
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->heads.num_heads(), 2);
  EXPECT_EQ(layer->heads.num_kv_heads(), 1);
  EXPECT_TRUE(layer->heads.causal());
  EXPECT_FLOAT_EQ(layer->heads.scale(), 0.25f);
  EXPECT_EQ(layer->weights.w_o().dtype(), v1::FP16);
  EXPECT_FALSE(layer->weights.has_b_q());
}

TEST(Safetensors, ParsedLayerBuildsOnlyWithConsistentShapes) {
  // num_kv_heads 1 needs w_k [4, 2]; the file has [4, 4], so BuildLayer names w_k.
  const std::string bytes = File(ValidHeader(R"({"num_heads":"2","num_kv_heads":"1"})"), ValidData());
  absl::StatusOr<SafetensorsLayer> file = ParseSafetensorsLayer(bytes, "x");
  ASSERT_TRUE(file.ok());
  absl::StatusOr<std::shared_ptr<const Layer>> layer = BuildLayer("x", "file:x", file->weights, file->heads, "x");
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(layer.status().message()), HasSubstr("x.w_k.shape must be [4, 2] (rows: d_kv_in from w_k, 4; columns: num_kv_heads x head_dim = 1 x 2), got [4, 4]"));
}

TEST(Safetensors, RejectsTruncatedHeader) {
  std::string bytes = File(ValidHeader(R"({"num_heads":"2"})"), ValidData());
  bytes.resize(20);
  const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("exceeds the file"));
}

TEST(Safetensors, RejectsOffsetsOutsideTheData) {
  const std::string bytes = File(ValidHeader(R"({"num_heads":"2"})"), ValidData().substr(0, 100));
  const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("fall outside"));
}

// d_model 4, 2 heads of 2, all F32, with the given data_offsets (begin of w_q, w_k, w_v, w_o; 64 bytes each).
std::string HeaderAt(int q, int k, int v, int o) {
  auto entry = [](const char* name, int begin) {
    return absl::StrCat("\"", name, R"(":{"dtype":"F32","shape":[4,4],"data_offsets":[)", begin, ",", begin + 64,
                        "]},");
  };
  return "{" + entry("w_q", q) + entry("w_k", k) + entry("w_v", v) + entry("w_o", o) +
         R"("__metadata__":{"num_heads":"2"}})";
}

TEST(Safetensors, RejectsOverlappingTensors) {
  // The format forbids it: w_k's bytes would also be w_q's.
  const absl::Status s = ParseSafetensorsLayer(File(HeaderAt(0, 32, 96, 160), Floats(56, 1)), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensors 'w_q' [0, 64) and 'w_k' [32, 96) overlap"));
}

TEST(Safetensors, RejectsTheSameRangeTwice) {
  const absl::Status s = ParseSafetensorsLayer(File(HeaderAt(0, 64, 128, 128), Floats(48, 1)), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("overlap"));
}

TEST(Safetensors, RejectsHoleBetweenTensors) {
  const absl::Status s = ParseSafetensorsLayer(File(HeaderAt(0, 64, 136, 200), Floats(66, 1)), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("bytes [128, 136) of the data section belong to no tensor"));
}

TEST(Safetensors, RejectsBytesAfterTheLastTensor) {
  const std::string bytes = File(ValidHeader(R"({"num_heads":"2"})"), ValidData() + "tail");
  const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("bytes [224, 228) at the end of the data section"));
}

TEST(Safetensors, RejectsOtherTensorWithoutOffsets) {
  std::string header = ValidHeader(R"({"num_heads":"2"})");
  header.insert(1, R"("other":{"dtype":"I8","shape":[4]},)");
  const absl::Status s = ParseSafetensorsLayer(File(header, ValidData()), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'other' needs two non-negative integer data_offsets"));
}

TEST(Safetensors, AcceptsOtherTensorsThatTileTheData) {
  std::string header = ValidHeader(R"({"num_heads":"2"})");
  header.insert(1, R"("other":{"dtype":"I8","shape":[4],"data_offsets":[224,228]},)");
  absl::StatusOr<SafetensorsLayer> layer = ParseSafetensorsLayer(File(header, ValidData() + "abcd"), "x");
  EXPECT_TRUE(layer.ok()) << layer.status();
}

TEST(Safetensors, RejectsMissingTensor) {
  const std::string header = R"({"w_q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{}})";
  const absl::Status s = ParseSafetensorsLayer(File(header, Floats(1, 1)), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("missing tensor 'w_k'"));
}

TEST(Safetensors, ReadsTransformersRopeScalingFromTheMetadata) {
  // As json.dumps writes config.json's object (transformers 5 keeps rope_theta in it; nulls mean unset).
  const std::string scaling =
      R"({\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, )"
      R"(\"original_max_position_embeddings\": 8192, \"rope_theta\": 500000.0, \"attention_factor\": null})";
  const std::string bytes = File(ValidHeader(absl::StrCat(R"({"num_heads":"2","rope_theta":"500000",)",
                                                          R"("rope_scaling":")", scaling, R"("})")),
                                 ValidData());
  absl::StatusOr<SafetensorsLayer> layer = ParseSafetensorsLayer(bytes, "x");
  ASSERT_TRUE(layer.ok()) << layer.status();
  const v1::RopeScaling& r = layer->heads.rope_scaling();
  EXPECT_EQ(r.rope_type(), "llama3");
  EXPECT_EQ(r.factor(), 8.0);
  EXPECT_EQ(r.high_freq_factor(), 4.0);
  EXPECT_EQ(r.original_max_position_embeddings(), 8192);
  EXPECT_EQ(r.attention_factor(), 0.0);
}

TEST(Safetensors, RejectsRopeScalingThatIsNotAnObjectOrHasUnknownKeys) {
  for (const std::string& scaling : {std::string("8"), std::string(R"({\"rope_type\": \"yarn\", \"alpha\": 2})")}) {
    const std::string bytes =
        File(ValidHeader(absl::StrCat(R"({"num_heads":"2","rope_scaling":")", scaling, R"("})")), ValidData());
    const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << scaling;
    EXPECT_THAT(std::string(s.message()), HasSubstr("__metadata__.rope_scaling")) << scaling;
  }
}

TEST(Safetensors, RejectsUnsupportedDtype) {
  std::string header = ValidHeader(R"({"num_heads":"2"})");
  header.replace(header.find("F16"), 3, "I64");
  const absl::Status s = ParseSafetensorsLayer(File(header, ValidData()), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("dtype I64"));
}

TEST(Safetensors, RejectsMissingNumHeads) {
  const absl::Status s = ParseSafetensorsLayer(File(ValidHeader("{}"), ValidData()), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_heads"));
}

TEST(Safetensors, RejectsNonJsonHeader) {
  const absl::Status s = ParseSafetensorsLayer(File("{not json", ""), "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not a JSON object"));
}

// This process's peak resident memory in bytes.
int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

TEST(Safetensors, RejectsDeeplyNestedHeaderWithoutParsingIt) {
  // 10 MB of unclosed '[' once made the JSON parser peak at 783 MB; now the header costs its own bytes.
  const std::string bytes = File(std::string(10 << 20, '['), "");
  const int64_t before = PeakRssBytes();
  const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("nests JSON arrays or objects more than 8 deep"));
  EXPECT_LT(PeakRssBytes() - before, int64_t{32} << 20);
}

TEST(Safetensors, RejectsHeaderWithTooManyValuesWithoutParsingIt) {
  // 10 MB of "0," at depth 2 cost the JSON parser hundreds of MB.
  std::string header = R"({"__metadata__":{"num_heads":"2"},"x":[)";
  for (int i = 0; i < (5 << 20); ++i) header += "0,";
  header += "0]}";
  const std::string bytes = File(header, "");
  const int64_t before = PeakRssBytes();
  const absl::Status s = ParseSafetensorsLayer(bytes, "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("more than 65536 JSON values"));
  EXPECT_LT(PeakRssBytes() - before, int64_t{32} << 20);
}

TEST(Safetensors, BracketsInsideStringsDoNotCountAsNesting) {
  const std::string metadata = R"({"num_heads":"2","note":"[[[[[[[[[[{{{{{{{{{{ \"[[[[[[[[[["})";
  absl::StatusOr<SafetensorsLayer> layer = ParseSafetensorsLayer(File(ValidHeader(metadata), ValidData()), "x");
  EXPECT_TRUE(layer.ok()) << layer.status();
}

TEST(Safetensors, MissingFileIsNotFound) {
  EXPECT_EQ(ReadSafetensorsLayer("/nonexistent/x.safetensors").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mha
