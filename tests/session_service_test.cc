// The session RPCs through an in-process channel: what each returns, every error with its exact status code and the
// field it names, atomicity, ordering, expiry, the limits in GetServerInfo, the metrics, and calls on one session
// from many threads at once.
#include <atomic>
#include <chrono>
#include <future>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/registry.h"
#include "tests/session_fixture.h"

namespace mha::testing {
namespace {

using ::testing::HasSubstr;

class SessionServiceTest : public SessionTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.kv_cache_mb = 16;
    options.max_sessions = 16;
    options.max_session_tokens = 4096;
    StartServer(options);
  }
};

TEST_F(SessionServiceTest, ALayerSessionStartsEmptyWithTheServersDefaults) {
  v1::SessionInfo info;
  ASSERT_TRUE(Create(LayerSession("chat-1"), &info).ok());
  EXPECT_EQ(info.session_id(), "chat-1");
  EXPECT_THAT(info.lengths(), ::testing::ElementsAre(0));
  EXPECT_EQ(info.max_tokens(), 4096);
  EXPECT_EQ(info.cache_dtype(), v1::FP32);
  EXPECT_EQ(info.cache_bytes(), 0);
  EXPECT_THAT(info.layers(), ::testing::ElementsAre("demo"));
  EXPECT_EQ(info.idle_timeout_s(), 300);
}

TEST_F(SessionServiceTest, AHeadSessionHasNumLayersCachesAndItsResolvedHeads) {
  v1::SessionInfo info;
  ASSERT_TRUE(Create(HeadSession("", 3), &info).ok());
  EXPECT_EQ(info.session_id().size(), 32u);
  EXPECT_EQ(info.lengths_size(), 3);
  EXPECT_EQ(info.heads().num_kv_heads(), 2);
  EXPECT_FLOAT_EQ(info.heads().scale(), 1.0f / std::sqrt(8.0f));
}

// GPT-2's scale_attn_by_inverse_layer_idx, and a RoPE layer beside a NoPE one: two caches of one head session, each
// with its own HeadConfig.
class LayerHeadsTest : public SessionServiceTest {
 protected:
  static v1::CreateSessionRequest TwoLayerHeads() {
    v1::CreateSessionRequest r = HeadSession("", 2);
    v1::HeadConfig* first = r.add_layer_heads();
    first->set_scale(0.5f);
    v1::HeadConfig* second = r.add_layer_heads();
    second->set_scale(0.125f);
    second->set_rope_theta(10000);
    second->mutable_rope_scaling()->set_rope_type("linear");
    second->mutable_rope_scaling()->set_factor(4);
    return r;
  }
};

TEST_F(LayerHeadsTest, EachCacheComputesWithItsOwnConfiguration) {
  v1::SessionInfo info;
  ASSERT_TRUE(Create(TwoLayerHeads(), &info).ok());
  ASSERT_EQ(info.layer_heads_size(), 2);
  EXPECT_FLOAT_EQ(info.layer_heads(1).scale(), 0.125f);
  EXPECT_EQ(info.layer_heads(1).rope_scaling().rope_type(), "linear");
  EXPECT_EQ(info.layer_heads(0).num_kv_heads(), 2);
  for (int layer = 0; layer < 2; ++layer) {
    const v1::ExtendItem item = QkvItem(info.session_id(), 5, 3);
    v1::ExtendResponse response;
    ASSERT_TRUE(Extend(ExtendOf({item}, layer), &response).ok());
    // The same tokens as one causal stateless call with that cache's configuration.
    v1::ScaledDotProductAttentionRequest sdpa;
    for (const auto& [from, to] : {std::pair{&item.q(), sdpa.mutable_q()}, std::pair{&item.k(), sdpa.mutable_k()},
                                   std::pair{&item.v(), sdpa.mutable_v()}}) {
      *to = *from;
      to->mutable_shape()->Add(1);  // [n, heads, d_k] -> [1, n, heads, d_k]
      std::rotate(to->mutable_shape()->begin(), to->mutable_shape()->end() - 1, to->mutable_shape()->end());
    }
    *sdpa.mutable_heads() = info.layer_heads(layer);
    sdpa.mutable_heads()->set_causal(true);
    grpc::ClientContext context;
    v1::ScaledDotProductAttentionResponse stateless;
    ASSERT_TRUE(stub_->ScaledDotProductAttention(&context, sdpa, &stateless).ok());
    EXPECT_TRUE(AllClose(TensorToFloats(response.results(0).output()), TensorToFloats(stateless.output()), 1e-5,
                         1e-5))
        << "layer " << layer;
  }
  v1::SessionInfo fork;
  ASSERT_TRUE(Fork(info.session_id(), "", &fork).ok());
  EXPECT_EQ(fork.layer_heads_size(), 2);
}

