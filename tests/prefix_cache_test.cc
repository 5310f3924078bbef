// Shared prefixes (CreateSessionRequest.prefix_keys, ExtendItem.prefix_keys): which blocks a new session attaches,
// that they hold what the session that filled them wrote, what the keys' validation refuses, the scopes (tokens,
// salts, --prefix_cache_scope), and the idle blocks kept as a cache and evicted before idle sessions.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "client/prefix_keys.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/session_fixture.h"

namespace mha::testing {
namespace {

constexpr int64_t kBlock = 32;  // the server's default --kv_block_tokens

// Keys of `blocks` blocks of a prompt named `prompt`: the same bytes for the same prompt.
std::vector<std::string> Keys(int64_t blocks, const std::string& prompt = "system prompt") {
  std::vector<int64_t> tokens(blocks * kBlock);
  for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<int64_t>(t);
  return PrefixKeys(tokens, kBlock, prompt);
}

v1::CreateSessionRequest WithKeys(v1::CreateSessionRequest r, const std::vector<std::string>& keys,
                                  const std::string& salt = "") {
  for (const std::string& key : keys) r.add_prefix_keys(key);
  r.set_cache_salt(salt);
  return r;
}

// Head-session tokens [from, from + n) of one prompt: token t's q, k and v depend on t alone.
v1::ExtendItem Tokens(const std::string& id, int64_t from, int64_t n, uint32_t prompt = 7) {
  v1::ExtendItem item;
  item.set_session_id(id);
  std::vector<float> q, k, v;
  for (int64_t t = from; t < from + n; ++t) {
    for (int i = 0; i < 32; ++i) q.push_back(std::sin(0.37f * (t + 1) * prompt + 0.11f * i));
    for (int i = 0; i < 16; ++i) k.push_back(std::cos(0.23f * (t + 3) * prompt + 0.07f * i));
    for (int i = 0; i < 16; ++i) v.push_back(std::sin(0.19f * (t + 5) * prompt - 0.05f * i));
  }
  FloatsToTensor(q, {n, 4, 8}, v1::FP32, item.mutable_q());
  FloatsToTensor(k, {n, 2, 8}, v1::FP32, item.mutable_k());
  FloatsToTensor(v, {n, 2, 8}, v1::FP32, item.mutable_v());
  return item;
}

// The keys' bytes are the contract between clients: Python's mhaclient.prefix_keys pins the same digests
// (tests/python/test_prefix_e2e.py).
TEST(PrefixKeysTest, ChainSha256OverFullBlocks) {
  std::vector<int64_t> tokens(70);
  for (int64_t t = 0; t < 70; ++t) tokens[t] = t;
  std::vector<std::string> hex;
  for (const std::string& key : PrefixKeys(tokens, 32, "model-a")) hex.push_back(absl::BytesToHexString(key));
  EXPECT_THAT(hex, ::testing::ElementsAre("c2783b43086aa9485a66775f03b074ecc7b629c91a3565ffad24924d3ff52eab",
                                          "6f143b863adafb340d9035f0641c6d06135a2db7040196fa51b1c28c386aadfa"));
  EXPECT_EQ(absl::BytesToHexString(PrefixKeys(std::vector<int64_t>{-1, int64_t{1} << 40}, 1)[1]),
            "53a8f5ffbf27f1a99c2eb74f01beef89884833faf65feb6ec61107b05c3d31a1");
  EXPECT_TRUE(PrefixKeys(std::vector<int64_t>(31), 32).empty());
}

// Head sessions of 16 KV heads of 64: a 32-token fp32 block is 256 KiB.
v1::CreateSessionRequest Big(const std::string& id, const std::vector<std::string>& keys) {
  v1::CreateSessionRequest r;
  r.set_session_id(id);
  r.mutable_heads()->set_num_heads(16);
  r.mutable_heads()->set_num_kv_heads(16);
  r.mutable_heads()->set_head_dim(64);
  return WithKeys(r, keys);
}
v1::ExtendItem BigTokens(const std::string& id, int64_t n, uint32_t seed = 1) {
  v1::ExtendItem item;
  item.set_session_id(id);
  SetTensor(item.mutable_q(), {n, 16, 64}, seed);
  SetTensor(item.mutable_k(), {n, 16, 64}, seed + 1);
  SetTensor(item.mutable_v(), {n, 16, 64}, seed + 2);
  return item;
}

class PrefixCacheTest : public SessionTest {
 protected:
  // A head session created with `keys` (and `salt`); returns its info.
  v1::SessionInfo Open(const std::string& id, const std::vector<std::string>& keys, const std::string& salt = "",
                       int layers = 1) {
    v1::SessionInfo info;
    const grpc::Status status = Create(WithKeys(HeadSession(id, layers), keys, salt), &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info;
  }
  // Appends tokens [from, to) of `prompt` to cache `layer` of `id`.
  void Fill(const std::string& id, int64_t from, int64_t to, uint32_t prompt = 7, int layer = 0) {
    const grpc::Status status = Extend(ExtendOf({Tokens(id, from, to - from, prompt)}, layer));
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  // The output of `id`'s next token `t` of the prompt (appended): what a decode step returns.
  std::string Step(const std::string& id, int64_t t, uint32_t prompt = 7) {
    v1::ExtendResponse response;
    const grpc::Status status = Extend(ExtendOf({Tokens(id, t, 1, prompt)}), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() ? response.results(0).output().data() : "";
  }
  v1::KvCacheUsage Usage() {
    grpc::ClientContext context;
    v1::GetServerInfoResponse response;
    EXPECT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &response).ok());
    return response.kv_cache();
  }
};

TEST_F(PrefixCacheTest, ASecondSessionAttachesTheFullBlocksTheFirstFilled) {
  Open("first", Keys(3));
  Fill("first", 0, 100);  // blocks 0-2 full, block 3 partly
  const v1::SessionInfo second = Open("second", Keys(3));
  EXPECT_EQ(second.attached_tokens(), 96);
  EXPECT_THAT(second.lengths(), ::testing::ElementsAre(96));
  EXPECT_EQ(second.shared_bytes(), second.cache_bytes());
  EXPECT_EQ(Usage().prefix_blocks(), 3);
}

// The check: the attached session's next step equals, bit for bit, that of a session that prefilled the
// same tokens itself (the same kernels over the same cache contents).
TEST_F(PrefixCacheTest, AnAttachedSessionDecodesAsOneThatPrefilledItself) {
  Open("first", Keys(2));
  Fill("first", 0, 64);
  Open("own", {});
  Fill("own", 0, 70);
  EXPECT_EQ(Open("attached", Keys(2)).attached_tokens(), 64);
  Fill("attached", 64, 70);
  EXPECT_EQ(Step("attached", 70), Step("own", 70));
}

TEST_F(PrefixCacheTest, TheRunStopsAtTheFirstKeyNotHeld) {
  Open("first", Keys(3));
  Fill("first", 0, 96);
  std::vector<std::string> keys = Keys(3);
  keys[1] = Keys(3, "another prompt")[1];
  EXPECT_EQ(Open("second", keys).attached_tokens(), 32);
}

TEST_F(PrefixCacheTest, ABlockIsFindableOnlyOnceFull) {
  Open("first", Keys(2));
  Fill("first", 0, 40);
  EXPECT_EQ(Open("second", Keys(2)).attached_tokens(), 32);
  Fill("first", 40, 64);
  EXPECT_EQ(Open("third", Keys(2)).attached_tokens(), 64);
}

// Every cache of a session attaches the same run: a session whose prefill reached layer 0 only gives nothing.
TEST_F(PrefixCacheTest, EveryCacheAttachesTheSameRun) {
  Open("first", Keys(2), "", /*layers=*/2);
  Fill("first", 0, 64, 7, /*layer=*/0);
  EXPECT_EQ(Open("second", Keys(2), "", 2).attached_tokens(), 0);
  Fill("first", 0, 64, 7, /*layer=*/1);
  const v1::SessionInfo third = Open("third", Keys(2), "", 2);
  EXPECT_EQ(third.attached_tokens(), 64);
  EXPECT_THAT(third.lengths(), ::testing::ElementsAre(64, 64));
}

// A fork keeps the keys of its full blocks only: the keys its source was given for later blocks describe the
// source's tokens to come, not the fork's.
TEST_F(PrefixCacheTest, AForkDoesNotPublishItsOwnTokensUnderItsSourcesLaterKeys) {
  Open("source", Keys(3));
  Fill("source", 0, 40);
  v1::SessionInfo fork;
  ASSERT_TRUE(Fork("source", "fork", &fork).ok());
  Fill("fork", 40, 96, /*prompt=*/9);  // other tokens where the prompt's blocks 1 and 2 go
  EXPECT_EQ(Open("reader", Keys(3)).attached_tokens(), 32);
  Fill("source", 40, 96);  // the prompt's own tokens
  EXPECT_EQ(Open("later", Keys(3)).attached_tokens(), 96);
}

TEST_F(PrefixCacheTest, KeysGivenByExtendPublishTheBlocksTheyName) {
  Open("first", {});
  v1::ExtendItem item = Tokens("first", 0, 64);
  for (const std::string& key : Keys(2)) item.add_prefix_keys(key);
  ASSERT_TRUE(Extend(ExtendOf({item})).ok());
  EXPECT_EQ(Open("second", Keys(2)).attached_tokens(), 64);
}

TEST_F(PrefixCacheTest, OtherSaltsAndHeadConfigurationsFindNothing) {
  Open("first", Keys(2), "salt-a");
  Fill("first", 0, 64);
  EXPECT_EQ(Open("unsalted", Keys(2)).attached_tokens(), 0);
  EXPECT_EQ(Open("salt-b", Keys(2), "salt-b").attached_tokens(), 0);
  v1::CreateSessionRequest rope = WithKeys(HeadSession("rope"), Keys(2), "salt-a");
  rope.mutable_heads()->set_rope_theta(10000);
  v1::SessionInfo info;
  ASSERT_TRUE(Create(rope, &info).ok());
  EXPECT_EQ(info.attached_tokens(), 0);
  EXPECT_EQ(Open("same", Keys(2), "salt-a").attached_tokens(), 64);
}

// Blocks once indexed keep what was written when they filled: the session that filled them may truncate and write
// other tokens (into its own copy), and later sessions still attach the original.
TEST_F(PrefixCacheTest, TruncatingTheFillerLeavesTheIndexedBlocksAsTheyWere) {
  Open("first", Keys(2));
  Fill("first", 0, 64);
  v1::SessionInfo truncated;
  ASSERT_TRUE(Truncate("first", 40, &truncated).ok());
  Fill("first", 40, 64, /*prompt=*/9);  // other tokens where block 1 was
  Open("own", {});
  Fill("own", 0, 64);
  EXPECT_EQ(Open("attached", Keys(2)).attached_tokens(), 64);
  EXPECT_EQ(Step("attached", 64), Step("own", 64));
}

// Refused before any block is taken: the call changes no session, whichever of its items names the key.
TEST_F(PrefixCacheTest, ABlocksKeyCannotChange) {
  Open("other", {});
  Open("first", Keys(2));
  v1::ExtendItem item = Tokens("first", 0, 64);
  item.add_prefix_keys(Keys(1, "another prompt")[0]);
  ExpectError(Extend(ExtendOf({Tokens("other", 0, 40), item})), grpc::StatusCode::INVALID_ARGUMENT,
              "items[1].prefix_keys[0] differs");
  EXPECT_EQ(Length("first"), 0);  // nothing appended
  EXPECT_EQ(Length("other"), 0);
  Fill("other", 0, 8);  // and the store still answers
}

struct KeyCase {
  std::string name;
  std::vector<std::string> create_keys;
  std::string salt;
  std::string piece;
};

class PrefixKeyValidationTest : public PrefixCacheTest, public ::testing::WithParamInterface<KeyCase> {};

TEST_P(PrefixKeyValidationTest, CreateSessionRefusesNamingTheField) {
  v1::SessionInfo info;
  ExpectError(Create(WithKeys(HeadSession("s"), GetParam().create_keys, GetParam().salt), &info),
              grpc::StatusCode::INVALID_ARGUMENT, GetParam().piece);
}

INSTANTIATE_TEST_SUITE_P(
    Keys, PrefixKeyValidationTest,
    ::testing::Values(KeyCase{"empty_key", {"k0", ""}, "", "prefix_keys[1] is 0 bytes"},
                      KeyCase{"long_key", {std::string(65, 'k')}, "", "prefix_keys[0] is 65 bytes"},
                      KeyCase{"long_salt", {"k0"}, std::string(257, 's'), "cache_salt is 257 bytes"},
                      // --max_session_tokens 32768 over blocks of 32: 1024 keys at most.
                      KeyCase{"too_many", std::vector<std::string>(1025, "k"), "", "prefix_keys has 1025 keys"}),
    [](const ::testing::TestParamInfo<KeyCase>& info) { return info.param.name; });

TEST_F(PrefixCacheTest, ExtendRefusesKeysBeyondTheBlocksItFills) {
  Open("s", {});
  v1::ExtendItem item = Tokens("s", 0, 40);  // blocks 0 and 1
  for (const std::string& key : Keys(3)) item.add_prefix_keys(key);
  ExpectError(Extend(ExtendOf({item})), grpc::StatusCode::INVALID_ARGUMENT,
              "items[0].prefix_keys has 3 keys; the item's 40 tokens land in 2 block(s)");
}

TEST_F(PrefixCacheTest, ExtendRefusesKeysWithoutAppend) {
  Open("s", {});
  Fill("s", 0, 8);
  v1::ExtendItem item = Tokens("s", 8, 1);
  item.set_append(false);
  item.add_prefix_keys("k");
  ExpectError(Extend(ExtendOf({item})), grpc::StatusCode::INVALID_ARGUMENT, "items[0].prefix_keys names blocks");
}

TEST_F(PrefixCacheTest, MetricsCountHitsAndMisses) {
  Open("first", Keys(2));
  Fill("first", 0, 64);
  Open("second", Keys(3));  // 64 found, 32 not
  const std::string metrics = server_->metrics().Text();
  EXPECT_EQ(MetricValue(metrics, "mha_prefix_cache_tokens_total{result=\"hit\"}"), 64);
  EXPECT_EQ(MetricValue(metrics, "mha_prefix_cache_tokens_total{result=\"miss\"}"), 64 + 32);
  EXPECT_EQ(MetricValue(metrics, "mha_prefix_cache_blocks"), 2);
}

// Sessions of 16 KV heads of 64: a 32-token fp32 block is 256 KiB, one chunk of a 2 MiB pool (8 chunks, a little
// of which the block tables take: 7 blocks at most).
class PrefixEvictionTest : public PrefixCacheTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.kv_cache_mb = 2;
    StartServer(options);
  }
};

TEST_F(PrefixEvictionTest, IdleBlocksStayAsACacheAndGoBeforeIdleSessions) {
  ASSERT_TRUE(Create(Big("prompt", Keys(2))).ok());
  ASSERT_TRUE(Extend(ExtendOf({BigTokens("prompt", 64)})).ok());
  ASSERT_TRUE(Close("prompt").ok());
  EXPECT_EQ(Usage().prefix_blocks(), 2);
  EXPECT_EQ(Usage().prefix_idle_bytes(), 2 * 256 * 1024);
  ASSERT_TRUE(Create(Big("idle", {})).ok());
  ASSERT_TRUE(Extend(ExtendOf({BigTokens("idle", 32)})).ok());
  ASSERT_TRUE(Create(Big("big", {})).ok());
  // 5 blocks beside the 3 held: one idle prefix block must go, and the idle session stays.
  ASSERT_TRUE(Extend(ExtendOf({BigTokens("big", 160)})).ok());
  EXPECT_EQ(Length("idle"), 32);
  EXPECT_EQ(Usage().prefix_blocks(), 1);
  EXPECT_EQ(MetricValue(server_->metrics().Text(), "mha_prefix_cache_evictions_total"), 1);
  // A closed session's blocks turn idle from its last to its first, so that a prefix is evicted from its tail: the
  // first block, which every longer prefix starts with, stays.
  v1::SessionInfo info;
  ASSERT_TRUE(Create(Big("again", Keys(2)), &info).ok());
  EXPECT_EQ(info.attached_tokens(), 32);
}

TEST_F(PrefixEvictionTest, AnAttachedBlockIsNoLongerIdle) {
  ASSERT_TRUE(Create(Big("prompt", Keys(1))).ok());
  ASSERT_TRUE(Extend(ExtendOf({BigTokens("prompt", 32)})).ok());
  ASSERT_TRUE(Close("prompt").ok());
  EXPECT_EQ(Usage().prefix_idle_bytes(), 256 * 1024);
  v1::SessionInfo info;
  ASSERT_TRUE(Create(Big("user", Keys(1)), &info).ok());
  EXPECT_EQ(info.attached_tokens(), 32);
  EXPECT_EQ(Usage().prefix_idle_bytes(), 0);
  EXPECT_EQ(Usage().prefix_bytes(), 256 * 1024);
}

// Scopes: with tokens, a key lives in the scope of the token that stored it.
class PrefixScopeTest : public SessionTest {
 protected:
  static constexpr const char* kAlice = "alice-token-0123456789abc";
  static constexpr const char* kMallory = "mallory-token-0123456789ab";

