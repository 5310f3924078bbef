// The checkpoint reader (proto/mha/v1/checkpoint.h: mha_client load, the server's --layers_dir) on folders that
// cannot be loaded: each refusal names what is missing or not understood; and a folder in --layers_dir registers its
// layers. What it reads from real checkpoints is tests/models/test_checkpoints.py's (transformers' save_pretrained as
// the writer, its attention modules as the oracle).
#include "proto/mha/v1/checkpoint.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/layers/layer_store.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/mha_checkpoint_XXXXXX";
    dir_ = mkdtemp(pattern);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& file, const std::string& text) { std::ofstream(dir_ + "/" + file) << text; }
  // A safetensors file with no tensors.
  void WriteEmptySafetensors() {
    const std::string header = "{}";
    const uint64_t n = header.size();
    std::ofstream out(dir_ + "/model.safetensors", std::ios::binary);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header;
  }
  std::string dir_;
};

TEST_F(CheckpointTest, AFolderWithoutConfigIsNotFound) {
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("config.json: cannot be opened"));
}

TEST_F(CheckpointTest, AnArchitectureItDoesNotReadIsNamed) {
  Write("config.json", R"({"model_type": "qwen3", "num_hidden_layers": 1})");
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "config.json: model_type 'qwen3' is not an architecture mhaserve reads (llama, mistral, qwen2, phi3, gpt2, "
            "gpt_neox)");
}

TEST_F(CheckpointTest, AMissingTensorIsNamed) {
  Write("config.json", R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
                          "num_attention_heads": 4, "rope_theta": 10000})");
  WriteEmptySafetensors();
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "the checkpoint has no tensor model.layers.0.self_attn.q_proj.weight");
}

TEST_F(CheckpointTest, ASlidingWindowIsRefusedUnlessIgnored) {
  Write("config.json", R"({"model_type": "mistral", "num_hidden_layers": 1, "hidden_size": 64,
                          "num_attention_heads": 4, "sliding_window": 4096})");
  WriteEmptySafetensors();
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("sliding_window is 4096"));
  EXPECT_EQ(ReadCheckpoint(dir_, "m", /*ignore_window=*/true).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ARopeScalingItCannotReadIsNamed) {
  Write("config.json", R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
                          "num_attention_heads": 4, "rope_scaling": {"rope_type": "llama3", "alpha": 2}})");
  WriteEmptySafetensors();
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("config.json: rope_scaling: does not read as RopeScaling"));
}

// A LLaMA-shaped checkpoint of one layer (d_model 8, 2 heads of 4, F32), written as save_pretrained writes one:
// [out, in] projections under model.layers.0.self_attn.
void WriteTinyLlama(const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "num_key_value_heads": 2, "rope_theta": 500000.0, "max_position_embeddings": 64})";
  std::string header = "{", data;
  const char* names[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int k = 0; k < 4; ++k) {
    const size_t begin = data.size();
    for (int i = 0; i < 64; ++i) {
      const float x = 0.01f * static_cast<float>(i * (k + 1) % 17) - 0.08f;
      data.append(reinterpret_cast<const char*>(&x), 4);
    }
    header += absl::StrCat(k ? "," : "", "\"model.layers.0.self_attn.", names[k],
                           ".weight\":{\"dtype\":\"F32\",\"shape\":[8,8],\"data_offsets\":[", begin, ",",
                           data.size(), "]}");
  }
  header += "}";
  const uint64_t n = header.size();
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
}

// A one-tensor file whose entry for q_proj is `entry` (JSON), followed by 256 bytes of data.
void WriteOneEntry(const std::string& dir, const std::string& entry) {
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2})";
  const std::string header = "{\"model.layers.0.self_attn.q_proj.weight\":" + entry + "}";
  const uint64_t n = header.size();
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(256, '\0');
}