TEST_F(LayerHeadsTest, AreCheckedEntryByEntry) {
  v1::CreateSessionRequest wrong_count = TwoLayerHeads();
  wrong_count.set_num_layers(3);
  ExpectError(Create(wrong_count), grpc::StatusCode::INVALID_ARGUMENT,
              "layer_heads has 2 entries; give one per cache (num_layers, 3) or none");
  v1::CreateSessionRequest other_layout = TwoLayerHeads();
  other_layout.mutable_layer_heads(1)->set_head_dim(16);
  ExpectError(Create(other_layout), grpc::StatusCode::INVALID_ARGUMENT,
              "layer_heads[1].head_dim is 16; it must be 0 or heads.head_dim (8): a session's caches share one layout");
  v1::CreateSessionRequest bad_rope = TwoLayerHeads();
  bad_rope.mutable_layer_heads(1)->mutable_rope_scaling()->set_factor(-1);
  ExpectError(Create(bad_rope), grpc::StatusCode::INVALID_ARGUMENT, "layer_heads[1].rope_scaling.factor must be");
  v1::CreateSessionRequest layers = LayerSession();
  *layers.add_layer_heads() = v1::HeadConfig();
  ExpectError(Create(layers), grpc::StatusCode::INVALID_ARGUMENT, "layer_heads is for head sessions");
}

TEST_F(SessionServiceTest, ADecodeStepReturnsOneRowAndTheNewLength) {
  const std::string id = Created(LayerSession());
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 5)}), &response).ok());
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 1, 2)}), &response).ok());
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_THAT(response.results(0).output().shape(), ::testing::ElementsAre(1, kDemo));
  EXPECT_EQ(response.results(0).length(), 6);
  EXPECT_EQ(response.backend(), "cpu");
  EXPECT_EQ(Length(id), 6);
}

TEST_F(SessionServiceTest, ChunkedExtendsReturnTheStatelessCausalCallsRows) {
  const std::string id = Created(LayerSession());
  v1::MultiHeadAttentionRequest whole;
  SetTensor(whole.mutable_query(), {1, 9, kDemo}, 7);
  whole.set_layer("demo");
  whole.mutable_heads()->set_causal(true);
  v1::MultiHeadAttentionResponse stateless;
  ASSERT_TRUE(Call(whole, &stateless).ok());
  const std::vector<float> x = TensorToFloats(whole.query()), want = TensorToFloats(stateless.output());
  std::vector<float> got;
  for (const auto [t0, n] : {std::pair{0, 4}, std::pair{4, 1}, std::pair{5, 3}, std::pair{8, 1}}) {
    v1::ExtendItem item;
    item.set_session_id(id);
    FloatsToTensor(absl::MakeConstSpan(x).subspan(t0 * kDemo, n * kDemo), {n, kDemo}, v1::FP32, item.mutable_x());
    v1::ExtendResponse response;
    ASSERT_TRUE(Extend(ExtendOf({item}), &response).ok());
    const std::vector<float> rows = TensorToFloats(response.results(0).output());
    got.insert(got.end(), rows.begin(), rows.end());
  }
  EXPECT_TRUE(AllClose(got, want, 2e-5, 1e-4));
}

TEST_F(SessionServiceTest, ItemsOfOneCallMayBeRagged) {
  const std::string a = Created(HeadSession()), b = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(a, 7)})).ok());
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(a, 1), QkvItem(b, 3)}), &response).ok());
  EXPECT_EQ(response.results(0).length(), 8);
  EXPECT_THAT(response.results(1).output().shape(), ::testing::ElementsAre(3, 4, 8));
  EXPECT_EQ(response.results(1).length(), 3);
}

TEST_F(SessionServiceTest, WeightsCoverTheWholeCache) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 6)})).ok());
  v1::ExtendRequest r = ExtendOf({QkvItem(id, 2)});
  r.set_return_attention_weights(true);
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(r, &response).ok());
  EXPECT_THAT(response.results(0).attention_weights().shape(), ::testing::ElementsAre(4, 2, 8));
  const std::vector<float> w = TensorToFloats(response.results(0).attention_weights());
  EXPECT_FLOAT_EQ(w[7], 0.0f);  // token 6 does not see token 7
}

