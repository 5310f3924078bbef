// How the scheduler computes Extend calls: decode steps of many sessions that wait together run as one ragged
// paged call (continuous batching) and answer as they would alone; calls that differ in what the backend shares
// do not batch; a prefill computes in chunks of --max_prefill_chunk rows, answers as one call would, and lets
// other sessions' steps run between its chunks, while the calls on its own session wait for all of it.
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "tests/session_fixture.h"

namespace mha::testing {
namespace {

constexpr int64_t kChunk = 64;

class SessionBatchingTest : public SessionTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.kv_cache_mb = 64;
    options.max_sessions = 64;
    options.max_session_tokens = 4096;
    options.inline_max_mflop = 0;  // every call goes through the queue, where batching happens
    options.max_prefill_chunk = kChunk;
    options.prefill_quiet_ms = 0;  // every step bounded in work too, however long the prefill takes
    StartServer(options);
  }

  // An Extend made on another thread; `status` holds how it ended.
  struct PendingExtend {
    v1::ExtendRequest request;
    grpc::ClientContext context;
    v1::ExtendResponse response;
    std::future<grpc::Status> status;
  };
  std::unique_ptr<PendingExtend> StartExtend(v1::ExtendRequest request) {
    auto call = std::make_unique<PendingExtend>();
    call->request = std::move(request);
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    call->status = std::async(std::launch::async, [this, c = call.get()] {
      return stub_->Extend(&c->context, c->request, &c->response);
    });
    return call;
  }

  // Queues `requests` behind a long stateless call, then lets them run: they wait together, so the compute thread
  // takes the ones that share a batch key as one batch. Returns their responses.
  std::vector<v1::ExtendResponse> RunTogether(std::vector<v1::ExtendRequest> requests) {
    std::unique_ptr<BackgroundCall> blocker = Start(SlowDemoRequest(16));
    std::vector<std::unique_ptr<PendingExtend>> calls;
    for (v1::ExtendRequest& request : requests) calls.push_back(StartExtend(std::move(request)));
    EXPECT_TRUE(server_->scheduler().AwaitQueued(static_cast<int>(calls.size()), absl::Seconds(30)));
    CancelAndWait(blocker.get());
    std::vector<v1::ExtendResponse> responses;
    for (auto& call : calls) {
      const grpc::Status status = call->status.get();
      EXPECT_TRUE(status.ok()) << status.error_message();
      responses.push_back(call->response);
    }
    return responses;
  }

  int64_t BackendCalls() { return MetricValue(server_->metrics().Text(), "mha_batch_size_count"); }
};

TEST_F(SessionBatchingTest, DecodeStepsOfManySessionsRunAsOneBatchAndAnswerAsAlone) {
  constexpr int kSessions = 6;
  std::vector<std::string> batched, alone;
  for (int i = 0; i < kSessions; ++i) {
    batched.push_back(Created(HeadSession()));
    alone.push_back(Created(HeadSession()));
    for (const std::string& id : {batched[i], alone[i]}) {
      ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 5 + 7 * i, 10 * i)})).ok());
    }
  }
  std::vector<v1::ExtendRequest> steps;
  for (int i = 0; i < kSessions; ++i) steps.push_back(ExtendOf({QkvItem(batched[i], 1, 100 + i)}));
  const int64_t joined_before = CallsJoiningABatch(server_->metrics().Text());
  const std::vector<v1::ExtendResponse> together = RunTogether(steps);
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()) - joined_before, kSessions - 1);  // one batch of 6
  for (int i = 0; i < kSessions; ++i) {
    v1::ExtendResponse single;
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(alone[i], 1, 100 + i)}), &single).ok());
    EXPECT_EQ(together[i].results(0).length(), 6 + 7 * i);
    EXPECT_TRUE(AllClose(TensorToFloats(together[i].results(0).output()),
                         TensorToFloats(single.results(0).output()), 1e-6, 1e-5))
        << "session " << i;
  }
}

