// The C++ client library against a real server on a loopback port: plain arrays in, plain arrays out, errors as
// absl::Status with the server's code.
#include "client/attention_client.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/bench.h"
#include "client/extend_stepper.h"
#include "client/session.h"
#include "client/session_recovery.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
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

  // Stops the server and starts another on the same port, as a restarted server comes back.
  void RestartServer() {
    const int port = server_->port();
    server_->Shutdown(absl::ZeroDuration());
    server_.reset();
    ServerOptions options;
    options.listen = absl::StrCat("127.0.0.1:", port);
    options.threads = 2;
    absl::StatusOr<std::unique_ptr<MhaServer>> again = MhaServer::Start(options);
    ASSERT_TRUE(again.ok()) << again.status();
    server_ = *std::move(again);
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
// A head session's inputs for n tokens: q [n, 4, 16], k and v [n, 2, 16].
std::vector<Array> HeadTokens(int64_t n, uint32_t seed) {
  return {{{n, 4, 16}, RandomVector(n * 64, seed)},
          {{n, 2, 16}, RandomVector(n * 32, seed + 1)},
          {{n, 2, 16}, RandomVector(n * 32, seed + 2)}};
}

TEST_F(AttentionClientTest, ASessionHandleCreatesExtendsForksTruncatesAndCloses) {
  v1::CreateSessionRequest create;
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  create.mutable_heads()->set_rope_theta(10000);
  absl::StatusOr<Session> session = Session::Create(client_.get(), create);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<Array> prompt = HeadTokens(9, 1);
  absl::StatusOr<ExtendOutputs> prefill = session->Extend(0, prompt[0], prompt[1], prompt[2]);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_THAT(prefill->output.shape, ::testing::ElementsAre(9, 4, 16));
  EXPECT_EQ(session->info().lengths(0), 9);
  absl::StatusOr<Session> fork = session->Fork("fork-of-it");
  ASSERT_TRUE(fork.ok()) << fork.status();
  std::vector<Array> step = HeadTokens(1, 7);
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

// A step retried after an error that hid its commit must not append twice: the handle sends the length it last saw.
TEST_F(AttentionClientTest, ASessionHandleChecksTheLengthItLastSaw) {
  v1::CreateSessionRequest create;
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  absl::StatusOr<Session> session = Session::Create(client_.get(), create);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<Array> step = HeadTokens(1, 3);
  ASSERT_TRUE(session->Extend(0, step[0], step[1], step[2]).ok());
  v1::ExtendRequest unseen;  // a step whose answer the handle never saw
  v1::ExtendItem* item = unseen.add_items();
  item->set_session_id(session->id());
  FloatsToTensor(step[0].values, step[0].shape, v1::FP32, item->mutable_q());
  FloatsToTensor(step[1].values, step[1].shape, v1::FP32, item->mutable_k());
  FloatsToTensor(step[2].values, step[2].shape, v1::FP32, item->mutable_v());
  ASSERT_TRUE(client_->Extend(unseen).ok());
  EXPECT_EQ(session->Extend(0, step[0], step[1], step[2]).status().code(), absl::StatusCode::kFailedPrecondition);
  ExtendOptions unchecked;
  unchecked.check_length = false;
  absl::StatusOr<ExtendOutputs> out = session->Extend(0, step[0], step[1], step[2], unchecked);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->length, 3);
  EXPECT_TRUE(session->Close().ok());
}

// A one-token Extend of head session `id` (H=4, Hkv=2, d_k=16), its values drawn from `seed`.
v1::ExtendRequest OneTokenStep(const std::string& id, uint32_t seed) {
  std::vector<Array> token = HeadTokens(1, seed);
  v1::ExtendRequest request;
  v1::ExtendItem* item = request.add_items();
  item->set_session_id(id);
  FloatsToTensor(token[0].values, token[0].shape, v1::FP32, item->mutable_q());
  FloatsToTensor(token[1].values, token[1].shape, v1::FP32, item->mutable_k());
  FloatsToTensor(token[2].values, token[2].shape, v1::FP32, item->mutable_v());
  return request;
}

v1::CreateSessionRequest RecoveryTestSession(const std::string& id) {
  v1::CreateSessionRequest create;
  create.set_session_id(id);
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  create.mutable_heads()->set_rope_theta(10000);
  create.set_cache_dtype(v1::BF16);
  return create;
}

// Session `session`'s outputs for tokens [first, last) of `tokens` (one call each), appended to *outputs.
void Feed(Session& session, const std::vector<std::vector<Array>>& tokens, size_t first, size_t last,
          std::vector<std::vector<float>>* outputs) {
  for (size_t i = first; i < last; ++i) {
    absl::StatusOr<ExtendOutputs> out = session.Extend(0, tokens[i][0], tokens[i][1], tokens[i][2]);
    ASSERT_TRUE(out.ok()) << "call " << i << ": " << out.status();
    outputs->push_back(out->output.values);
  }
}

// Tokens attached from the prefix cache are never sent, so no record could rebuild them.
TEST_F(AttentionClientTest, ARecordingSessionRefusesPrefixKeys) {
  v1::CreateSessionRequest request = RecoveryTestSession("attached");
  request.add_prefix_keys("k0");
  const absl::StatusOr<Session> session = Session::CreateRecovering(client_.get(), request);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(session.status().message(), ::testing::HasSubstr("prefix_keys"));
}

TEST_F(AttentionClientTest, ARecordingSessionClosedBehindItsBackIsRebuiltWithItsForkAndTruncation) {
  std::vector<std::vector<Array>> tokens = {HeadTokens(12, 1)};
  for (uint32_t step = 0; step < 6; ++step) tokens.push_back(HeadTokens(1, 10 + 3 * step));
  absl::StatusOr<Session> plain = Session::Create(client_.get(), RecoveryTestSession("plain"));
  absl::StatusOr<Session> session = Session::CreateRecovering(client_.get(), RecoveryTestSession("recorded"));
  ASSERT_TRUE(plain.ok() && session.ok()) << plain.status() << " " << session.status();
  EXPECT_TRUE(session->recovering());
  std::vector<std::vector<float>> want, got;
  Feed(*plain, tokens, 0, 3, &want);
  Feed(*session, tokens, 0, 3, &got);
  ASSERT_TRUE(client_->CloseSession("recorded").ok());
  ASSERT_TRUE(plain->Truncate(13).ok());
  ASSERT_TRUE(session->Truncate(13).ok());  // finds it gone: rebuilt, then cut
  EXPECT_EQ(session->recoveries(), 1);
  EXPECT_EQ(session->info().lengths(0), 13);
  absl::StatusOr<Session> plain_fork = plain->Fork("plain-fork");
  absl::StatusOr<Session> fork = session->Fork("recorded-fork");
  ASSERT_TRUE(plain_fork.ok() && fork.ok()) << plain_fork.status() << " " << fork.status();
  ASSERT_TRUE(client_->CloseSession("recorded-fork").ok());
  Feed(*plain_fork, tokens, 3, 5, &want);
  Feed(*fork, tokens, 3, 5, &got);  // its record: the parent's 13 tokens
  EXPECT_EQ(fork->recoveries(), 1);
  Feed(*plain, tokens, 5, 7, &want);
  Feed(*session, tokens, 5, 7, &got);
  EXPECT_EQ(got, want);  // bit for bit
}

TEST_F(AttentionClientTest, ARecordingSessionGoesOnOnARestartedServer) {
  absl::StatusOr<Session> session = Session::CreateRecovering(client_.get(), RecoveryTestSession("restarted"));
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<std::vector<Array>> tokens = {HeadTokens(8, 1), HeadTokens(1, 5), HeadTokens(1, 9)};
  std::vector<std::vector<float>> got;
  Feed(*session, tokens, 0, 2, &got);
  ASSERT_NO_FATAL_FAILURE(RestartServer());
  Feed(*session, tokens, 2, 3, &got);  // UNAVAILABLE or NOT_FOUND first, then rebuilt
  EXPECT_EQ(session->recoveries(), 1);
  EXPECT_EQ(session->info().lengths(0), 10);
  absl::StatusOr<Session> plain = Session::Create(client_.get(), RecoveryTestSession("uninterrupted"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  std::vector<std::vector<float>> want;
  Feed(*plain, tokens, 0, 3, &want);
  EXPECT_EQ(got, want);
}

// A stream idle while its server restarted ended with it; the next step, which it never sent, goes on a new one.
TEST_F(AttentionClientTest, AStreamThatEndedWhileIdleDoesNotFailTheNextStep) {
  absl::StatusOr<Session> before = Session::Create(client_.get(), RecoveryTestSession("same-id"));
  ASSERT_TRUE(before.ok()) << before.status();
  std::vector<std::vector<Array>> tokens = {HeadTokens(8, 1), HeadTokens(1, 5)};
  std::vector<std::vector<float>> got;
  Feed(*before, tokens, 0, 1, &got);
  ASSERT_NO_FATAL_FAILURE(RestartServer());
  ASSERT_TRUE(client_->GetServerInfo().ok());  // the channel has reconnected
  absl::StatusOr<Session> after = Session::Create(client_.get(), RecoveryTestSession("same-id"));
  ASSERT_TRUE(after.ok()) << after.status();
  Feed(*after, tokens, 0, 2, &got);  // on the new server: no error from the stream that ended
  EXPECT_EQ(after->info().lengths(0), 9);
  EXPECT_THAT(server_->metrics().Text(), ::testing::HasSubstr("rpc=\"ExtendStream\""));
}

TEST_F(AttentionClientTest, ExtendRecoveringRebuildsOnlyTheLostSessionsOfABatch) {
  std::vector<SessionRecord> records;
  for (const char* id : {"batch-0", "batch-1"}) {
    ASSERT_TRUE(client_->CreateSession(RecoveryTestSession(id)).ok());
    records.emplace_back(RecoveryTestSession(id));
  }
  std::vector<SessionRecord*> pointers = {&records[0], &records[1]};
  const auto batch = [&](int64_t n, uint32_t seed) {
    v1::ExtendRequest request;
    request.set_output_dtype(v1::FP32);
    for (const SessionRecord& record : records) {
      std::vector<Array> qkv = HeadTokens(n, seed++);
      v1::ExtendItem* item = request.add_items();
      item->set_session_id(record.id());
      FloatsToTensor(qkv[0].values, qkv[0].shape, v1::FP32, item->mutable_q());
      FloatsToTensor(qkv[1].values, qkv[1].shape, v1::FP32, item->mutable_k());
      FloatsToTensor(qkv[2].values, qkv[2].shape, v1::FP32, item->mutable_v());
    }
    return request;
  };
  int64_t recoveries = 0;
  ASSERT_TRUE(ExtendRecovering(*client_, batch(6, 1), pointers, RecoveryOptions(), &recoveries).ok());
  ASSERT_TRUE(client_->CloseSession("batch-1").ok());
  absl::StatusOr<v1::ExtendResponse> step =
      ExtendRecovering(*client_, batch(1, 20), pointers, RecoveryOptions(), &recoveries);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(recoveries, 1);  // batch-0 answered ALREADY_EXISTS after NOT_FOUND: kept as it was
  EXPECT_EQ(step->results(0).length(), 7);
  EXPECT_EQ(step->results(1).length(), 7);
  EXPECT_EQ(records[1].length(0), 7);
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
  EXPECT_FALSE(client.Extend(extend).ok());
  EXPECT_THAT(recorder.seen(),
              ::testing::ElementsAre(::testing::Pair("/mha.v1.Attention/CreateSession", "s-1"),
                                     // refused before any metadata, as by a server without streams: then unary
                                     ::testing::Pair("/mha.v1.Attention/ExtendStream", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/Extend", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/ForkSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/TruncateSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/CloseSession", "s-1"),
                                     ::testing::Pair("/mha.v1.Attention/Extend", "s-1")));  // unary from then on
  EXPECT_FALSE(client.streams_extends());
  server->Shutdown();
}

TEST_F(AttentionClientTest, ExtendsGoOverStreamsAndGoOnAfterAFailedStep) {
  v1::CreateSessionRequest create;
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  absl::StatusOr<v1::CreateSessionResponse> created = client_->CreateSession(create);
  ASSERT_TRUE(created.ok()) << created.status();
  const auto step = [&](const std::string& id, uint32_t seed) { return client_->Extend(OneTokenStep(id, seed)); };
  const std::string id = created->session().session_id();
  for (int i = 1; i <= 3; ++i) {
    absl::StatusOr<v1::ExtendResponse> response = step(id, i);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->results(0).length(), i);
  }
  EXPECT_EQ(step("missing", 4).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::ExtendResponse> after = step(id, 5);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->results(0).length(), 4);
  EXPECT_TRUE(client_->streams_extends());
  const std::string metrics = server_->metrics().Text();
  EXPECT_THAT(metrics, ::testing::HasSubstr("rpc=\"ExtendStream\""));
  EXPECT_THAT(metrics, ::testing::Not(::testing::HasSubstr("rpc=\"Extend\"")));
}

// Calls of `rpc` that ended OK, from the server's metrics.
int64_t OkCalls(const std::string& metrics, const std::string& rpc) {
  int64_t total = 0;
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (absl::StartsWith(line, "mha_requests_total{") && absl::StrContains(line, "code=\"OK\"") &&
        absl::StrContains(line, absl::StrCat("rpc=\"", rpc, "\""))) {
      total += std::stoll(std::string(line.substr(line.rfind(' ') + 1)));
    }
  }
  return total;
}

// A routing proxy sends a stream where its session's id hashes, so a stream carries one session's steps; past the
// cap a session steps unary, until a stream idle for kStaleAfter gives it its place.
TEST_F(AttentionClientTest, StreamsAreOnePerSessionUpToTheCap) {
  ClientOptions options = client_->options();
  options.max_extend_streams = 2;
  AttentionClient client(options);
  v1::CreateSessionRequest create;
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::CreateSessionResponse> created = client.CreateSession(create);
    ASSERT_TRUE(created.ok()) << created.status();
    ids.push_back(created->session().session_id());
  }
  const auto step = [&](const std::string& id) {
    absl::StatusOr<v1::ExtendResponse> response = client.Extend(OneTokenStep(id, 3));
    EXPECT_TRUE(response.ok()) << response.status();
  };
  for (int round = 0; round < 3; ++round) {
    for (const std::string& id : ids) step(id);
  }
  EXPECT_EQ(OkCalls(server_->metrics().Text(), "ExtendStream"), 6);  // the first two sessions, on a stream each
  EXPECT_EQ(OkCalls(server_->metrics().Text(), "Extend"), 3);        // the third, unary
  absl::SleepFor(ExtendStreams::kStaleAfter + absl::Milliseconds(100));
  step(ids[2]);  // takes the place of a stream idle since
  EXPECT_EQ(OkCalls(server_->metrics().Text(), "ExtendStream"), 7);
}

}  // namespace
}  // namespace mha