TEST_F(SessionServiceTest, WithoutAppendTokensAttendToTheCacheAndLeaveIt) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 6)})).ok());
  v1::ExtendItem item = QkvItem(id, 2);
  item.set_append(false);
  item.clear_k();  // unused without append
  item.clear_v();
  v1::ExtendRequest r = ExtendOf({item});
  r.set_return_attention_weights(true);
  r.set_return_lse(true);
  r.set_return_head_stats(true);
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(r, &response).ok());
  EXPECT_EQ(response.results(0).length(), 6);
  EXPECT_EQ(Length(id), 6);
  EXPECT_THAT(response.results(0).attention_weights().shape(), ::testing::ElementsAre(4, 2, 6));
  EXPECT_THAT(response.results(0).lse().shape(), ::testing::ElementsAre(4, 2));
  EXPECT_EQ(response.results(0).head_stats().entropy_size(), 4);
  EXPECT_EQ(response.results(0).head_stats().contribution_size(), 0);  // a head session has no W_O
  // Both new tokens see all six cached keys, and read them from position 6 and 7: the second one further back.
  const std::vector<float> w = TensorToFloats(response.results(0).attention_weights());
  float row0 = 0, row1 = 0;
  for (int j = 0; j < 6; ++j) {
    row0 += w[j];
    row1 += w[6 + j];
  }
  EXPECT_NEAR(row0, 1.0f, 1e-5);
  EXPECT_NEAR(row1, 1.0f, 1e-5);
}

TEST_F(SessionServiceTest, ALayerSessionsHeadStatisticsMatchTheReferences) {
  // The same tokens through two sessions, one on each backend: a prefill, then a decode step (the decode path) and
  // a chunk (the gather path) with every statistic, contribution included.
  const std::string cpu = Created(LayerSession()), reference = Created(LayerSession());
  for (int64_t n : {0, 1, 6}) {
    std::vector<v1::ExtendResponse> responses(2);
    for (int k = 0; k < 2; ++k) {
      v1::ExtendRequest r = ExtendOf({XItem(k == 0 ? cpu : reference, n == 0 ? 9 : n, static_cast<uint32_t>(n + 3))});
      r.set_backend(k == 0 ? v1::BACKEND_CPU : v1::BACKEND_REFERENCE);
      r.set_return_head_stats(n > 0);
      r.set_return_lse(n > 0);
      ASSERT_TRUE(Extend(r, &responses[k]).ok());
    }
    if (n == 0) continue;
    const v1::ExtendResult &got = responses[0].results(0), &want = responses[1].results(0);
    EXPECT_EQ(got.head_stats().contribution_size(), 8);
    EXPECT_TRUE(AllClose(TensorToFloats(got.lse()), TensorToFloats(want.lse()), 1e-4, 1e-4)) << n;
    for (const auto& [name, g, w] :
         {std::tuple{"contribution", &got.head_stats().contribution(), &want.head_stats().contribution()},
          std::tuple{"entropy", &got.head_stats().entropy(), &want.head_stats().entropy()},
          std::tuple{"distance", &got.head_stats().distance(), &want.head_stats().distance()}}) {
      EXPECT_TRUE(AllClose({g->begin(), g->end()}, {w->begin(), w->end()}, 1e-4, 1e-4)) << name << " n=" << n;
    }
  }
}

TEST_F(SessionServiceTest, WithoutAppendAnEmptyCacheIsAFailedPrecondition) {
  const std::string id = Created(HeadSession());
  v1::ExtendItem item = QkvItem(id, 1);
  item.set_append(false);
  ExpectError(Extend(ExtendOf({item})), grpc::StatusCode::FAILED_PRECONDITION, "append=false");
  v1::ExtendRequest r = ExtendOf({QkvItem(id, 1)});
  r.set_sink_tokens(2000000);
  ExpectError(Extend(r), grpc::StatusCode::INVALID_ARGUMENT, "sink_tokens");
}