  void SetUp() override { Start("token"); }
  void TearDown() override { std::filesystem::remove(tokens_); }
  void Start(const std::string& scope, ServerOptions options = ServerOptions()) {
    spdlog::set_level(spdlog::level::warn);
    tokens_ = (std::filesystem::temp_directory_path() / ("mha-prefix-tokens-" + std::to_string(getpid()))).string();
    std::ofstream(tokens_) << kAlice << "\n" << kMallory << "\n";
    options.auth_tokens_file = tokens_;
    options.prefix_cache_scope = scope;
    StartServer(options);
  }
  grpc::Status CloseAs(const char* token, const std::string& id) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::CloseSessionRequest r;
    r.set_session_id(id);
    v1::CloseSessionResponse response;
    return stub_->CloseSession(&context, r, &response);
  }
  grpc::Status CreateAs(const char* token, const v1::CreateSessionRequest& r, v1::SessionInfo* info) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::CreateSessionResponse response;
    grpc::Status status = stub_->CreateSession(&context, r, &response);
    *info = response.session();
    return status;
  }
  grpc::Status ExtendAs(const char* token, const v1::ExtendRequest& r, v1::ExtendResponse* response) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    return stub_->Extend(&context, r, response);
  }
  // `token`'s head session `id` with the prompt's keys, and its attached tokens.
  int64_t OpenAs(const char* token, const std::string& id, const std::string& salt = "") {
    v1::SessionInfo info;
    const grpc::Status status = CreateAs(token, WithKeys(HeadSession(id), Keys(2), salt), &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.attached_tokens();
  }
  std::string tokens_;
};

