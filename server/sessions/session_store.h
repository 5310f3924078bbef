// The KV-cache sessions (mha.v1 CreateSession and the calls after it): each session's caches (block tables and
// lengths in the BlockPool), its configuration, owner and lifetime. The service validates requests and the backends
// compute; the store decides what a session holds and when it ends.
//
// Who may end what: a session ends by its owner's Close (or an admin's), by expiry after idle_timeout without a
// call, or by eviction, least recently used first among idle sessions, when an Extend needs blocks the pool does not
// have. A block is freed by its last reference (forks share blocks). A session held by a call
// (SessionSequencer::Held) is never evicted, and only the call holding it changes it, so the blocks an Extend writes
// stay its own until it commits. One that calls merely wait for may be evicted (they then find it gone, NOT_FOUND
// saying so), so that calls queued behind a busy session cannot pin idle ones; it does not expire while they wait
// (InUse).
//
// Shares between owners (tokens): an owner's bytes are its sessions' blocks and their bookkeeping (block tables,
// which count against the pool though they live on the heap, so that forks cannot grow memory past it). While
// several owners hold sessions, each one's share is an equal part of the pool and of max_sessions. An owner within
// its share makes room by evicting idle sessions of owners over theirs first, then its own; an owner at or past its
// share only ever evicts its own. At max_sessions, a Create or Fork of an owner below its share evicts the least
// recently used idle session of an owner over its share; others are refused. Hard per-owner caps are optional
// (max_sessions_per_owner, max_bytes_per_owner). With one owner (no tokens) all of this is plain LRU eviction.
//
// Extend is reserve, compute, commit: Reserve gives each item the blocks covering its cache and new tokens (fresh
// blocks for new slots; a copy of the last block when it is shared and the new tokens land in it), the backend
// writes the new tokens' keys and values beyond each cache's length, and only Commit moves the lengths. An aborted
// reservation frees what it took, so a failed call changes no session.
//
// Session ids are scoped per principal: two tokens may each have a session "chat", and nothing one token sends
// (Create, Fork, any call naming an id) answers, waits or takes time differently for the other's ids than for ids
// that exist nowhere. The store and the sequencer know a session by its key, SessionKey(owner, id).
//
// Shared prefixes (prefix_cache.h): a session created with prefix_keys starts with the longest run of leading full
// blocks the index holds under them in its scope (attached, not copied), and the blocks it fills under keys it was
// given join the index once full. Blocks only the index references are evicted, least recently used first, before
// any idle session is. A truncated session forgets the keys of the blocks it cut into.
//
// Thread-safe. Session ids in messages are ones that passed CheckName, safe to echo and log.
#ifndef MHA_SERVER_SESSIONS_SESSION_STORE_H_
#define MHA_SERVER_SESSIONS_SESSION_STORE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"
#include "server/base/log_budget.h"
#include "server/metrics/metrics.h"
#include "server/sessions/block_pool.h"
#include "server/sessions/prefix_cache.h"
#include "server/sessions/sequencer.h"