TEST_F(SessionServiceTest, CreateErrorsNameTheField) {
  v1::CreateSessionRequest neither;
  ExpectError(Create(neither), grpc::StatusCode::INVALID_ARGUMENT, "layers or heads is required");
  v1::CreateSessionRequest both = LayerSession();
  *both.mutable_heads() = HeadSession().heads();
  ExpectError(Create(both), grpc::StatusCode::INVALID_ARGUMENT, "not both");
  v1::CreateSessionRequest unknown = LayerSession();
  unknown.set_layers(0, "nope");
  ExpectError(Create(unknown), grpc::StatusCode::NOT_FOUND, "layers[0]");
  ExpectError(Create(LayerSession("bad id")), grpc::StatusCode::INVALID_ARGUMENT, "session_id");
  v1::CreateSessionRequest no_dim = HeadSession();
  no_dim.mutable_heads()->set_head_dim(0);
  ExpectError(Create(no_dim), grpc::StatusCode::INVALID_ARGUMENT, "heads.head_dim");
  ExpectError(Create(HeadSession("", -1)), grpc::StatusCode::INVALID_ARGUMENT, "num_layers");
  v1::CreateSessionRequest dtype = LayerSession();
  dtype.set_cache_dtype(static_cast<v1::DataType>(9));
  ExpectError(Create(dtype), grpc::StatusCode::INVALID_ARGUMENT, "cache_dtype");
  v1::CreateSessionRequest long_one = LayerSession();
  long_one.set_max_tokens(4097);
  ExpectError(Create(long_one), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  v1::CreateSessionRequest rope = HeadSession();
  rope.mutable_heads()->set_rope_dim(4);
  ExpectError(Create(rope), grpc::StatusCode::INVALID_ARGUMENT, "heads.rope_dim");
}

// An 8-bit cache (blocks of 32 tokens, d_k 8): per KV head and block, 8 x 32 key codes and 8 bf16 key scales,
// 32 x 8 value codes and 32 bf16 value scales; its session decodes like any other.
TEST_F(SessionServiceTest, An8BitCacheStoresAByteAnElementPlusItsScales) {
  for (v1::DataType dtype : {v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    v1::CreateSessionRequest r = HeadSession();
    r.set_cache_dtype(dtype);
    v1::SessionInfo info;
    ASSERT_TRUE(Create(r, &info).ok()) << v1::DataType_Name(dtype);
    EXPECT_EQ(info.cache_dtype(), dtype);
    v1::ExtendResponse response;
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(info.session_id(), 20)}), &response).ok());
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(info.session_id(), 1, 7)}), &response).ok());
    int listed_times = 0;
    for (const v1::SessionInfo& listed : List()) {
      if (listed.session_id() != info.session_id()) continue;
      ++listed_times;
      EXPECT_EQ(listed.cache_bytes(), 2 * (8 * 32 + 2 * 8 + 32 * 8 + 2 * 32));
    }
    EXPECT_EQ(listed_times, 1);
    ASSERT_TRUE(Close(info.session_id()).ok());
  }
}

TEST_F(SessionServiceTest, The8BitDtypesAreForCachesOnly) {
  const std::string id = Created(HeadSession());
  v1::ExtendItem item = QkvItem(id, 1);
  item.mutable_k()->set_dtype(v1::INT8);
  ExpectError(Extend(ExtendOf({item})), grpc::StatusCode::INVALID_ARGUMENT, "for KV caches only");
  v1::ExtendRequest out = ExtendOf({QkvItem(id, 1)});
  out.set_output_dtype(v1::FP8_E4M3);
  ExpectError(Extend(out), grpc::StatusCode::INVALID_ARGUMENT, "output_dtype fp8_e4m3 is for KV caches only");
  EXPECT_EQ(Length(id), 0) << "nothing refused was appended";
}

TEST_F(SessionServiceTest, ATakenIdIsAlreadyExistsAndTheLimitIsResourceExhausted) {
  Created(LayerSession("taken"));
  ExpectError(Create(LayerSession("taken")), grpc::StatusCode::ALREADY_EXISTS, "taken");
  for (int i = 1; i < 16; ++i) Created(HeadSession());
  ExpectError(Create(HeadSession()), grpc::StatusCode::RESOURCE_EXHAUSTED, "--max_sessions");
}

// A call naming more sessions than may be open is refused before it waits for any (each name it waits on costs
// every other session call time while it waits).
TEST_F(SessionServiceTest, AnExtendNamingMoreSessionsThanMayBeOpenIsRefused) {
  std::vector<v1::ExtendItem> items;
  for (int i = 0; i < 17; ++i) items.push_back(XItem(absl::StrCat("s", i), 1));
  ExpectError(Extend(ExtendOf(items)), grpc::StatusCode::INVALID_ARGUMENT,
              "items: 17 given; a call names at most 16 sessions");
}