TEST_F(PrefixScopeTest, AnotherTokenFindsNothingAndGetsTheAnswerOfAnUnknownKey) {
  ASSERT_EQ(OpenAs(kAlice, "a"), 0);
  v1::ExtendResponse response;
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("a", 0, 64)}), &response).ok());
  EXPECT_EQ(OpenAs(kAlice, "a2"), 64);
  // Mallory's answer for Alice's keys is the answer for keys nobody holds, field for field.
  v1::SessionInfo probe, unknown;
  ASSERT_TRUE(CreateAs(kMallory, WithKeys(HeadSession("m"), Keys(2)), &probe).ok());
  ASSERT_TRUE(CreateAs(kMallory, WithKeys(HeadSession("n"), Keys(2, "nobody's prompt")), &unknown).ok());
  for (v1::SessionInfo* info : {&probe, &unknown}) {
    info->clear_session_id();
    info->clear_idle_s();
  }
  EXPECT_EQ(probe.SerializeAsString(), unknown.SerializeAsString());
  EXPECT_EQ(probe.attached_tokens(), 0);
}

// A red team's tries: a salt that spells Alice's scope after its own, and storing other contents under Alice's
// keys, so that she would attach them. Neither reaches her scope.
TEST_F(PrefixScopeTest, NoSaltOrStoredBlockReachesAnotherTokensScope) {
  ASSERT_EQ(OpenAs(kAlice, "a"), 0);
  v1::ExtendResponse response;
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("a", 0, 64)}), &response).ok());
  for (const std::string& salt : {std::string("64:"), std::string(kAlice), std::string("\0", 1)}) {
    EXPECT_EQ(OpenAs(kMallory, "m-" + std::to_string(salt.size()), salt), 0);
  }
  ASSERT_EQ(OpenAs(kMallory, "poison"), 0);
  ASSERT_TRUE(ExtendAs(kMallory, ExtendOf({Tokens("poison", 0, 64, /*prompt=*/13)}), &response).ok());
  ASSERT_EQ(OpenAs(kAlice, "own"), 64);
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("own", 64, 1)}), &response).ok());
  const std::string attached = response.results(0).output().data();
  v1::SessionInfo info;
  ASSERT_TRUE(CreateAs(kAlice, HeadSession("fresh"), &info).ok());
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("fresh", 0, 64)}), &response).ok());
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("fresh", 64, 1)}), &response).ok());
  EXPECT_EQ(attached, response.results(0).output().data());  // Alice's tokens, not Mallory's
}