namespace mha {

struct SessionStoreOptions {
  int64_t capacity_bytes = int64_t{1} << 30;  // the block pool (--kv_cache_mb)
  int64_t chunk_bytes = 0;  // the pool's chunks, the largest block it holds; 0: BlockPool::ChunkBytesFor the pool
  int64_t block_tokens = 32;                  // tokens per block (--kv_block_tokens)
  int max_sessions = 1024;                    // open at once (--max_sessions)
  int64_t max_tokens = 32768;                 // per cache, default and limit (--max_session_tokens)
  absl::Duration idle_timeout = absl::Seconds(300);      // when a session asks for none (--session_idle_s)
  absl::Duration max_idle_timeout = absl::Seconds(3600);  // the cap (--max_session_idle_s)
  int max_sessions_per_owner = 0;   // a token's sessions at most; 0: its share only (--max_sessions_per_token)
  int64_t max_bytes_per_owner = 0;  // a token's bytes of the pool at most; 0: its share only (--kv_cache_mb_per_token)
  int max_waiting = 64;                      // session calls waiting for their sessions at most (--max_queue_size)
  int64_t max_waiting_bytes = int64_t{1} << 30;  // their requests' bytes (--max_queued_mb)
  bool prefix_scope_server = false;  // prefix keys shared by every caller, not per token (--prefix_cache_scope)
};

// Prefix keys are 1..kMaxPrefixKeyBytes bytes, cache salts at most kMaxCacheSaltBytes.
inline constexpr size_t kMaxPrefixKeyBytes = 64;
inline constexpr size_t kMaxCacheSaltBytes = 256;

// The key of session `id` in the scope of `owner`: the id itself for the empty owner (no tokens), else
// "owner/id" (ids never hold a '/').
std::string SessionKey(absl::string_view owner, absl::string_view id);

// Who calls: the identity of the caller's token (empty without tokens, when every caller is the same one) and
// whether its role is admin, which may list and close every session.
struct SessionCaller {
  std::string owner;
  bool admin = false;
};

// One cache's layer in a layer session: the registered layer's name and process-unique id (a layer unloaded or
// replaced since is no longer the cache's), and what the cache needs of it.
struct SessionLayer {
  std::string name;
  uint64_t id = 0;
  HeadSpec heads;
  int64_t d_model = 0;
};

// What CreateSession asks for, validated.
struct SessionConfig {
  std::vector<SessionLayer> layers;  // a layer session: one cache per layer
  HeadSpec heads;                    // a head session's (num_caches caches); unused with layers
  std::vector<HeadSpec> layer_heads;  // a head session's per cache (num_caches of them), or empty: `heads` for all
  int64_t num_caches = 1;
  v1::DataType cache_dtype = v1::FP32;
  int64_t max_tokens = 0;  // 0: the store's
  absl::Duration idle_timeout = absl::ZeroDuration();  // zero: the store's; capped by the store's maximum
  std::vector<std::string> prefix_keys;  // of the leading blocks, each 1..kMaxPrefixKeyBytes bytes
  std::string cache_salt;                // part of the keys' scope

  bool is_layer_session() const { return !layers.empty(); }
  // Cache `c`'s head configuration: its layer's, its own, or the session's.
  const HeadSpec& HeadsOf(int64_t c) const {
    return is_layer_session() ? layers[c].heads : layer_heads.empty() ? heads : layer_heads[c];
  }
};

// What an Extend needs to know of one held session's cache to validate its item.
struct CacheView {
  bool layer_session = false;
  SessionLayer layer;  // a layer session's layer of this cache
  HeadSpec heads;      // the cache's head configuration (the layer's, or the head session's)
  KvCacheLayout layout;
  int64_t length = 0;
  int64_t max_tokens = 0;
  int64_t num_caches = 0;
};

// What one Extend item reserves: `new_tokens` slots after the cache's length in cache `cache` of session `id` of
// `owner`.
struct ReserveItem {
  std::string id;
  int64_t cache = 0;
  int64_t new_tokens = 0;
  std::string owner;
  std::vector<std::string> prefix_keys;  // of the blocks from length / block_tokens on (ExtendItem.prefix_keys)
};

class SessionStore;

// The blocks an Extend writes into, held until Commit; destroying an uncommitted one gives them back. Movable.
class ExtendReservation {
 public:
  struct Item {
    std::string key;  // SessionKey of the session
    int64_t cache = 0;
    int64_t length = 0;  // before the call
    int64_t new_tokens = 0;
    std::vector<char*> blocks;    // covering [0, length + new_tokens)
    std::vector<char*> fresh;     // of blocks, those this reservation allocated (a copy included)
    char* replaced = nullptr;     // the shared block the copy stands for, dropped by the cache at commit
    int64_t table_growth = 0;     // bytes the cache's block table grows by at commit, charged meanwhile
    std::vector<std::string> prefix_keys;  // the session's keys from block length / block_tokens on, at commit
  };

