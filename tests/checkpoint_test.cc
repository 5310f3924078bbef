// mha_client load's checkpoint reader (client/checkpoint.h) on folders that cannot be loaded: each refusal names
// what is missing or not understood. What it reads from real checkpoints is tests/models/test_checkpoints.py's
// (transformers' save_pretrained as the writer, its attention modules as the oracle).
#include "client/checkpoint.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
            "config.json: model_type 'qwen3' is not one mha_client load reads (llama, mistral, qwen2, phi3, gpt2, "
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

}  // namespace
}  // namespace mha
