// The session store: ids, limits, reserve-commit-abort, copy-on-write forks, truncation, eviction order, expiry,
// ownership, and the NOT_FOUND messages that say how a session ended.
#include "server/sessions/session_store.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kTokens = 16;  // per block
// H=2, Hkv=1, d_k=8, fp32: 2 * 1 * 8 * 16 * 4 = 1 KiB per block.
constexpr int64_t kBlockBytes = 1024;

SessionConfig HeadSession(int64_t caches = 1) {
  SessionConfig config;
  config.heads.num_heads = 2;
  config.heads.num_kv_heads = 1;
  config.heads.head_dim = 8;
  config.heads.causal = true;
  config.heads.scale = 0.35f;
  config.num_caches = caches;
  return config;
}

// A call that holds its sessions from its start until the test lets them go.
class Holder final : public SessionSequencer::Call {
 public:
  void Start() override {}
  void Abandon(const absl::Status&) override {}
};

// Holds `ids` in the store's sequencer for as long as it lives, as a call in progress does.
SessionHold HoldSessions(SessionStore& store, std::vector<std::string> ids) {
  store.sequencer().Submit(ids, 0, std::make_unique<Holder>());
  return SessionHold(&store.sequencer(), std::move(ids));
}

// A pool of one chunk (2048 blocks of 1 KiB) for up to `max_sessions` sessions of up to `max_tokens` tokens.
SessionStoreOptions OneChunk(int max_sessions, int64_t max_tokens) {
  SessionStoreOptions options;
  options.capacity_bytes = BlockPool::kChunkBytes;
  options.block_tokens = kTokens;
  options.max_sessions = max_sessions;
  options.max_tokens = max_tokens;
  return options;
}

class SessionStoreTest : public ::testing::Test {
 protected:
  explicit SessionStoreTest(int64_t capacity = 4 << 20) : store_(Options(capacity), nullptr) {}

  static SessionStoreOptions Options(int64_t capacity) {
    SessionStoreOptions options;
    options.capacity_bytes = capacity;
    options.block_tokens = kTokens;
    options.max_sessions = 8;
    options.max_tokens = 1000;
    options.idle_timeout = absl::Seconds(10);
    options.max_idle_timeout = absl::Seconds(60);
    return options;
  }

  std::string Create(const std::string& id = "", SessionCaller caller = {}) {
    absl::StatusOr<v1::SessionInfo> info = store_.Create(HeadSession(), id, caller);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->session_id() : "";
  }

  // Appends n tokens to cache 0 of `id`, writing `fill` into every new slot's bytes, the way a backend would.
  absl::Status Extend(const std::string& id, int64_t n, char fill = 1) {
    const ReserveItem item{id, 0, n};
    absl::StatusOr<ExtendReservation> r = store_.Reserve({&item, 1});
    if (!r.ok()) return r.status();
    WriteSlots(r->items()[0], fill);
    r->Commit();
    return absl::OkStatus();
  }

  // Sets the first byte of every new token's slots (its K^T column's first element, its V row) to `fill`.
  static void WriteSlots(const ExtendReservation::Item& item, char fill) {
    for (int64_t t = item.length; t < item.length + item.new_tokens; ++t) {
      char* block = item.blocks[t / kTokens];
      block[(t % kTokens) * 4] = fill;                       // K^T row 0
      block[(8 * kTokens + (t % kTokens) * 8) * 4] = fill;   // V row t
    }
  }

  int64_t Length(const std::string& id) {
    absl::StatusOr<CacheView> view = store_.View(id, 0, {}, "session_id");
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? view->length : -1;
  }

  v1::SessionInfo InfoOf(const std::string& id) {
    for (const v1::SessionInfo& info : store_.List({"", true})) {
      if (info.session_id() == id) return info;
    }
    ADD_FAILURE() << "no session " << id;
    return {};
  }

  SessionStore store_;
};

TEST_F(SessionStoreTest, ServerChosenIdsAreLongAndRandom) {
  const std::string a = Create(), b = Create();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
}

TEST_F(SessionStoreTest, AClientChosenIdMustBeFreeAndWellFormed) {
  Create("mine");
  EXPECT_EQ(store_.Create(HeadSession(), "mine", {}).status().code(), absl::StatusCode::kAlreadyExists);
  const absl::Status bad = store_.Create(HeadSession(), "no spaces", {}).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("session_id"));
}

TEST_F(SessionStoreTest, MaxSessionsIsALimit) {
  for (int i = 0; i < 8; ++i) Create();
  EXPECT_EQ(store_.Create(HeadSession(), "", {}).status().code(), absl::StatusCode::kResourceExhausted);
}

// Heads and head_dim are the client's (up to 2^31 each): a block of 2^26 KV heads of 2^30 dims would wrap to 0
// bytes in int64 arithmetic; it is refused for its size.
TEST_F(SessionStoreTest, ABlockPastTheChunkIsRefusedHoweverLarge) {
  SessionConfig config = HeadSession();
  config.heads.num_heads = config.heads.num_kv_heads = int64_t{1} << 26;
  config.heads.head_dim = int64_t{1} << 30;
  const absl::StatusOr<v1::SessionInfo> created = store_.Create(config, "", {});
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(created.status().message(), HasSubstr("more than the pool's"));
}