  ExtendReservation() = default;
  ExtendReservation(ExtendReservation&& other) noexcept;
  ExtendReservation& operator=(ExtendReservation&& other) noexcept;
  ~ExtendReservation();

  absl::Span<const Item> items() const { return items_; }
  // Moves each item's cache to length + new_tokens over its reserved blocks. Once; the reservation is then empty.
  void Commit();

 private:
  friend class SessionStore;
  SessionStore* store_ = nullptr;
  std::vector<Item> items_;
};

class SessionStore {
 public:
  // `metrics` (may be null) receives the gauges and counters; borrowed. The blocks come from `arena` when given (a
  // backend's memory, AllocateCacheArena: the pool spans its bytes() in whole chunks, and options.capacity_bytes is
  // what the caller sized it by), else from host memory the pool reserves itself (capacity_bytes). The store owns
  // the arena and releases it after the pool.
  SessionStore(const SessionStoreOptions& options, ServerMetrics* metrics,
               std::unique_ptr<CacheArena> arena = nullptr);
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  const SessionStoreOptions& options() const { return options_; }
  // Orders the calls on each session (every session RPC goes through it).
  SessionSequencer& sequencer() { return sequencer_; }

  // A new session `id` (empty: an unguessable one) owned by caller.owner, with the leading blocks the prefix index
  // holds under config.prefix_keys attached (SessionInfo.attached_tokens). ALREADY_EXISTS if the caller has it open,
  // RESOURCE_EXHAUSTED at max_sessions, INVALID_ARGUMENT naming max_tokens past the limit, prefix_keys past the
  // blocks of max_tokens, or a cache whose block would not fit a pool chunk.
  absl::StatusOr<v1::SessionInfo> Create(const SessionConfig& config, const std::string& id,
                                         const SessionCaller& caller);
  // A copy of `id` sharing its blocks, as `new_id` (empty: the store picks one).
  absl::StatusOr<v1::SessionInfo> Fork(const std::string& id, const std::string& new_id, const SessionCaller& caller);
  // Every cache of `id` cut to at most `length` tokens.
  absl::StatusOr<v1::SessionInfo> Truncate(const std::string& id, int64_t length, const SessionCaller& caller);
  // Ends `id` of `owner` (empty: the caller's own). Only an admin may name another owner (PERMISSION_DENIED
  // naming "owner" otherwise).
  absl::Status Close(const std::string& id, const SessionCaller& caller, const std::string& owner = "");
  // The caller's sessions (every one for an admin, each with its owner), ordered by id.
  std::vector<v1::SessionInfo> List(const SessionCaller& caller) const;
  // Cache `cache` of session `id`; NOT_FOUND naming `field` (saying whether it was closed, expired or evicted), or
  // OUT_OF_RANGE naming "layer_index" for a cache it does not have.
  absl::StatusOr<CacheView> View(const std::string& id, int64_t cache, const SessionCaller& caller,
                                 absl::string_view field) const;
  // Blocks for `items` (held sessions, distinct), evicting idle prefix blocks, then least recently used idle
  // sessions while the pool has no room; RESOURCE_EXHAUSTED saying how full it is when even that does not make room,
  // INVALID_ARGUMENT naming items[i].prefix_keys[j] for a key that differs from the one its block has.
  absl::StatusOr<ExtendReservation> Reserve(absl::Span<const ReserveItem> items);
  // What a shutdown's drain watches: sessions open, when a session call last ended (or a session was created), and
  // the bytes of cache blocks in use.
  struct Activity {
    int open = 0;
    int in_use = 0;  // of those, sessions a call is using now
    absl::Time last_used = absl::InfinitePast();
    int64_t cache_bytes = 0;
    int64_t table_bytes = 0;  // the sessions' bookkeeping (and the prefix index's), counted against the pool
    int64_t prefix_blocks = 0;      // blocks findable by prefix key
    int64_t prefix_bytes = 0;       // their bytes
    int64_t prefix_idle_bytes = 0;  // of those, in blocks no session references
    int64_t recent_ends = 0;        // ends remembered for NOT_FOUND's messages (at most kRecentEnds)
  };
  Activity activity() const;
  // Ends every open session (the server stops), counted as evictions for `reason`; returns what they were.
  Activity EndAll(absl::string_view reason);
  // Ends the idle sessions whose idle timeout has passed at `now`; returns how many.
  int ExpireIdle(absl::Time now);
  // Marks the sessions of `keys` (SessionKey) used now (a call on them ended), which restarts their idle timeouts.
  void Touch(absl::Span<const std::string> keys);

