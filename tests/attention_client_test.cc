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
#include "client/session.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/generic/async_generic_service.h"
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


// A session's life through the handle: arrays in and out, lengths kept, a fork that diverges, truncation, close.
TEST_F(AttentionClientTest, ASessionHandleCreatesExtendsForksTruncatesAndCloses) {
  v1::CreateSessionRequest create;
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  create.mutable_heads()->set_rope_theta(10000);
  absl::StatusOr<Session> session = Session::Create(client_.get(), create);
  ASSERT_TRUE(session.ok()) << session.status();
  const auto qkv = [](int64_t n, uint32_t seed) {
    return std::vector<Array>{{{n, 4, 16}, RandomVector(n * 64, seed)},
                              {{n, 2, 16}, RandomVector(n * 32, seed + 1)},
                              {{n, 2, 16}, RandomVector(n * 32, seed + 2)}};
  };
  std::vector<Array> prompt = qkv(9, 1);
  absl::StatusOr<ExtendOutputs> prefill = session->Extend(0, prompt[0], prompt[1], prompt[2]);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_THAT(prefill->output.shape, ::testing::ElementsAre(9, 4, 16));
  EXPECT_EQ(session->info().lengths(0), 9);
  absl::StatusOr<Session> fork = session->Fork("fork-of-it");
  ASSERT_TRUE(fork.ok()) << fork.status();
  std::vector<Array> step = qkv(1, 7);
  ExtendOptions options;
  options.expected_length = 9;
  options.return_attention_weights = true;
  absl::StatusOr<ExtendOutputs> a = session->Extend(0, step[0], step[1], step[2], options);
  absl::StatusOr<ExtendOutputs> b = fork->Extend(0, step[0], step[1], step[2], options);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  EXPECT_EQ(a->output.values, b->output.values);  // the same history and token: the same answer
  EXPECT_THAT(a->attention_weights.shape, ::testing::ElementsAre(4, 1, 10));
  EXPECT_EQ(a->length, 10);
  ASSERT_TRUE(session->Truncate(4).ok());
  EXPECT_EQ(session->info().lengths(0), 4);
  ASSERT_TRUE(session->Close().ok());
  EXPECT_EQ(session->Extend(0, step[0], step[1], step[2]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(fork->Close().ok());
}

// Records the mha-session-id metadata of every call and answers UNIMPLEMENTED: what a routing proxy would see.
class MetadataRecorder final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    const auto it = context->client_metadata().find("mha-session-id");
    {
      absl::MutexLock lock(&mu_);
      seen_.emplace_back(context->method(),
                         it == context->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size()));
    }
    class Refuse final : public grpc::ServerGenericBidiReactor {
     public:
      Refuse() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "recorded")); }
      void OnDone() override { delete this; }
    };
    return new Refuse();
  }
  std::vector<std::pair<std::string, std::string>> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<std::string, std::string>> seen_;
};

TEST(SessionMetadata, EverySessionCallCarriesItsSessionId) {
  MetadataRecorder recorder;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&recorder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(10);
  AttentionClient client(options);
  v1::CreateSessionRequest create;
  create.set_session_id("s-1");
  create.add_layers("demo");
  EXPECT_FALSE(client.CreateSession(create).ok());
  v1::ExtendRequest extend;
  extend.add_items()->set_session_id("s-1");
  extend.add_items()->set_session_id("s-2");
  EXPECT_FALSE(client.Extend(extend).ok());
  v1::ForkSessionRequest fork;
  fork.set_session_id("s-1");
  fork.set_new_session_id("s-3");
  EXPECT_FALSE(client.ForkSession(fork).ok());
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id("s-1");
  EXPECT_FALSE(client.TruncateSession(truncate).ok());
  EXPECT_FALSE(client.CloseSession("s-1").ok());
  EXPECT_THAT(recorder.seen(),
              ::testing::ElementsAre(::testing::Pair("/mha.v1.Attention/CreateSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/Extend", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/ForkSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/TruncateSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/CloseSession", "s-1")));
  server->Shutdown();
}

}  // namespace
}  // namespace mha