TEST_F(SessionServiceTest, ExtendRequestErrorsNameTheField) {
  const std::string layer = Created(LayerSession("L")), heads = Created(HeadSession("H"));
  ExpectError(Extend(ExtendOf({})), grpc::StatusCode::INVALID_ARGUMENT, "items");
  ExpectError(Extend(ExtendOf({XItem(layer, 1), XItem(layer, 1)})), grpc::StatusCode::INVALID_ARGUMENT,
              "items[1].session_id repeats items[0]'s");
  ExpectError(Extend(ExtendOf({XItem("no such", 1)})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].session_id");
  v1::ExtendItem both = XItem(layer, 1);
  *both.mutable_q() = QkvItem(heads, 1).q();
  ExpectError(Extend(ExtendOf({both})), grpc::StatusCode::INVALID_ARGUMENT, "exclude each other");
  ExpectError(Extend(ExtendOf({XItem(layer, 1), QkvItem(heads, 1)})), grpc::StatusCode::INVALID_ARGUMENT,
              "items[1]");
  v1::ExtendItem no_v = QkvItem(heads, 1);
  no_v.clear_v();
  ExpectError(Extend(ExtendOf({no_v})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].v is required");
  v1::ExtendItem nan = XItem(layer, 2);
  const float not_a_number = std::nanf("");
  std::memcpy(nan.mutable_x()->mutable_data()->data() + 4 * (kDemo + 3), &not_a_number, 4);
  ExpectError(Extend(ExtendOf({nan})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].x[1, 3] is NaN");
  v1::ExtendRequest index = ExtendOf({XItem(layer, 1)});
  index.set_layer_index(-1);
  ExpectError(Extend(index), grpc::StatusCode::INVALID_ARGUMENT, "layer_index");
  v1::ExtendRequest dtype = ExtendOf({XItem(layer, 1)});
  dtype.set_output_dtype(static_cast<v1::DataType>(5));
  ExpectError(Extend(dtype), grpc::StatusCode::INVALID_ARGUMENT, "output_dtype");
}

TEST_F(SessionServiceTest, ExtendErrorsThatDependOnTheSession) {
  const std::string layer = Created(LayerSession("L")), heads = Created(HeadSession("H"));
  ExpectError(Extend(ExtendOf({XItem("missing", 1)})), grpc::StatusCode::NOT_FOUND, "no session 'missing'");
  ExpectError(Extend(ExtendOf({QkvItem(layer, 1)})), grpc::StatusCode::INVALID_ARGUMENT, "is a layer session");
  ExpectError(Extend(ExtendOf({XItem(heads, 1)})), grpc::StatusCode::INVALID_ARGUMENT, "is a head session");
  v1::ExtendItem narrow = XItem(layer, 1);
  SetTensor(narrow.mutable_x(), {1, 64}, 3);
  ExpectError(Extend(ExtendOf({narrow})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].x.shape must be [n, 512]");
  v1::ExtendItem short_k = QkvItem(heads, 2);
  SetTensor(short_k.mutable_k(), {1, 2, 8}, 3);
  ExpectError(Extend(ExtendOf({short_k})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].k.shape[0]");
  ExpectError(Extend(ExtendOf({XItem(layer, 1)}, 1)), grpc::StatusCode::INVALID_ARGUMENT,
              "layer_index must be in [0, 1)");
  v1::ExtendItem expected = XItem(layer, 1);
  expected.set_expected_length(3);
  ExpectError(Extend(ExtendOf({expected})), grpc::StatusCode::FAILED_PRECONDITION, "expected_length is 3");
  v1::CreateSessionRequest small = HeadSession("small");
  small.set_max_tokens(5);
  Created(small);
  ASSERT_TRUE(Extend(ExtendOf({QkvItem("small", 5)})).ok());
  ExpectError(Extend(ExtendOf({QkvItem("small", 1)})), grpc::StatusCode::OUT_OF_RANGE, "max_tokens (5)");
  Created(LayerSession("half", v1::FP16));
  ExpectError(Extend(ExtendOf({XItem(layer, 1), XItem("half", 1)})), grpc::StatusCode::INVALID_ARGUMENT,
              "caches fp16");
}

TEST_F(SessionServiceTest, AFailedCallChangesNoSession) {
  const std::string a = Created(HeadSession()), b = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(a, 3)})).ok());
  v1::ExtendItem bad = QkvItem(b, 2);
  bad.set_expected_length(1);
  ExpectError(Extend(ExtendOf({QkvItem(a, 1), bad})), grpc::StatusCode::FAILED_PRECONDITION, "items[1]");
  EXPECT_EQ(Length(a), 3);
  EXPECT_EQ(Length(b), 0);
}

TEST_F(SessionServiceTest, ExpectedLengthLetsARetryKnowWhetherItsAppendHappened) {
  const std::string id = Created(HeadSession());
  v1::ExtendItem step = QkvItem(id, 1);
  step.set_expected_length(0);
  ASSERT_TRUE(Extend(ExtendOf({step})).ok());
  ExpectError(Extend(ExtendOf({step})), grpc::StatusCode::FAILED_PRECONDITION, "holds 1 tokens");
  EXPECT_EQ(Length(id), 1);
}

TEST_F(SessionServiceTest, ClosedSessionsAreNotFoundSayingSo) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Close(id).ok());
  ExpectError(Extend(ExtendOf({QkvItem(id, 1)})), grpc::StatusCode::NOT_FOUND, "was closed");
  ExpectError(Close(id), grpc::StatusCode::NOT_FOUND, "was closed");
  ExpectError(Close("never"), grpc::StatusCode::NOT_FOUND, "no session 'never'");
  ExpectError(Close(""), grpc::StatusCode::INVALID_ARGUMENT, "session_id");
}