TEST_F(SessionBatchingTest, LayerSessionsOfOneLayerBatch) {
  const std::string a = Created(LayerSession()), b = Created(LayerSession());
  ASSERT_TRUE(Extend(ExtendOf({XItem(a, 3, 1)})).ok());
  ASSERT_TRUE(Extend(ExtendOf({XItem(b, 9, 2)})).ok());
  const int64_t joined_before = CallsJoiningABatch(server_->metrics().Text());
  const std::vector<v1::ExtendResponse> responses =
      RunTogether({ExtendOf({XItem(a, 1, 3)}), ExtendOf({XItem(b, 2, 4)})});
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()) - joined_before, 1);
  EXPECT_EQ(responses[0].results(0).length(), 4);
  EXPECT_THAT(responses[1].results(0).output().shape(), ::testing::ElementsAre(2, kDemo));
}

TEST_F(SessionBatchingTest, CallsThatDifferInWhatTheBackendSharesDoNotBatch) {
  const std::string plain = Created(HeadSession()), weights = Created(HeadSession()), layer = Created(LayerSession());
  v1::CreateSessionRequest other_heads = HeadSession();
  other_heads.mutable_heads()->set_num_kv_heads(4);
  const std::string wide = Created(other_heads);
  v1::CreateSessionRequest bf16 = HeadSession();
  bf16.set_cache_dtype(v1::BF16);
  const std::string rounded = Created(bf16);
  v1::ExtendRequest with_weights = ExtendOf({QkvItem(weights, 1)});
  with_weights.set_return_attention_weights(true);
  v1::ExtendItem wide_item = QkvItem(wide, 1);
  SetTensor(wide_item.mutable_k(), {1, 4, 8}, 5);
  SetTensor(wide_item.mutable_v(), {1, 4, 8}, 6);
  const int64_t joined_before = CallsJoiningABatch(server_->metrics().Text());
  const std::vector<v1::ExtendResponse> responses =
      RunTogether({ExtendOf({QkvItem(plain, 1)}), with_weights, ExtendOf({XItem(layer, 1)}), ExtendOf({wide_item}),
                   ExtendOf({QkvItem(rounded, 1)})});
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()) - joined_before, 0);
  EXPECT_THAT(responses[1].results(0).attention_weights().shape(), ::testing::ElementsAre(4, 1, 1));
}

// A prefill of `tokens` after 5 cached tokens, computed in chunks (64 rows while its rows see up to about 512 keys,
// then fewer as they see more: 1200 tokens end in steps of 31, 30, 29 and 7), against the same prefill on a twin
// computed whole (a call that asks for lse computes in one step).
struct ChunkCase {
  std::string name;
  bool layer;
  v1::DataType cache;
  int64_t tokens;
  int64_t backend_calls;  // steps of at most kChunk rows and kChunk (512 + (kChunk + 1) / 2) query-key pairs per head
  // The conformance suite's: a last chunk of a few rows takes the decode path, which with a bf16 cache multiplies
  // at bf16 precision where the whole call's rows take the fp32 path.
  double tolerance;
};

class ChunkedPrefillTest : public SessionBatchingTest, public ::testing::WithParamInterface<ChunkCase> {};

TEST_P(ChunkedPrefillTest, APrefillComputesInChunksAndAnswersAsOneCall) {
  const ChunkCase& c = GetParam();
  const v1::CreateSessionRequest create = c.layer ? LayerSession("", c.cache) : [&] {
    v1::CreateSessionRequest r = HeadSession();
    r.set_cache_dtype(c.cache);
    return r;
  }();
  const std::string chunked = Created(create), whole = Created(create);
  auto item = [&](const std::string& id, int64_t n, uint32_t seed) {
    return c.layer ? XItem(id, n, seed) : QkvItem(id, n, seed);
  };
  for (const std::string& id : {chunked, whole}) ASSERT_TRUE(Extend(ExtendOf({item(id, 5, 1)})).ok());

  v1::ExtendResponse got, want;
  int64_t calls = BackendCalls();
  ASSERT_TRUE(Extend(ExtendOf({item(chunked, c.tokens, 2)}), &got).ok());
  EXPECT_EQ(BackendCalls() - calls, c.backend_calls);
  v1::ExtendRequest one_step = ExtendOf({item(whole, c.tokens, 2)});
  one_step.set_return_lse(true);
  calls = BackendCalls();
  ASSERT_TRUE(Extend(one_step, &want).ok());
  EXPECT_EQ(BackendCalls() - calls, 1);
  EXPECT_EQ(got.results(0).length(), 5 + c.tokens);
  EXPECT_TRUE(AllClose(TensorToFloats(got.results(0).output()), TensorToFloats(want.results(0).output()),
                       c.tolerance, c.tolerance));
  // The caches hold the same keys and values: the next step answers alike.
  ASSERT_TRUE(Extend(ExtendOf({item(chunked, 1, 3)}), &got).ok());
  ASSERT_TRUE(Extend(ExtendOf({item(whole, 1, 3)}), &want).ok());
  EXPECT_TRUE(AllClose(TensorToFloats(got.results(0).output()), TensorToFloats(want.results(0).output()),
                       c.tolerance, c.tolerance));
}