  int64_t capacity_bytes() const { return pool_capacity_; }
  // Where the cache blocks live, for the log: "host memory", or the arena's CacheArena::describe().
  std::string cache_memory() const { return arena_ != nullptr ? arena_->describe() : "host memory"; }

 private:
  friend class ExtendReservation;
  struct Cache {
    KvCacheLayout layout;
    std::vector<char*> blocks;  // ceil(length / block_tokens) of them
    int64_t length = 0;
  };
  struct Session {
    std::string id;
    std::string owner;
    SessionConfig config;  // max_tokens and idle_timeout resolved
    std::vector<Cache> caches;
    absl::Time last_used;
    int64_t table_bytes = 0;  // its bookkeeping as last charged (TableBytes)
    std::string prefix_scope;            // where its prefix keys are looked up and published
    std::vector<std::string> prefix_keys;  // by block index; empty: none given for that block
  };
  // What one owner holds: sessions, and bytes (blocks it allocated that are still referenced, plus its sessions'
  // table bytes). Only owners with open sessions have one.
  struct OwnerUse {
    int sessions = 0;
    int64_t bytes = 0;
  };
  // kDisplaced: evicted at max_sessions for an owner below its share.
  enum class EndReason { kClosed, kExpired, kEvicted, kDisplaced };
  struct End {
    EndReason reason;
    absl::Time when;
    absl::Duration idle_timeout;
    uint64_t order = 0;  // its place in end_order_
  };