TEST_F(SessionServiceTest, AForkSharesItsSourcesBlocksAndDivergesOnItsOwn) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 20)})).ok());
  v1::SessionInfo fork;
  ASSERT_TRUE(Fork(id, "beam-2", &fork).ok());
  EXPECT_EQ(fork.lengths(0), 20);
  EXPECT_EQ(fork.shared_bytes(), fork.cache_bytes());
  v1::ExtendResponse a, b;
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 1, 5), QkvItem("beam-2", 1, 9)}), &a).ok());
  EXPECT_EQ(Length(id), 21);
  EXPECT_EQ(Length("beam-2"), 21);
  ExpectError(Fork(id, "beam-2"), grpc::StatusCode::ALREADY_EXISTS, "beam-2");
  ExpectError(Fork(id, id), grpc::StatusCode::INVALID_ARGUMENT, "new_session_id must differ");
  ExpectError(Fork("gone", ""), grpc::StatusCode::NOT_FOUND, "no session 'gone'");
}

TEST_F(SessionServiceTest, TruncateDropsTokensFromTheEnd) {
  const std::string id = Created(HeadSession("", 2));
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 10)})).ok());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 4)}, 1)).ok());
  v1::SessionInfo info;
  ASSERT_TRUE(Truncate(id, 6, &info).ok());
  EXPECT_THAT(info.lengths(), ::testing::ElementsAre(6, 4));
  ExpectError(Truncate(id, -1), grpc::StatusCode::INVALID_ARGUMENT, "length");
  ExpectError(Truncate("gone", 0), grpc::StatusCode::NOT_FOUND, "gone");
}

TEST_F(SessionServiceTest, ALayerUnloadedAfterTheSessionIsAFailedPrecondition) {
  v1::LoadLayerRequest load;
  load.set_name("tmp");
  *load.mutable_weights() = ValidRequest().inline_weights();
  load.mutable_heads()->set_num_heads(kHeads);
  {
    grpc::ClientContext context;
    v1::LoadLayerResponse response;
    ASSERT_TRUE(stub_->LoadLayer(&context, load, &response).ok());
  }
  v1::CreateSessionRequest r;
  r.add_layers("tmp");
  const std::string id = Created(r);
  {
    grpc::ClientContext context;
    v1::UnloadLayerRequest unload;
    unload.set_name("tmp");
    v1::UnloadLayerResponse response;
    ASSERT_TRUE(stub_->UnloadLayer(&context, unload, &response).ok());
  }
  v1::ExtendItem item;
  item.set_session_id(id);
  SetTensor(item.mutable_x(), {1, kDModel}, 1);
  ExpectError(Extend(ExtendOf({item})), grpc::StatusCode::FAILED_PRECONDITION, "was unloaded");
}

TEST_F(SessionServiceTest, ALayerThatProjectsKeysFromOtherFeaturesCannotServeASession) {
  v1::LoadLayerRequest load;
  load.set_name("cross");
  v1::AttentionWeights* w = load.mutable_weights();
  SetTensor(w->mutable_w_q(), {8, 8}, 1);
  SetTensor(w->mutable_w_k(), {4, 8}, 2);
  SetTensor(w->mutable_w_v(), {4, 8}, 3);
  SetTensor(w->mutable_w_o(), {8, 8}, 4);
  load.mutable_heads()->set_num_heads(2);
  grpc::ClientContext context;
  v1::LoadLayerResponse response;
  ASSERT_TRUE(stub_->LoadLayer(&context, load, &response).ok());
  v1::CreateSessionRequest r;
  r.add_layers("cross");
  ExpectError(Create(r), grpc::StatusCode::INVALID_ARGUMENT, "d_kv_in = d_v_in = d_model");
}