TEST_F(SessionStoreTest, MaxTokensDefaultsToTheServersAndCannotPassIt) {
  SessionConfig config = HeadSession();
  EXPECT_EQ(store_.Create(config, "", {})->max_tokens(), 1000);
  config.max_tokens = 1001;
  EXPECT_EQ(store_.Create(config, "", {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionStoreTest, IdleTimeoutsAreCappedByTheServersMaximum) {
  SessionConfig config = HeadSession();
  config.idle_timeout = absl::Hours(5);
  EXPECT_EQ(store_.Create(config, "", {})->idle_timeout_s(), 60);
  config.idle_timeout = absl::ZeroDuration();
  EXPECT_EQ(store_.Create(config, "", {})->idle_timeout_s(), 10);
}

TEST_F(SessionStoreTest, CommittedTokensCountAndBlocksCoverThem) {
  const std::string id = Create();
  ASSERT_OK(Extend(id, 20));
  EXPECT_EQ(Length(id), 20);
  ASSERT_OK(Extend(id, 1));
  EXPECT_EQ(Length(id), 21);
  EXPECT_EQ(InfoOf(id).cache_bytes(), 2 * kBlockBytes);
}

TEST_F(SessionStoreTest, AReservationDroppedUncommittedChangesNothing) {
  const std::string id = Create();
  ASSERT_OK(Extend(id, 5));
  {
    const ReserveItem item{id, 0, 40};
    absl::StatusOr<ExtendReservation> r = store_.Reserve({&item, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->items()[0].blocks.size(), 3u);
  }
  EXPECT_EQ(Length(id), 5);
  EXPECT_EQ(InfoOf(id).cache_bytes(), kBlockBytes);
}

TEST_F(SessionStoreTest, AForkSharesEveryBlockUntilItWrites) {
  const std::string source = Create();
  ASSERT_OK(Extend(source, 20, /*fill=*/7));
  absl::StatusOr<v1::SessionInfo> fork = store_.Fork(source, "fork", {});
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->lengths(0), 20);
  EXPECT_EQ(fork->shared_bytes(), 2 * kBlockBytes);
  // The fork's next token lands in the shared, partly filled second block: it gets a copy of its own.
  const ReserveItem item{"fork", 0, 1};
  absl::StatusOr<ExtendReservation> r = store_.Reserve({&item, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  const ExtendReservation::Item& reserved = r->items()[0];
  ASSERT_EQ(reserved.fresh.size(), 1u);
  EXPECT_NE(reserved.blocks[1], reserved.replaced);
  EXPECT_EQ(reserved.blocks[1][3 * 4], 7);  // the copy holds the source's tokens 16..19 (slots 0..3)
  WriteSlots(reserved, 9);
  r->Commit();
  EXPECT_EQ(InfoOf("fork").shared_bytes(), kBlockBytes);
  EXPECT_EQ(InfoOf(source).shared_bytes(), kBlockBytes);
  // The source's block is as it was: its slot 20 was never written.
  absl::StatusOr<ExtendReservation> again = store_.Reserve({ReserveItem{source, 0, 1}});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->items()[0].fresh.empty());  // no longer shared: written in place
  EXPECT_EQ(again->items()[0].blocks[1][(20 % kTokens) * 4], 0);
}

TEST_F(SessionStoreTest, FullSharedBlocksAreNeverCopied) {
  const std::string source = Create();
  ASSERT_OK(Extend(source, 32));
  ASSERT_TRUE(store_.Fork(source, "fork", {}).ok());
  absl::StatusOr<ExtendReservation> r = store_.Reserve({ReserveItem{"fork", 0, 1}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->items()[0].fresh.size(), 1u);  // a new third block only
  EXPECT_EQ(r->items()[0].replaced, nullptr);
}

TEST_F(SessionStoreTest, TruncateDropsTokensAndTheBlocksPastThem) {
  const std::string id = Create();
  ASSERT_OK(Extend(id, 40));
  absl::StatusOr<v1::SessionInfo> info = store_.Truncate(id, 17, {});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 17);
  EXPECT_EQ(info->cache_bytes(), 2 * kBlockBytes);
  EXPECT_EQ(store_.Truncate(id, 100, {})->lengths(0), 17);  // longer than the cache: nothing to drop
  ASSERT_OK(Extend(id, 3));
  EXPECT_EQ(Length(id), 20);
  EXPECT_EQ(store_.Truncate(id, -1, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionStoreTest, TruncatingAForkLeavesTheSourceWhole) {
  const std::string source = Create();
  ASSERT_OK(Extend(source, 40));
  ASSERT_TRUE(store_.Fork(source, "fork", {}).ok());
  ASSERT_TRUE(store_.Truncate("fork", 5, {}).ok());
  EXPECT_EQ(Length(source), 40);
  EXPECT_EQ(InfoOf(source).cache_bytes(), 3 * kBlockBytes);
  EXPECT_EQ(InfoOf(source).shared_bytes(), kBlockBytes);
  ASSERT_OK(Extend("fork", 1));  // into the shared first block: copied
  EXPECT_EQ(InfoOf(source).shared_bytes(), 0);
}

TEST_F(SessionStoreTest, ClosedSessionsAreNotFoundAndSaySo) {
  const std::string id = Create();
  ASSERT_OK(store_.Close(id, {}));
  const absl::Status status = store_.View(id, 0, {}, "items[0].session_id").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("was closed"));
  EXPECT_THAT(status.message(), HasSubstr("items[0].session_id"));
  EXPECT_EQ(store_.Close(id, {}).code(), absl::StatusCode::kNotFound);
  const absl::Status unknown = store_.View("never", 0, {}, "session_id").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.message(), HasSubstr("no session 'never'"));
}

// One id created and closed over and over: the ends remembered for NOT_FOUND's message stay bounded (each reuse
// left its older end's place behind), and the latest end is the one told.
TEST_F(SessionStoreTest, AnIdReusedOverAndOverKeepsTheRecentEndsBounded) {
  for (int i = 0; i < 5000; ++i) {
    ASSERT_OK(store_.Create(HeadSession(), "again", {}).status());
    ASSERT_OK(store_.Close("again", {}));
  }
  EXPECT_LE(store_.activity().recent_ends, 4096);
  EXPECT_THAT(store_.View("again", 0, {}, "session_id").status().message(), HasSubstr("closed"));
}

TEST_F(SessionStoreTest, IdleSessionsExpireAndSaySo) {
  const std::string id = Create();
  EXPECT_EQ(store_.ExpireIdle(absl::Now() + absl::Seconds(5)), 0);
  EXPECT_EQ(store_.ExpireIdle(absl::Now() + absl::Seconds(11)), 1);
  const absl::Status status = store_.View(id, 0, {}, "session_id").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("expired"));
}

TEST_F(SessionStoreTest, SessionsInUseNeverExpire) {
  const std::string id = Create();
  const SessionHold hold = HoldSessions(store_, {id});
  EXPECT_EQ(store_.ExpireIdle(absl::Now() + absl::Hours(1)), 0);
}

TEST_F(SessionStoreTest, LayerIndexOutsideTheCachesIsInvalid) {
  const std::string id = store_.Create(HeadSession(2), "", {})->session_id();
  EXPECT_TRUE(store_.View(id, 1, {}, "session_id").ok());
  const absl::Status status = store_.View(id, 2, {}, "session_id").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("layer_index"));
}

TEST_F(SessionStoreTest, ASessionBelongsToItsCreator) {
  const SessionCaller alice{"alice", false}, bob{"bob", false}, admin{"root", true};
  const std::string id = Create("", alice);
  EXPECT_EQ(store_.View(id, 0, bob, "session_id").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.Fork(id, "", bob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.Truncate(id, 0, bob).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.Close(id, bob).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_.List(bob).empty());
  EXPECT_EQ(store_.List(alice).size(), 1u);
  ASSERT_EQ(store_.List(admin).size(), 1u);
  EXPECT_EQ(store_.List(admin)[0].owner(), "alice");
  EXPECT_EQ(store_.List(alice)[0].owner(), "");  // only an admin learns owners
  EXPECT_EQ(store_.View(id, 0, admin, "session_id").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.Close(id, admin).code(), absl::StatusCode::kNotFound);  // the admin's own scope
  ASSERT_OK(store_.Close(id, admin, "alice"));
  // How it ended is the owner's to know; to anyone else it is just not there.
  EXPECT_THAT(store_.View(id, 0, alice, "session_id").status().message(), HasSubstr("closed"));
  EXPECT_THAT(store_.View(id, 0, bob, "session_id").status().message(), HasSubstr("no session"));
}

// Ids are scoped per owner: another token's open id is no answer to Create or Fork (it could be probed and squatted
// otherwise), and each owner's session of one id is its own.
TEST_F(SessionStoreTest, TwoOwnersMayEachHaveASessionOfOneId) {
  const SessionCaller alice{"alice", false}, bob{"bob", false};
  ASSERT_EQ(Create("chat", alice), "chat");
  ASSERT_EQ(Create("chat", bob), "chat");
  ASSERT_OK(store_.Fork("chat", "beam", alice).status());
  ASSERT_OK(store_.Fork("chat", "beam", bob).status());
  const ReserveItem item{"chat", 0, 3, "alice"};
  absl::StatusOr<ExtendReservation> r = store_.Reserve({&item, 1});
  ASSERT_OK(r.status());
  r->Commit();
  EXPECT_EQ(store_.View("chat", 0, alice, "session_id")->length, 3);
  EXPECT_EQ(store_.View("chat", 0, bob, "session_id")->length, 0);
  ASSERT_OK(store_.Close("chat", alice));
  EXPECT_THAT(store_.View("chat", 0, alice, "session_id").status().message(), HasSubstr("closed"));
  EXPECT_OK(store_.View("chat", 0, bob, "session_id").status());
  EXPECT_EQ(store_.List(alice).size(), 1u);
  EXPECT_EQ(store_.List(bob).size(), 2u);
}

TEST_F(SessionStoreTest, OnlyAnAdminMayNameAnotherOwner) {
  const SessionCaller alice{"alice", false}, bob{"bob", false};
  Create("chat", alice);
  const absl::Status denied = store_.Close("chat", bob, "alice");
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(denied.message(), HasSubstr("owner"));
  EXPECT_OK(store_.Close("chat", alice, "alice"));  // naming oneself is allowed
}

// A call on another owner's id waits behind nothing of that owner's: its key is its own.
TEST_F(SessionStoreTest, AnotherOwnersBusySessionHoldsNoCallOfOurs) {
  const SessionCaller alice{"alice", false};
  Create("chat", alice);
  SessionHold busy = HoldSessions(store_, {SessionKey("alice", "chat")});
  EXPECT_TRUE(store_.sequencer().InUse(SessionKey("alice", "chat")));
  EXPECT_FALSE(store_.sequencer().InUse(SessionKey("bob", "chat")));
  bool started = false;
  class Flag final : public SessionSequencer::Call {
   public:
    explicit Flag(bool* started) : started_(started) {}
    void Start() override { *started_ = true; }
    void Abandon(const absl::Status&) override {}

   private:
    bool* started_;
  };
  store_.sequencer().Submit({SessionKey("bob", "chat")}, 0, std::make_unique<Flag>(&started));
  EXPECT_TRUE(started);  // on this thread, at once
  store_.sequencer().Release({SessionKey("bob", "chat")});
}

TEST(SessionKeyTest, IsTheIdWithoutAnOwnerAndScopedWithOne) {
  EXPECT_EQ(SessionKey("", "chat"), "chat");
  EXPECT_EQ(SessionKey("ab12", "chat"), "ab12/chat");
  EXPECT_NE(SessionKey("ab12", "chat"), SessionKey("cd34", "chat"));
}

TEST_F(SessionStoreTest, AForkBelongsToItsSourcesOwner) {
  const SessionCaller alice{"alice", false};
  const std::string id = Create("", alice);
  ASSERT_TRUE(store_.Fork(id, "f", alice).ok());
  EXPECT_TRUE(store_.View("f", 0, alice, "session_id").ok());
  EXPECT_FALSE(store_.View("f", 0, SessionCaller{"bob", false}, "session_id").ok());
}

// A pool of one 2 MiB chunk: 2048 blocks of 1 KiB.
class TightStoreTest : public SessionStoreTest {
 protected:
  TightStoreTest() : SessionStoreTest(BlockPool::kChunkBytes) {}
};

TEST_F(TightStoreTest, TheLeastRecentlyUsedIdleSessionIsEvictedFirst) {
  const std::string old_one = Create(), newer = Create(), current = Create();
  ASSERT_OK(Extend(old_one, 600 * kTokens));
  ASSERT_OK(Extend(newer, 600 * kTokens));
  ASSERT_OK(Extend(current, 600 * kTokens));
  store_.Touch({&newer, 1});
  // 1800 of 2048 blocks are taken; 300 more evict the least recently used idle one.
  ASSERT_OK(Extend(current, 300 * kTokens));
  const absl::Status evicted = store_.View(old_one, 0, {}, "session_id").status();
  EXPECT_EQ(evicted.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(evicted.message(), HasSubstr("evicted"));
  EXPECT_TRUE(store_.View(newer, 0, {}, "session_id").ok());
  EXPECT_EQ(Length(current), 900 * kTokens);
}

TEST_F(TightStoreTest, SessionsInUseAreNotEvictedAndTheCallIsRefusedSayingHowFull) {
  const std::string a = Create(), b = Create();
  ASSERT_OK(Extend(a, 1000 * kTokens));
  ASSERT_OK(Extend(b, 1000 * kTokens));
  const SessionHold hold = HoldSessions(store_, {a, b});
  const ReserveItem item{b, 0, 100 * kTokens};
  const absl::Status status = store_.Reserve({&item, 1}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("KV cache is full"));
  EXPECT_TRUE(store_.View(a, 0, {}, "session_id").ok());
  EXPECT_EQ(Length(b), 1000 * kTokens);
  EXPECT_EQ(InfoOf(b).cache_bytes(), 1000 * kBlockBytes);  // the refused call gave back what it took
}

// Calls that merely wait for a session do not pin it (F9 of #54): an idle session that a queued call names is
// evicted like any idle one, and the queued call later finds it gone.
TEST_F(TightStoreTest, ASessionCallsOnlyWaitForIsEvictedWhenIdle) {
  const std::string waited = Create(), busy = Create(), current = Create();
  ASSERT_OK(Extend(waited, 1000 * kTokens));
  ASSERT_OK(Extend(current, 1000 * kTokens));
  const SessionHold hold = HoldSessions(store_, {busy});
  // A call naming busy and waited waits (busy is held); waited is named by it, held by nobody.
  store_.sequencer().Submit({busy, waited}, 0, std::make_unique<Holder>());
  ASSERT_TRUE(store_.sequencer().InUse(waited));
  ASSERT_FALSE(store_.sequencer().Held(waited));
  ASSERT_OK(Extend(current, 100 * kTokens));
  EXPECT_THAT(store_.View(waited, 0, {}, "session_id").status().message(), HasSubstr("evicted"));
  store_.sequencer().Shutdown();  // abandons the waiting call
}

// Eight sessions growing in turn ask for about 2240 blocks of the pool's 2048: every step goes on (idle sessions are
// evicted for it), and the blocks in use never pass the pool.
TEST_F(TightStoreTest, NeverPastThePool) {
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(Create());
  for (int round = 0; round < 20; ++round) {
    for (const std::string& id : ids) {
      if (!store_.View(id, 0, {}, "session_id").ok()) continue;  // evicted
      const SessionHold hold = HoldSessions(store_, {id});  // as its call does: not evicted for its own room
      ASSERT_OK(Extend(id, 13 * kTokens + 5));
      const SessionStore::Activity now = store_.activity();
      ASSERT_LE(now.cache_bytes + now.table_bytes, BlockPool::kChunkBytes) << "round " << round;
    }
  }
  int64_t bytes = 0;
  for (const v1::SessionInfo& info : store_.List({"", true})) bytes += info.cache_bytes();
  EXPECT_LE(bytes, BlockPool::kChunkBytes);
  EXPECT_LT(store_.List({"", true}).size(), ids.size());  // the pool was outgrown: some were evicted
}

// Block tables count against the pool (F4 of #54): forks share blocks, but each one's table is new memory, so
// forking a long session over and over evicts older forks instead of growing the heap past --kv_cache_mb.
TEST(SessionStoreTables, ForksBlockTablesCountAgainstThePool) {
  SessionStore store(OneChunk(1000, 1000 * kTokens), nullptr);
  const std::string source = store.Create(HeadSession(), "source", {})->session_id();
  const SessionHold hold = HoldSessions(store, {source});  // as the forks' calls do
  const ReserveItem item{source, 0, 1000 * kTokens};
  absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
  ASSERT_OK(r.status());
  r->Commit();
  int refused = 0;
  for (int i = 0; i < 300; ++i) {
    const absl::StatusOr<v1::SessionInfo> fork = store.Fork(source, "", {});
    if (!fork.ok()) {
      EXPECT_EQ(fork.status().code(), absl::StatusCode::kResourceExhausted) << fork.status();
      ++refused;
    }
    const SessionStore::Activity now = store.activity();
    ASSERT_LE(now.cache_bytes + now.table_bytes, BlockPool::kChunkBytes) << "after " << i + 1 << " forks";
  }
  const SessionStore::Activity now = store.activity();
  EXPECT_EQ(refused, 0);  // older idle forks made room
  EXPECT_LT(now.open, 200);  // each fork's table is about 8 KiB of the 1 MiB the source left
  EXPECT_GT(now.table_bytes, 1000 * 8 * (now.open - 1));
  EXPECT_EQ(store.View(source, 0, {}, "session_id")->length, 1000 * kTokens);
}

// A session's head configurations are its memory too: longrope's lists, up to head_dim / 2 doubles each per cache,
// count against the pool when the session is created and again for each fork, which copies them.
TEST(SessionStoreTables, EveryCachesRopeListsCountAgainstThePool) {
  SessionStore store(OneChunk(8, 1000), nullptr);
  constexpr int64_t kCaches = 4, kPairs = 512;
  SessionConfig plain = HeadSession(kCaches);
  plain.layer_heads.assign(kCaches, plain.heads);
  SessionConfig listed = plain;
  for (HeadSpec& heads : listed.layer_heads) {
    heads.rope_scaling.short_factor.assign(kPairs, 1.0);
    heads.rope_scaling.long_factor.assign(kPairs, 1.0);
  }
  constexpr int64_t kListBytes = kCaches * 2 * kPairs * sizeof(double);
  ASSERT_OK(store.Create(plain, "plain", {}).status());
  const int64_t plain_bytes = store.activity().table_bytes;
  ASSERT_OK(store.Create(listed, "listed", {}).status());
  const int64_t listed_bytes = store.activity().table_bytes - plain_bytes;
  EXPECT_GE(listed_bytes - plain_bytes, kListBytes);
  ASSERT_OK(store.Fork("listed", "fork", {}).status());
  EXPECT_GE(store.activity().table_bytes - plain_bytes - listed_bytes, kListBytes);
}

// One call that needs most of the pool evicts about 70 idle sessions at once: their end lines are bounded per second
// (the metrics count every one), so that a client cannot turn session churn into log volume.
TEST(SessionStoreLog, ManySessionsEndingAtOnceWriteABoundedNumberOfLines) {
  // The default logger writes into `lines` while this lives.
  struct Capture {
    std::ostringstream lines;
    const std::shared_ptr<spdlog::logger> before = spdlog::default_logger();
    Capture() {
      spdlog::set_default_logger(
          std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(lines)));
    }
    ~Capture() { spdlog::set_default_logger(before); }
  } capture;
  {
    SessionStore store(OneChunk(200, 2000 * kTokens), nullptr);
    for (int i = 0; i < 100; ++i) {
      const std::string id = store.Create(HeadSession(), "", {})->session_id();
      const SessionHold hold = HoldSessions(store, {id});
      const ReserveItem item{id, 0, 16 * kTokens};
      absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
      ASSERT_OK(r.status());
      r->Commit();
    }
    const std::string big = store.Create(HeadSession(), "big", {})->session_id();
    const SessionHold hold = HoldSessions(store, {big});
    const ReserveItem item{big, 0, 1500 * kTokens};
    absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
    ASSERT_OK(r.status());
    EXPECT_LT(store.activity().open, 40);  // about 70 evicted for it
  }
  const std::string log = capture.lines.str();
  int64_t evicted_lines = 0;
  for (size_t at = log.find("evicted to make room"); at != std::string::npos;
       at = log.find("evicted to make room", at + 1)) {
    ++evicted_lines;
  }
  EXPECT_GE(evicted_lines, 1);
  EXPECT_LE(evicted_lines, 20);
}

// A block size new to the pool, with the pool half empty around blocks of another size (F10 of #54): it takes the
// free runs between them, and nobody is evicted.
TEST(SessionStoreCompaction, ANewBlockSizeTakesFreeRunsBetweenOtherSizesInsteadOfEvicting) {
  SessionStoreOptions options;
  options.capacity_bytes = 2 * BlockPool::kChunkBytes;  // two chunks of 2048 blocks of 1 KiB
  options.chunk_bytes = BlockPool::kChunkBytes;
  options.block_tokens = kTokens;
  options.max_sessions = 16;
  options.max_tokens = 1000 * kTokens;
  SessionStore store(options, nullptr);
  const auto extend = [&store](const std::string& id, int64_t tokens, char fill) {
    const SessionHold hold = HoldSessions(store, {id});
    const ReserveItem item{id, 0, tokens};
    absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
    if (!r.ok()) return r.status();
    for (char* block : r->items()[0].fresh) std::memset(block, fill, static_cast<size_t>(kBlockBytes));
    r->Commit();
    return absl::OkStatus();
  };
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(store.Create(HeadSession(), "s" + std::to_string(i), {})->session_id());
    ASSERT_OK(extend(ids.back(), 500 * kTokens, static_cast<char>('a' + i)));
  }
  ASSERT_OK(store.Close("s0", {}));  // 1000 free blocks in the first chunk, 952 in use in the second
  ASSERT_OK(store.Close("s1", {}));
  SessionConfig wide = HeadSession();
  wide.heads.num_kv_heads = 2;
  wide.heads.head_dim = 64;  // blocks of 2 * 2 * 64 * 16 * 4 = 16 KiB
  ASSERT_OK(store.Create(wide, "wide", {}).status());
  ASSERT_OK(extend("wide", 1, 'w'));
  for (int i = 2; i < 6; ++i) {
    ASSERT_OK(store.View(ids[i], 0, {}, "session_id").status());
    // Every block of the session still holds what was written into it.
    const SessionHold hold = HoldSessions(store, {ids[i]});
    const ReserveItem item{ids[i], 0, 0};
    absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
    ASSERT_OK(r.status());
    for (const char* block : r->items()[0].blocks) {
      ASSERT_EQ(block[0], 'a' + i);
      ASSERT_EQ(block[kBlockBytes - 1], 'a' + i);
    }
  }
}

// No free run fits the block, so idle sessions' blocks move into the runs of other chunks to empty one (nobody is
// evicted); and where they cannot, the chunk emptied is the one that costs fewest sessions, not whatever the least
// recently used sessions happen to hold.
SessionConfig BlocksOf(int64_t kv_heads, int64_t head_dim) {  // blocks of 2 * kv_heads * head_dim * 16 * 4 bytes
  SessionConfig c = HeadSession();
  c.heads.num_heads = c.heads.num_kv_heads = kv_heads;
  c.heads.head_dim = head_dim;
  return c;
}

absl::Status ExtendBy(SessionStore& store, const std::string& id, int64_t tokens) {
  const ReserveItem item{id, 0, tokens};
  absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
  if (!r.ok()) return r.status();
  r->Commit();
  return absl::OkStatus();
}

SessionStoreOptions ThreeChunks() {
  SessionStoreOptions options;
  options.capacity_bytes = 3 * BlockPool::kChunkBytes;
  options.chunk_bytes = BlockPool::kChunkBytes;
  options.block_tokens = kTokens;
  options.max_sessions = 16;
  return options;
}

TEST(SessionStoreCompaction, IdleBlocksMoveToEmptyAChunkForABlockNoRunFits) {
  SessionStore store(ThreeChunks(), nullptr);
  for (const char* id : {"a1", "a2", "a3", "a4"}) {  // 1 KiB blocks: 2000 KiB of the first chunk
    ASSERT_OK(store.Create(BlocksOf(1, 8), id, {}).status());
    ASSERT_OK(ExtendBy(store, id, 500 * kTokens));
  }
  ASSERT_OK(store.Create(BlocksOf(32, 256), "b", {}).status());  // a 1 MiB block: the second chunk
  ASSERT_OK(ExtendBy(store, "b", 1));
  ASSERT_OK(store.Create(BlocksOf(32, 256), "c", {}).status());  // another: the third, held by a call below
  ASSERT_OK(ExtendBy(store, "c", 1));
  ASSERT_OK(store.Create(BlocksOf(64, 256), "wide", {}).status());  // a 2 MiB block: no run fits it
  const SessionHold hold = HoldSessions(store, {"c", "wide"});
  ASSERT_OK(ExtendBy(store, "wide", 1));  // b's block moved beside c's
  for (const char* id : {"a1", "a2", "a3", "a4", "b", "c"}) EXPECT_TRUE(store.View(id, 0, {}, "session_id").ok()) << id;
}

TEST(SessionStoreCompaction, WithoutRoomToMoveTheChunkEmptiedIsTheOneCostingFewestSessions) {
  SessionStoreOptions options = ThreeChunks();
  options.capacity_bytes = 4 * BlockPool::kChunkBytes;
  SessionStore store(options, nullptr);
  for (const char* id : {"a1", "a2", "a3", "a4"}) {  // the oldest: 1 KiB blocks, 1900 KiB of the first chunk
    ASSERT_OK(store.Create(BlocksOf(1, 8), id, {}).status());
    ASSERT_OK(ExtendBy(store, id, 475 * kTokens));
  }
  for (const char* id : {"b", "c", "d"}) {  // a 1.5 MiB block each, a chunk each; c and d held by calls below
    ASSERT_OK(store.Create(BlocksOf(48, 256), id, {}).status());
    ASSERT_OK(ExtendBy(store, id, 1));
  }
  // 1 MiB: the bytes are free, no run fits it, and neither a's blocks nor b's fit in the others' runs.
  ASSERT_OK(store.Create(BlocksOf(32, 256), "wide", {}).status());
  const SessionHold hold = HoldSessions(store, {"c", "d", "wide"});
  ASSERT_OK(ExtendBy(store, "wide", 1));
  EXPECT_THAT(store.View("b", 0, {}, "session_id").status().message(), HasSubstr("evicted"));
  for (const char* id : {"a1", "a2", "a3", "a4", "c", "d"}) {
    EXPECT_TRUE(store.View(id, 0, {}, "session_id").ok()) << id;
  }
}

// A small pool has small chunks, so that it holds several block sizes at once (F10 of #54: a 4 MiB pool of two
// 2 MiB chunks, and caches of 64, 4 and 16 KiB blocks, evicted all ten idle sessions and still refused).
TEST(SessionStoreCompaction, ASmallPoolHoldsSeveralBlockSizesAtOnce) {
  SessionStoreOptions options;
  options.capacity_bytes = 4 << 20;
  options.block_tokens = kTokens;
  options.max_sessions = 16;
  SessionStore store(options, nullptr);
  const auto config = [](int64_t kv_heads, int64_t head_dim) {  // blocks of 2 * kv_heads * head_dim * 16 * 4 bytes
    SessionConfig c = HeadSession();
    c.heads.num_heads = 2 * kv_heads;
    c.heads.num_kv_heads = kv_heads;
    c.heads.head_dim = head_dim;
    return c;
  };
  const SessionConfig sizes[] = {config(2, 128), config(1, 16), config(1, 64)};  // 64, 4 and 16 KiB blocks
  for (int i = 0; i < 10; ++i) {
    const std::string id = "s" + std::to_string(i);
    ASSERT_OK(store.Create(sizes[i % 3], id, {}).status());
    const SessionHold hold = HoldSessions(store, {id});
    const ReserveItem item{id, 0, 2 * kTokens};
    absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
    ASSERT_OK(r.status());
    r->Commit();
  }
  ASSERT_OK(store.Create(config(1, 32), "new", {}).status());  // a fourth size: 8 KiB blocks
  const SessionHold hold = HoldSessions(store, {"new"});
  const ReserveItem item{"new", 0, 8 * kTokens};
  ASSERT_OK(store.Reserve({&item, 1}).status());
  EXPECT_EQ(store.activity().open, 11);  // nobody evicted
}

// Several tokens share the pool and the session limit (F7 of #54): each one's share is an equal part while
// several hold sessions.
SessionStoreOptions SharedOptions() {
  SessionStoreOptions options;
  options.capacity_bytes = BlockPool::kChunkBytes;  // 2048 blocks of 1 KiB
  options.block_tokens = kTokens;
  options.max_sessions = 8;
  options.max_tokens = 2048 * kTokens;
  return options;
}

class SharedStoreTest : public ::testing::Test {
 protected:
  SharedStoreTest() : store_(SharedOptions(), nullptr) {}

  std::string Create(const SessionCaller& who, const std::string& id) {
    absl::StatusOr<v1::SessionInfo> info = store_.Create(HeadSession(), id, who);
    EXPECT_OK(info.status());
    return id;
  }

  // Appends `blocks` blocks of tokens to `who`'s session `id`, holding it as a call does.
  absl::Status Extend(const SessionCaller& who, const std::string& id, int64_t blocks) {
    const SessionHold hold = HoldSessions(store_, {SessionKey(who.owner, id)});
    const ReserveItem item{id, 0, blocks * kTokens, who.owner};
    absl::StatusOr<ExtendReservation> r = store_.Reserve({&item, 1});
    if (!r.ok()) return r.status();
    r->Commit();
    return absl::OkStatus();
  }

  absl::Status Look(const SessionCaller& who, const std::string& id) {
    return store_.View(id, 0, who, "session_id").status();
  }

  const SessionCaller alice_{"alice", false}, bob_{"bob", false};
  SessionStore store_;
};

TEST_F(SharedStoreTest, OneTokenAloneMayFillThePool) {
  Create(alice_, "a1");
  Create(alice_, "a2");
  ASSERT_OK(Extend(alice_, "a1", 1000));
  ASSERT_OK(Extend(alice_, "a2", 1000));
  EXPECT_OK(Look(alice_, "a1"));
}

TEST_F(SharedStoreTest, ATokenPastItsShareEvictsOnlyItsOwnIdleSessions) {
  Create(alice_, "a1");
  Create(alice_, "a2");
  Create(bob_, "b1");
  ASSERT_OK(Extend(bob_, "b1", 400));  // bob's is the least recently used idle session
  ASSERT_OK(Extend(alice_, "a1", 1500));
  ASSERT_OK(Extend(alice_, "a2", 200));  // past its half: makes room from its own a1, never from bob's b1
  EXPECT_THAT(Look(alice_, "a1").message(), HasSubstr("evicted"));
  EXPECT_OK(Look(bob_, "b1"));
}

TEST_F(SharedStoreTest, ATokenPastItsShareIsRefusedRatherThanEvictAnothers) {
  Create(alice_, "a1");
  Create(bob_, "b1");
  ASSERT_OK(Extend(bob_, "b1", 400));
  ASSERT_OK(Extend(alice_, "a1", 1500));
  const absl::Status refused = Extend(alice_, "a1", 200);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("may not evict"));
  EXPECT_THAT(refused.message(), HasSubstr("share"));
  EXPECT_OK(Look(bob_, "b1"));
}

TEST_F(SharedStoreTest, ATokenWithinItsShareEvictsIdleSessionsOfOnePastIts) {
  Create(alice_, "a1");
  Create(bob_, "b1");
  Create(bob_, "b2");
  ASSERT_OK(Extend(bob_, "b2", 10));  // bob's b2 is the least recently used idle session, yet alice's a1 goes
  ASSERT_OK(Extend(alice_, "a1", 1600));
  ASSERT_OK(Extend(bob_, "b1", 100));
  ASSERT_OK(Extend(bob_, "b1", 500));
  EXPECT_THAT(Look(alice_, "a1").message(), HasSubstr("evicted"));
  EXPECT_OK(Look(bob_, "b2"));
}

TEST_F(SharedStoreTest, AtMaxSessionsATokenBelowItsShareDisplacesAnIdleSessionOfOneAbove) {
  for (int i = 0; i < 8; ++i) Create(alice_, "a" + std::to_string(i));
  for (int i = 0; i < 4; ++i) Create(bob_, "b" + std::to_string(i));  // bob's share of 8 is 4
  EXPECT_THAT(Look(alice_, "a0").message(), HasSubstr("session limit"));
  EXPECT_OK(Look(alice_, "a4"));
  const absl::Status refused = store_.Create(HeadSession(), "b4", bob_).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--max_sessions"));
  EXPECT_THAT(refused.message(), HasSubstr("share"));
  // Nor may alice, at its share now, displace bob's.
  EXPECT_EQ(store_.Create(HeadSession(), "a9", alice_).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(SessionStoreCaps, ATokensSessionsAndBytesMayBeCapped) {
  SessionStoreOptions options = SharedOptions();
  options.max_sessions_per_owner = 2;
  options.max_bytes_per_owner = 300 * kBlockBytes;
  SessionStore store(options, nullptr);
  const SessionCaller alice{"alice", false};
  ASSERT_OK(store.Create(HeadSession(), "a1", alice).status());
  ASSERT_OK(store.Create(HeadSession(), "a2", alice).status());
  const absl::Status third = store.Create(HeadSession(), "a3", alice).status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max_sessions_per_token"));
  const SessionHold hold = HoldSessions(store, {SessionKey("alice", "a1")});
  const ReserveItem item{"a1", 0, 400 * kTokens, "alice"};
  const absl::Status past = store.Reserve({&item, 1}).status();
  EXPECT_EQ(past.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(past.message(), HasSubstr("--kv_cache_mb_per_token"));
}

// A backend's arena as the store sees one: host memory here, which says when it is released.
class FakeArena final : public CacheArena {
 public:
  FakeArena(int64_t bytes, bool* released)
      : bytes_(bytes),
        base_(static_cast<char*>(std::aligned_alloc(BlockPool::kChunkBytes, static_cast<size_t>(bytes)))),
        released_(released) {}
  ~FakeArena() override {
    std::free(base_);
    *released_ = true;
  }
  char* base() const override { return base_; }
  int64_t bytes() const override { return bytes_; }
  std::string describe() const override { return "fake device memory"; }

 private:
  const int64_t bytes_;
  char* const base_;
  bool* const released_;
};

TEST(SessionStoreArena, WithoutAnArenaTheCacheIsInHostMemory) {
  SessionStore store(SessionStoreOptions(), nullptr);
  EXPECT_EQ(store.cache_memory(), "host memory");
}

TEST(SessionStoreArena, BlocksComeFromTheArenaWhichTheStoreReleasesLast) {
  bool released = false;
  {
    SessionStoreOptions options;
    options.capacity_bytes = 4 << 20;
    options.block_tokens = kTokens;
    auto arena = std::make_unique<FakeArena>(options.capacity_bytes, &released);
    const char* const base = arena->base();
    SessionStore store(options, nullptr, std::move(arena));
    EXPECT_EQ(store.cache_memory(), "fake device memory");
    EXPECT_EQ(store.capacity_bytes(), 4 << 20);

    const std::string id = store.Create(HeadSession(), "s", {})->session_id();
    const ReserveItem item{id, 0, 3 * kTokens};
    absl::StatusOr<ExtendReservation> r = store.Reserve({&item, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->items()[0].blocks.size(), 3u);
    for (const char* block : r->items()[0].blocks) {
      EXPECT_GE(block, base);
      EXPECT_LE(block + kBlockBytes, base + (4 << 20));
    }
    r->Commit();
    EXPECT_FALSE(released);
  }
  EXPECT_TRUE(released);
}

}  // namespace
}  // namespace mha