  // Session `id` of `owner`, or NOT_FOUND naming `field` (why, when it ended recently).
  absl::StatusOr<Session*> Find(const std::string& owner, const std::string& id, absl::string_view field) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A free id in `owner`'s scope for a new session: `wanted` (checked, ALREADY_EXISTS if open) or a random one.
  absl::StatusOr<std::string> NewId(const std::string& owner, const std::string& wanted, absl::string_view field)
      const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `with_owner`: SessionInfo.owner filled (for an admin).
  v1::SessionInfo Info(const Session& session, bool with_owner = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the session's blocks and records why it ended.
  void EndSession(std::map<std::string, Session>::iterator it, EndReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bytes a session's bookkeeping holds on the heap: its map entry, ids, caches and block tables (an estimate
  // of the allocations, by their sizes and capacities).
  static int64_t TableBytes(const std::string& key, const Session& session);
  // Charges the session's bookkeeping anew (after its tables changed) to its owner and the pool.
  void Recharge(Session* session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `bytes` (may be negative) of bookkeeping to `owner` and the pool's reserved bytes.
  void ChargeTables(const std::string& owner, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a reference to `block` of `bytes` held by `owner`'s session; the owner is charged no more once it is free.
  void Unref(char* block, int64_t bytes, const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What `owner` holds now (zero when it holds no session), and how many owners hold sessions, it counted.
  OwnerUse UseOf(const std::string& owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int OwnersWith(const std::string& owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `owner` may grow by `bytes`: within --kv_cache_mb_per_token, and (for evicting others) within its share.
  bool PastByteCap(const std::string& owner, int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts one idle session to make room for `bytes` more of `owner` (see the shares above); false when it may
  // evict none.
  bool EvictFor(const std::string& owner, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A block of `bytes` for `owner`, charged to it, evicting while there is no room; nullptr when nothing more may
  // be evicted.
  char* AllocateEvicting(int64_t bytes, const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges two partly free chunks of one block size by moving the blocks of idle sessions, when the pool has room
  // for `bytes` but no chunk that a block of that size could come from; true if a chunk was emptied. Blocks of
  // sessions a call holds (and of reservations) never move: their calls use them without the store's lock.
  bool Compact(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When the pool has the bytes but no chunk for a block of `bytes`: evicts the idle sessions that hold one whole
  // chunk, the fewest such, among those `owner` may evict (see the shares above); false if none can be emptied so.
  bool EvictChunkFor(const std::string& owner, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for `bytes` more bookkeeping of `owner` in the pool, evicting while there is none; false if it cannot.
  bool FitTables(int64_t bytes, const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for one more session of `owner` (max_sessions, its share, its cap): OK, possibly after evicting an idle
  // session of an owner over its share; RESOURCE_EXHAUSTED naming the limit otherwise.
  absl::Status RoomForSession(const std::string& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inserts a new session under `key`, counted for its owner and charged.
  Session& Insert(const std::string& key, Session session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Commit(ExtendReservation* reservation);
  void Abort(ExtendReservation* reservation);
  // Gives back what the reservation took.
  void Release(ExtendReservation* reservation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED's message for `owner`'s call that still needs `needed` blocks of `block_bytes`: how full,
  // and why nothing more could be evicted.
  std::string FullMessage(const std::string& owner, int64_t needed, int64_t block_bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Publish() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Shared prefixes (session_prefix.cc).
  // The prefix index's configuration key of cache `c`: its layer (as registered) or its cache index and heads, and
  // the layout.
  std::string PrefixConfig(const Session& s, int64_t c) const;
  // Attaches the longest run of leading blocks indexed under s->prefix_keys to every cache; returns its tokens.
  int64_t Attach(Session* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Indexes the blocks of cache `c` that became full past `old_length` and have keys.
  void PublishFull(const Session& s, int64_t c, int64_t old_length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the least recently used idle prefix block; false when none is idle.
  bool EvictIdlePrefix() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts the prefix index's own bytes (its entries) against the pool beside the block tables.
  void SyncPrefixTables() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT when a key of item `i` differs from the one its block has already.
  absl::Status CheckPrefixKeys(const Session& s, const ReserveItem& item, int64_t length, size_t i) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionStoreOptions options_;
  ServerMetrics* const metrics_;
  const std::unique_ptr<CacheArena> arena_;  // null: host memory; declared before pool_, so it outlives it
  mutable absl::Mutex mu_;
  BlockPool pool_ ABSL_GUARDED_BY(mu_);
  const int64_t pool_capacity_;
  const int64_t pool_chunk_bytes_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);  // by key
  std::map<std::string, OwnerUse> owners_ ABSL_GUARDED_BY(mu_);  // by owner, those with sessions
  int64_t table_bytes_ ABSL_GUARDED_BY(mu_) = 0;                 // every session's TableBytes, and prefix_'s
  PrefixCache prefix_ ABSL_GUARDED_BY(mu_);
  int64_t prefix_tables_ ABSL_GUARDED_BY(mu_) = 0;  // prefix_.table_bytes() as counted in table_bytes_
  // The recent ends by key, for NOT_FOUND's message, and the order they came in: at most kRecentEnds of each, the
  // oldest out first. An id ended, reused and ended again leaves its older place in end_order_ behind (its order no
  // longer matches ended_'s), so the deque, not the map, is what is bounded.
  static constexpr size_t kRecentEnds = 4096;
  std::map<std::string, End> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<std::string, uint64_t>> end_order_ ABSL_GUARDED_BY(mu_);
  uint64_t ends_ ABSL_GUARDED_BY(mu_) = 0;
  // Last, so that it goes first: its starter thread may still start a call on the store until it is gone.
  SessionSequencer sequencer_;
  // The lines saying why sessions ended (expired, evicted): one call that needs the whole pool, or a client that
  // creates sessions to be evicted, ends many at once; the metrics count every end.
  static constexpr int kEndLinesPerSecond = 20;
  LogBudget end_lines_{kEndLinesPerSecond};
};

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_SESSION_STORE_H_