TEST_F(SessionServiceTest, AFullCacheEvictsTheLeastRecentlyUsedIdleSession) {
  // 16 MiB pool; the demo layer's cache is 2 * 8 * 64 * 4 = 4 KiB per token: 4096 tokens in all.
  const std::string old_one = Created(LayerSession()), newer = Created(LayerSession());
  ASSERT_TRUE(Extend(ExtendOf({XItem(old_one, 2000)})).ok());
  ASSERT_TRUE(Extend(ExtendOf({XItem(newer, 1500)})).ok());
  ASSERT_TRUE(Extend(ExtendOf({XItem(newer, 1000)})).ok());  // needs old_one's blocks
  ExpectError(Extend(ExtendOf({XItem(old_one, 1)})), grpc::StatusCode::NOT_FOUND, "was evicted");
  EXPECT_EQ(Length(newer), 2500);
  EXPECT_THAT(server_->metrics().Text(), HasSubstr("mha_session_evictions_total{reason=\"cache_full\"} 1"));
}

TEST_F(SessionServiceTest, ACallLargerThanThePoolIsResourceExhaustedSayingHowFull) {
  const std::string a = Created(LayerSession()), b = Created(LayerSession());
  ExpectError(Extend(ExtendOf({XItem(a, 2100), XItem(b, 2100)})), grpc::StatusCode::RESOURCE_EXHAUSTED,
              "the KV cache is full");
  EXPECT_EQ(Length(a), 0);
  EXPECT_EQ(Length(b), 0);
}

TEST_F(SessionServiceTest, ServerInfoListsTheSessionLimits) {
  grpc::ClientContext context;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.limits().kv_cache_bytes(), 16 << 20);
  EXPECT_EQ(info.limits().kv_block_tokens(), 32);
  EXPECT_EQ(info.limits().max_sessions(), 16);
  EXPECT_EQ(info.limits().max_session_tokens(), 4096);
  EXPECT_EQ(info.limits().session_idle_s(), 300);
  EXPECT_EQ(info.limits().max_session_idle_s(), 3600);
}

TEST_F(SessionServiceTest, ServerInfoListsTheCacheDtypesOfEachBackend) {
  grpc::ClientContext context;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  for (const v1::BackendInfo& backend : info.backends()) {
    if (!backend.available()) {
      EXPECT_EQ(backend.cache_dtypes_size(), 0) << backend.name();
      continue;
    }
    std::vector<int> want = {v1::FP32, v1::FP16, v1::BF16, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2};
    if (backend.name() == "cuda") want.resize(3);
    EXPECT_THAT(backend.cache_dtypes(), ::testing::ElementsAreArray(want)) << backend.name();
  }
}

TEST_F(SessionServiceTest, MetricsCountSessionsBytesAndTokens) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 33)})).ok());  // two blocks of 32
  ASSERT_TRUE(Fork(id, "f").ok());
  const std::string text = server_->metrics().Text();
  EXPECT_THAT(text, HasSubstr("mha_sessions_open 2"));
  EXPECT_THAT(text, HasSubstr("mha_session_tokens_appended_total 33"));
  EXPECT_THAT(text, HasSubstr("mha_kv_cache_shared_blocks 2"));
  EXPECT_THAT(text, HasSubstr("mha_kv_cache_capacity_bytes 16777216"));
  EXPECT_THAT(text, HasSubstr("mha_extend_items_count 1"));
}

// Not compiled in: INVALID_ARGUMENT; compiled in without a usable GPU: UNAVAILABLE with the driver's reason; with
// one: UNIMPLEMENTED (its paged attention is its own issue). BACKEND_AUTO then computes on the CPU.
// BACKEND_CUDA computes sessions where a GPU is, and is UNAVAILABLE (saying why) elsewhere, changing nothing;
// BACKEND_AUTO computes them either way. (The CUDA backend's sessions against the reference: the conformance
// suite, on the emulated runtime and on a GPU.)
TEST_F(SessionServiceTest, CudaComputesSessionsWhereAGpuIsAndAutoAlwaysDoes) {
  const std::string id = Created(HeadSession());
  v1::ExtendRequest r = ExtendOf({QkvItem(id, 1)});
  r.set_backend(v1::BACKEND_CUDA);
  const grpc::Status status = Extend(r);
  int64_t length = 0;
  if (!BackendRegistry::CompiledIn(kCudaBackend)) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("backend 'cuda' is not compiled into this server"));
  } else if (status.ok()) {
    length = 1;
  } else {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }
  EXPECT_EQ(Length(id), length);
  r.set_backend(v1::BACKEND_AUTO);
  v1::ExtendResponse response;
  ASSERT_TRUE(Extend(r, &response).ok());
  EXPECT_THAT(response.backend(), ::testing::AnyOf("cpu", "cuda"));
  EXPECT_EQ(Length(id), length + 1);
}