TEST_F(PrefixScopeTest, AServerScopeSharesAcrossTokens) {
  Start("server");
  ASSERT_EQ(OpenAs(kAlice, "a"), 0);
  v1::ExtendResponse response;
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({Tokens("a", 0, 64)}), &response).ok());
  EXPECT_EQ(OpenAs(kMallory, "m"), 64);
  EXPECT_EQ(OpenAs(kMallory, "salted", "tenant-b"), 0);
}

// A block Alice filled stays charged to her while her sessions hold it. When her last session ends while Mallory's
// (server scope) still holds it, the charge ends with her: coming back, she is held to her cap as anyone new is, not
// given the block's bytes back when Mallory lets it go.
TEST_F(PrefixScopeTest, ATokenIsNotUnderchargedForBlocksItsEndedSessionsFilled) {
  ServerOptions options;
  options.kv_cache_mb = 2;             // 256 KiB chunks: a block each
  options.kv_cache_mb_per_token = 1;   // 4 blocks, less the block tables: 3
  Start("server", options);
  v1::SessionInfo info;
  v1::ExtendResponse response;
  ASSERT_TRUE(CreateAs(kAlice, Big("prompt", Keys(2)), &info).ok());
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({BigTokens("prompt", 64)}), &response).ok());
  ASSERT_TRUE(CreateAs(kMallory, Big("reader", Keys(2)), &info).ok());
  ASSERT_EQ(info.attached_tokens(), 64);
  ASSERT_TRUE(CloseAs(kAlice, "prompt").ok());
  ASSERT_TRUE(CreateAs(kAlice, Big("again", {}), &info).ok());
  ASSERT_TRUE(ExtendAs(kAlice, ExtendOf({BigTokens("again", 96)}), &response).ok());
  ASSERT_TRUE(CloseAs(kMallory, "reader").ok());  // the prompt's blocks turn idle
  const grpc::Status past_cap = ExtendAs(kAlice, ExtendOf({BigTokens("again", 32)}), &response);
  EXPECT_EQ(past_cap.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << past_cap.error_message();
  EXPECT_THAT(past_cap.error_message(), ::testing::HasSubstr("--kv_cache_mb_per_token"));
}

}  // namespace
}  // namespace mha::testing