TEST_F(CheckpointTest, MalformedTensorEntriesAreRefusedNotTrusted) {
  for (const std::string& entry : {
           std::string(R"({"dtype":"F32","shape":["8",8],"data_offsets":[0,256]})"),        // a size that is text
           std::string(R"({"dtype":"F32","shape":[8,8],"data_offsets":[0,1024]})"),          // past the file's end
           std::string(R"({"dtype":"F32","shape":[8,8],"data_offsets":[256,0]})"),           // backwards
           std::string(R"({"dtype":"I64","shape":[8,4],"data_offsets":[0,256]})"),           // another dtype
           std::string(R"({"dtype":"F32","shape":[16777217,1],"data_offsets":[0,256]})"),    // too large
           std::string(R"("not an object")")}) {
    WriteOneEntry(dir_, entry);
    const absl::Status s = ReadCheckpoint(dir_, "m").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << entry << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.0.self_attn.q_proj.weight")) << entry;
  }
}

TEST_F(CheckpointTest, FusedProjectionsOfTheWrongSizeAreRefusedNotSliced) {
  // GPT-NeoX, 2 heads of 4: query_key_value must have 3 x 2 x 4 = 24 rows; this one has 8, and a bias of 8.
  std::ofstream(dir_ + "/config.json") << R"({"model_type": "gpt_neox", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2})";
  const std::string header = R"({"gpt_neox.layers.0.attention.query_key_value.weight":)"
                             R"({"dtype":"F32","shape":[8,8],"data_offsets":[0,256]},)"
                             R"("gpt_neox.layers.0.attention.query_key_value.bias":)"
                             R"({"dtype":"F32","shape":[8],"data_offsets":[256,288]},)"
                             R"("gpt_neox.layers.0.attention.dense.weight":)"
                             R"({"dtype":"F32","shape":[8,8],"data_offsets":[288,544]}})";
  const uint64_t n = header.size();
  std::ofstream out(dir_ + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(544, '\0');
  out.close();
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("query_key_value: must be [3 H d_k, d]"));
  std::ofstream(dir_ + "/config.json") << R"({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "head_dim": -4})";
  EXPECT_EQ(ReadCheckpoint(dir_, "m").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointTest, ConfigValuesOfTheWrongTypeAreNotTrusted) {
  Write("config.json", R"({"model_type": 7, "num_hidden_layers": 1})");
  EXPECT_EQ(ReadCheckpoint(dir_, "m").status().code(), absl::StatusCode::kInvalidArgument);
  Write("config.json", R"({"model_type": "qwen2", "use_sliding_window": "yes", "num_hidden_layers": "2"})");
  const absl::Status s = ReadCheckpoint(dir_, "m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_hidden_layers or n_layer must be a positive integer"));
}

TEST_F(CheckpointTest, AFolderInTheLayersDirectoryRegistersItsLayers) {
  WriteTinyLlama(dir_ + "/tiny");
  LayerStore store(int64_t{1} << 30, 16);
  ASSERT_TRUE(store.LoadDirectory(dir_).ok());
  absl::StatusOr<std::shared_ptr<const Layer>> layer = store.Get("tiny.0");
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ((*layer)->shape.d_model, 8);
  EXPECT_EQ((*layer)->shape.heads.num_heads, 2);
  EXPECT_EQ((*layer)->shape.heads.rope_theta, 500000.0);
  EXPECT_TRUE((*layer)->shape.heads.causal);
  EXPECT_EQ((*layer)->source, "checkpoint:" + dir_ + "/tiny");
}

TEST_F(CheckpointTest, ABadFolderInTheLayersDirectoryStopsTheLoadNamingIt) {
  std::filesystem::create_directories(dir_ + "/broken");
  std::ofstream(dir_ + "/broken/config.json") << R"({"model_type": "bert"})";
  LayerStore store(int64_t{1} << 30, 16);
  const absl::Status s = store.LoadDirectory(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr(dir_ + "/broken: config.json: model_type 'bert'"));
}

}  // namespace
}  // namespace mha
