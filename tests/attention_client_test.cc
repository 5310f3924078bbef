// The C++ client library against a real server on a loopback port: plain arrays in, plain arrays out, errors as
// absl::Status with the server's code.
#include "client/attention_client.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/bench.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/service_fixture.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
using ::mha::testing::RandomVector;

class AttentionClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    server_ = mha::testing::StartLoopbackServer();
    ASSERT_NE(server_, nullptr);
    ClientOptions client_options;
    client_options.target = absl::StrCat("127.0.0.1:", server_->port());
    client_options.timeout = absl::Seconds(30);
    client_ = std::make_unique<AttentionClient>(client_options);
  }

  std::unique_ptr<MhaServer> server_;
  std::unique_ptr<AttentionClient> client_;
};

TEST_F(AttentionClientTest, ArraysInArraysOutMatchTheReferenceBackend) {
  const Array query{{2, 5, 512}, RandomVector(2 * 5 * 512, 3)};
  MhaInputs inputs;
  inputs.query = &query;
  inputs.causal = true;
  inputs.key_lengths = {5, 3};
  inputs.return_attention_weights = true;
  absl::StatusOr<MhaOutputs> cpu = client_->MultiHeadAttention(inputs);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  inputs.backend = v1::BACKEND_REFERENCE;
  absl::StatusOr<MhaOutputs> reference = client_->MultiHeadAttention(inputs);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_THAT(cpu->output.shape, ::testing::ElementsAre(2, 5, 512));
  EXPECT_THAT(cpu->attention_weights.shape, ::testing::ElementsAre(2, 8, 5, 5));
  EXPECT_EQ(cpu->backend, "cpu");
  EXPECT_EQ(reference->backend, "reference");
  EXPECT_TRUE(AllClose(cpu->output.values, reference->output.values, 1e-5, 1e-4));
  EXPECT_TRUE(AllClose(cpu->attention_weights.values, reference->attention_weights.values, 1e-6, 1e-4));
}

TEST_F(AttentionClientTest, HalfPrecisionWireStillReturnsFp32) {
  const Array query{{1, 4, 512}, RandomVector(4 * 512, 4)};
  MhaInputs inputs;
  inputs.query = &query;
  inputs.wire_dtype = v1::FP16;
  absl::StatusOr<MhaOutputs> out = client_->MultiHeadAttention(inputs);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->output.values.size(), 4u * 512);
  EXPECT_TRUE(out->attention_weights.values.empty());
}

// The array call sends its tensors outside the message and decodes them straight into the outputs; the proto
// call goes through protobuf as a whole. Same server, same inputs: the same bits.
TEST_F(AttentionClientTest, ArrayCallsGiveTheBitsOfTheProtoCall) {
  const Array query{{2, 6, 512}, RandomVector(2 * 6 * 512, 6)};
  const Array key{{2, 9, 512}, RandomVector(2 * 9 * 512, 7)};
  const Array value{{2, 9, 512}, RandomVector(2 * 9 * 512, 8)};
  for (v1::DataType wire : {v1::FP32, v1::BF16}) {
    MhaInputs inputs;
    inputs.query = &query;
    inputs.key = &key;
    inputs.value = &value;
    inputs.key_lengths = {9, 4};
    inputs.return_attention_weights = true;
    inputs.wire_dtype = wire;
    absl::StatusOr<MhaOutputs> arrays = client_->MultiHeadAttention(inputs);
    ASSERT_TRUE(arrays.ok()) << arrays.status();

    v1::MultiHeadAttentionRequest request;
    FloatsToTensor(query.values, query.shape, wire, request.mutable_query());
    FloatsToTensor(key.values, key.shape, wire, request.mutable_key());
    FloatsToTensor(value.values, value.shape, wire, request.mutable_value());
    request.set_layer("demo");
    request.add_key_lengths(9);
    request.add_key_lengths(4);
    request.set_return_attention_weights(true);
    request.set_output_dtype(v1::FP32);
    absl::StatusOr<v1::MultiHeadAttentionResponse> proto = client_->MultiHeadAttention(request);
    ASSERT_TRUE(proto.ok()) << proto.status();
    EXPECT_EQ(arrays->output.values, TensorToFloats(proto->output())) << DTypeName(wire);
    EXPECT_EQ(arrays->attention_weights.values, TensorToFloats(proto->attention_weights())) << DTypeName(wire);
    EXPECT_THAT(arrays->attention_weights.shape, ::testing::ElementsAre(2, 8, 6, 9));
  }
}

// The array call goes through gRPC's generic stub; the channel's token goes with it all the same.
TEST(AttentionClientTokenTest, ArrayCallsCarryTheChannelsToken) {
  spdlog::set_level(spdlog::level::warn);
  const std::string tokens =
      (std::filesystem::temp_directory_path() / ("mha-client-tokens-" + std::to_string(getpid()))).string();
  std::ofstream(tokens) << "client-token-0123456789\n";
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 1;
  options.auth_tokens_file = tokens;
  absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  std::filesystem::remove(tokens);
  ASSERT_TRUE(server.ok()) << server.status();
  const Array query{{1, 4, 512}, RandomVector(4 * 512, 9)};
  MhaInputs inputs;
  inputs.query = &query;
  ClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", (*server)->port());
  EXPECT_EQ(AttentionClient(client_options).MultiHeadAttention(inputs).status().code(),
            absl::StatusCode::kUnauthenticated);
  client_options.token = "client-token-0123456789";
  absl::StatusOr<MhaOutputs> out = AttentionClient(client_options).MultiHeadAttention(inputs);
  EXPECT_TRUE(out.ok()) << out.status();
}

TEST_F(AttentionClientTest, ServerErrorsKeepTheirCode) {
  const Array query{{1, 4, 64}, RandomVector(4 * 64, 5)};
  MhaInputs inputs;
  inputs.query = &query;  // 64 features, but the demo layer wants 512
  EXPECT_EQ(client_->MultiHeadAttention(inputs).status().code(), absl::StatusCode::kInvalidArgument);
  inputs.layer = "missing";
  EXPECT_EQ(client_->MultiHeadAttention(inputs).status().code(), absl::StatusCode::kNotFound);
  MhaInputs no_query;
  EXPECT_EQ(client_->MultiHeadAttention(no_query).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AttentionClientTest, ReportsServing) {
  absl::StatusOr<bool> serving = client_->Serving();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
}

// mha_client bench's load generator (many streams and gRPC callback threads on one state): every call started is
// recorded once, in both loops, and progress is reported while they run.
TEST_F(AttentionClientTest, LoadRunsEveryCallInBothLoops) {
  v1::MultiHeadAttentionRequest request;
  FloatsToTensor(RandomVector(2 * 4 * 512, 6), {2, 4, 512}, v1::FP32, request.mutable_query());
  request.set_layer("demo");
  const std::vector<std::shared_ptr<grpc::Channel>> channels = {
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()),
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials())};
  LoadOptions closed;
  closed.concurrency = 4;
  closed.total = 24;
  closed.warmup = 4;
  int progress_calls = 0;
  absl::StatusOr<LoadResult> result =
      RunLoad(closed, channels, request, [&](const LoadProgress&) { ++progress_calls; });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->samples.size(), 24u);
  for (const CallSample& sample : result->samples) EXPECT_EQ(sample.code, 0) << sample.message;

  LoadOptions open;
  open.rps = 400;
  open.total = 40;
  open.max_in_flight = 3;
  result = RunLoad(open, channels, request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->samples.size(), 40u);
  for (const CallSample& sample : result->samples) EXPECT_EQ(sample.code, 0) << sample.message;
}

}  // namespace
}  // namespace mha