// A call cancelled while it computes, and one whose deadline passes while it waits behind it for the session:
// neither changes the session.
TEST_F(SessionServiceTest, CancelledAndTimedOutCallsChangeNoSession) {
  const std::string id = Created(LayerSession());
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 3)})).ok());
  v1::ExtendRequest slow = ExtendOf({XItem(id, 2000)});
  slow.set_backend(v1::BACKEND_REFERENCE);  // seconds of plain loops
  grpc::ClientContext slow_context;
  // Far enough that admission never refuses it at arrival: under a sanitizer on a loaded machine the reference
  // backend's measured rate once made its estimate exceed the default 120 s deadline.
  slow_context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
  v1::ExtendResponse slow_response;
  auto slow_call = std::async(std::launch::async, [&] { return stub_->Extend(&slow_context, slow, &slow_response); });
  ASSERT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
  grpc::ClientContext hurried;
  hurried.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  v1::ExtendResponse unused;
  const grpc::Status waited = stub_->Extend(&hurried, ExtendOf({XItem(id, 1)}), &unused);
  EXPECT_EQ(waited.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << waited.error_message();
  slow_context.TryCancel();
  EXPECT_EQ(slow_call.get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Length(id), 3);
  ASSERT_TRUE(Extend(ExtendOf({XItem(id, 1)})).ok());
  EXPECT_EQ(Length(id), 4);
}

class ShortIdleTest : public SessionServiceTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.session_idle_s = 1;
    options.max_session_idle_s = 2;
    StartServer(options);
  }
};

TEST_F(ShortIdleTest, IdleSessionsExpireAndSaySo) {
  const std::string idle = Created(HeadSession()), busy = Created(HeadSession());
  for (int i = 0; i < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(busy, 1)})).ok());
  }
  ExpectError(Extend(ExtendOf({QkvItem(idle, 1)})), grpc::StatusCode::NOT_FOUND, "expired");
  EXPECT_EQ(Length(busy), 8);
}

// Many threads on one session: every call ends with a status the contract allows, none crashes the server, and
// whatever is left open holds no more bytes than whole blocks of its length.
TEST_F(SessionServiceTest, ConcurrentExtendForkTruncateCloseOfOneSession) {
  Created(HeadSession("shared"));
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 30; ++i) {
        grpc::Status status;
        switch ((t + i) % 5) {
          case 0:
          case 1:
            status = Extend(ExtendOf({QkvItem("shared", 1 + i % 3, t * 100 + i)}));
            break;
          case 2:
            status = Fork("shared", "");
            break;
          case 3:
            status = Truncate("shared", i % 4);
            break;
          case 4:
            status = i % 10 == 4 ? Close("shared") : Create(HeadSession("shared"));
            break;
        }
        const auto code = status.error_code();
        if (!(status.ok() || code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::ALREADY_EXISTS ||
              code == grpc::StatusCode::RESOURCE_EXHAUSTED)) {
          ++unexpected;
          ADD_FAILURE() << status.error_code() << ": " << status.error_message();
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(unexpected, 0);
  for (const v1::SessionInfo& info : List()) {
    // Whole blocks of 32 tokens, each 2 (K, V) x 2 KV heads x d_k 8 x 4 bytes per token.
    EXPECT_LE(info.cache_bytes(), (info.lengths(0) + 31) / 32 * 32 * 2 * 2 * 8 * 4) << info.session_id();
  }
}

TEST_F(SessionServiceTest, CallsOnOneSessionFromManyClientsAllLand) {
  const std::string id = Created(HeadSession());
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) ok += Extend(ExtendOf({QkvItem(id, 1, t * 10 + i)})).ok() ? 1 : 0;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(ok, 40);
  EXPECT_EQ(Length(id), 40);
}

}  // namespace
}  // namespace mha::testing