INSTANTIATE_TEST_SUITE_P(Sessions, ChunkedPrefillTest,
                         ::testing::Values(ChunkCase{"HeadsFp32", false, v1::FP32, 1200, 26, 2e-5},
                                           ChunkCase{"HeadsBf16", false, v1::BF16, 900, 16, 1e-2},
                                           ChunkCase{"LayerFp32", true, v1::FP32, 700, 12, 2e-5},
                                           ChunkCase{"LayerBf16", true, v1::BF16, 130, 3, 1e-2}),
                         [](const auto& info) { return info.param.name; });

TEST_F(SessionBatchingTest, OtherSessionsStepsRunBetweenAPrefillsChunksAndItsOwnWaitForAllOfIt) {
  const std::string long_prefill = Created(LayerSession()), other = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(other, 8)})).ok());
  std::unique_ptr<PendingExtend> prefill = StartExtend(ExtendOf({XItem(long_prefill, 4000, 1)}));  // 3265 chunks
  ASSERT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
  std::unique_ptr<PendingExtend> own_step = StartExtend(ExtendOf({XItem(long_prefill, 1, 2)}));
  v1::ExtendResponse step;
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(other, 1, 3)}), &step).ok());
  // The other session's step answered while the prefill still had chunks to compute (3265 of them), and its own
  // next step waits for it.
  EXPECT_EQ(prefill->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(own_step->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(step.results(0).length(), 9);
  ASSERT_TRUE(prefill->status.get().ok());
  ASSERT_TRUE(own_step->status.get().ok());
  EXPECT_EQ(prefill->response.results(0).length(), 4000);
  EXPECT_EQ(own_step->response.results(0).length(), 4001);
}

// With the server's default inline policy, a call small enough to compute on the gRPC thread computes every step
// there.
class InlineChunkTest : public SessionTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.max_prefill_chunk = kChunk;
    StartServer(options);
  }
};

TEST_F(InlineChunkTest, ASmallPrefillInChunksRunsInlineToItsEnd) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 5)})).ok());
  v1::ExtendResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  const grpc::Status status = stub_->Extend(&context, ExtendOf({QkvItem(id, 200, 2)}), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.results(0).length(), 205);
  EXPECT_EQ(MetricValue(server_->metrics().Text(), "mha_batch_size_count"), 0);  // nothing went through the queue
}

class QuietPrefillTest : public SessionTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.inline_max_mflop = 0;
    options.max_prefill_chunk = kChunk;
    options.prefill_quiet_ms = 1;
    StartServer(options);
  }
};

TEST_F(QuietPrefillTest, APrefillAloneOnTheServerTakesStepsOfWholeChunks) {
  const std::string id = Created(LayerSession());
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 5)})).ok());
  absl::SleepFor(absl::Milliseconds(5));
  const int64_t calls = MetricValue(server_->metrics().Text(), "mha_batch_size_count");
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 1000, 2)}), &response).ok());
  EXPECT_EQ(response.results(0).length(), 1005);
  // 64-row steps once the call is a millisecond old (16 of them at best), where work-bounded ones take 282.
  const int64_t steps = MetricValue(server_->metrics().Text(), "mha_batch_size_count") - calls;
  EXPECT_GE(steps, 16);
  EXPECT_LT(steps, 100);
}

TEST_F(SessionBatchingTest, ACancelledChunkedPrefillChangesNoSession) {
  const std::string id = Created(LayerSession());
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 3)})).ok());
  std::unique_ptr<PendingExtend> prefill = StartExtend(ExtendOf({XItem(id, 1000, 1)}));
  ASSERT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
  prefill->context.TryCancel();
  EXPECT_EQ(prefill->status.get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Length(id), 3);
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 1)}), &response).ok());
  EXPECT_EQ(response.results(0).length(), 4);
}

}  // namespace
}  // namespace mha::testing
