#include "server/sessions/session_store.h"

#include <sys/random.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 128 random bits from the kernel's generator, as 32 hex digits.
std::string RandomId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

// The chunk size of a pool of `bytes` for the store's options.
int64_t ChunkBytesOf(const SessionStoreOptions& options, int64_t bytes) {
  return options.chunk_bytes > 0 ? options.chunk_bytes : BlockPool::ChunkBytesFor(bytes);
}

// "12 s" for a duration, to the second.
std::string Seconds(absl::Duration d) { return absl::StrCat(absl::ToInt64Seconds(d), " s"); }

}  // namespace

std::string SessionKey(absl::string_view owner, absl::string_view id) {
  return owner.empty() ? std::string(id) : absl::StrCat(owner, "/", id);
}

ExtendReservation::ExtendReservation(ExtendReservation&& other) noexcept
    : store_(other.store_), items_(std::move(other.items_)) {
  other.items_.clear();
}

ExtendReservation& ExtendReservation::operator=(ExtendReservation&& other) noexcept {
  if (this != &other) {
    if (store_ != nullptr && !items_.empty()) store_->Abort(this);
    store_ = other.store_;
    items_ = std::move(other.items_);
    other.items_.clear();
  }
  return *this;
}

ExtendReservation::~ExtendReservation() {
  if (store_ != nullptr && !items_.empty()) store_->Abort(this);
}

void ExtendReservation::Commit() {
  if (store_ != nullptr && !items_.empty()) store_->Commit(this);
}

SessionStore::SessionStore(const SessionStoreOptions& options, ServerMetrics* metrics,
                           std::unique_ptr<CacheArena> arena)
    : options_(options),
      metrics_(metrics),
      arena_(std::move(arena)),
      pool_(arena_ != nullptr
                ? BlockPool(arena_->base(), arena_->bytes(), ChunkBytesOf(options, arena_->bytes()))
                : BlockPool(options.capacity_bytes, int64_t{64} << 20, ChunkBytesOf(options, options.capacity_bytes))),
      pool_capacity_(pool_.capacity_bytes()),
      pool_chunk_bytes_(pool_.chunk_bytes()),
      sequencer_(options.max_waiting, options.max_waiting_bytes) {
  absl::MutexLock lock(&mu_);
  Publish();
}

absl::StatusOr<SessionStore::Session*> SessionStore::Find(const std::string& owner, const std::string& id,
                                                          absl::string_view field) const {
  const std::string key = SessionKey(owner, id);
  const auto it = sessions_.find(key);
  if (it != sessions_.end()) return const_cast<Session*>(&it->second);
  const auto end = ended_.find(key);
  if (end != ended_.end()) {
    const absl::Duration ago = absl::Now() - end->second.when;
    switch (end->second.reason) {
      case EndReason::kClosed:
        return absl::NotFoundError(absl::StrCat(field, ": session '", id, "' was closed ", Seconds(ago), " ago"));
      case EndReason::kExpired:
        return absl::NotFoundError(absl::StrCat(field, ": session '", id, "' expired ", Seconds(ago),
                                                " ago, idle longer than its idle timeout (",
                                                Seconds(end->second.idle_timeout), ")"));
      case EndReason::kEvicted:
        return absl::NotFoundError(absl::StrCat(
            field, ": session '", id, "' was evicted ", Seconds(ago),
            " ago: the KV cache was full and it was the least recently used idle session (--kv_cache_mb)"));
      case EndReason::kDisplaced:
        return absl::NotFoundError(absl::StrCat(
            field, ": session '", id, "' was evicted ", Seconds(ago),
            " ago: the server was at its session limit (--max_sessions) and its token held more than its share"));
    }
  }
  return absl::NotFoundError(absl::StrCat(field, ": no session '", id,
                                          "' here (sessions live in one server's memory: this one never had it, it "
                                          "ended long ago, or the server restarted)"));
}

absl::StatusOr<std::string> SessionStore::NewId(const std::string& owner, const std::string& wanted,
                                                absl::string_view field) const {
  if (wanted.empty()) {
    for (;;) {
      std::string id = RandomId();
      if (sessions_.count(SessionKey(owner, id)) == 0) return id;
    }
  }
  RETURN_IF_ERROR(CheckName(wanted, field));
  if (sessions_.count(SessionKey(owner, wanted)) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(field, ": session '", wanted, "' is open already"));
  }
  return wanted;
}

v1::SessionInfo SessionStore::Info(const Session& s, bool with_owner) const {
  v1::SessionInfo info;
  info.set_session_id(s.id);
  if (with_owner) info.set_owner(s.owner);
  int64_t bytes = 0, shared = 0;
  for (const Cache& cache : s.caches) {
    info.add_lengths(cache.length);
    const int64_t block_bytes = cache.layout.BlockBytes();
    bytes += static_cast<int64_t>(cache.blocks.size()) * block_bytes;
    for (const char* block : cache.blocks) shared += pool_.RefCount(block) > 1 ? block_bytes : 0;
  }
  info.set_max_tokens(s.config.max_tokens);
  info.set_cache_dtype(s.config.cache_dtype);
  info.set_cache_bytes(bytes);
  info.set_shared_bytes(shared);
  if (s.config.is_layer_session()) {
    for (const SessionLayer& layer : s.config.layers) info.add_layers(layer.name);
  } else {
    *info.mutable_heads() = HeadConfigOf(s.config.heads);
    for (const HeadSpec& heads : s.config.layer_heads) *info.add_layer_heads() = HeadConfigOf(heads);
  }
  info.set_idle_timeout_s(static_cast<int32_t>(absl::ToInt64Seconds(s.config.idle_timeout)));
  info.set_idle_s(absl::ToDoubleSeconds(absl::Now() - s.last_used));
  return info;
}

absl::StatusOr<v1::SessionInfo> SessionStore::Create(const SessionConfig& given, const std::string& id,
                                                     const SessionCaller& caller) {
  SessionConfig config = given;
  if (config.max_tokens < 0 || config.max_tokens > options_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [0, ", options_.max_tokens,
                                                   "] (0 = the server's --max_session_tokens), got ",
                                                   config.max_tokens));
  }
  if (config.max_tokens == 0) config.max_tokens = options_.max_tokens;
  if (const int64_t blocks = CeilDiv(config.max_tokens, options_.block_tokens);
      static_cast<int64_t>(config.prefix_keys.size()) > blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_keys has ", config.prefix_keys.size(), " keys; a session of max_tokens ", config.max_tokens,
        " holds at most ", blocks, " blocks of ", options_.block_tokens, " tokens (--kv_block_tokens)"));
  }
  if (config.idle_timeout <= absl::ZeroDuration()) config.idle_timeout = options_.idle_timeout;
  config.idle_timeout = std::min(config.idle_timeout, options_.max_idle_timeout);
  std::vector<Cache> caches(config.num_caches);
  for (int64_t c = 0; c < config.num_caches; ++c) {
    const HeadSpec& heads = config.HeadsOf(c);
    caches[c].layout = {heads.num_kv_heads, heads.head_dim, options_.block_tokens, config.cache_dtype};
    // The elements alone first, in double: heads and head_dim are the client's (each up to 2^31), and their
    // product in int64 could wrap past the chunk's size.
    const double elements = 2.0 * static_cast<double>(heads.num_kv_heads) * static_cast<double>(heads.head_dim) *
                            static_cast<double>(options_.block_tokens);
    const bool too_large = elements * static_cast<double>(DTypeSize(config.cache_dtype)) > pool_chunk_bytes_;
    if (too_large || caches[c].layout.BlockBytes() > pool_chunk_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a cache block of ", config.is_layer_session() ? "layer '" + config.layers[c].name + "'" : "these heads",
          " would take ",
          too_large ? absl::StrCat(elements * static_cast<double>(DTypeSize(config.cache_dtype)))
                    : absl::StrCat(caches[c].layout.BlockBytes()),
          " bytes (2 Hkv d_k --kv_block_tokens sizeof(cache_dtype), and an 8-bit cache's scales), more than the ",
          "pool's ", pool_chunk_bytes_, "-byte chunks; the server needs a smaller --kv_block_tokens (or, "
          "below 64 MiB, whose chunks are a 32nd of it, a larger --kv_cache_mb)"));
    }
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::string session_id, NewId(caller.owner, id, "session_id"));
  RETURN_IF_ERROR(RoomForSession(caller.owner));
  Session s;
  s.id = session_id;
  s.owner = caller.owner;
  s.config = std::move(config);
  s.caches = std::move(caches);
  s.last_used = absl::Now();
  // Keys are scoped by token (unless the server opens them to everyone) and salt, joined unambiguously.
  const std::string& scope_owner = options_.prefix_scope_server ? std::string() : caller.owner;
  s.prefix_scope = absl::StrCat(scope_owner.size(), ":", scope_owner, s.config.cache_salt);
  s.prefix_keys = std::move(s.config.prefix_keys);
  s.config.prefix_keys.clear();
  s.config.cache_salt.clear();
  Session& created = Insert(SessionKey(caller.owner, session_id), std::move(s));
  const int64_t attached = Attach(&created);
  if (metrics_ != nullptr && !created.prefix_keys.empty()) {
    const int64_t asked = static_cast<int64_t>(created.prefix_keys.size()) * options_.block_tokens;
    metrics_->RecordPrefixLookup(attached, std::max<int64_t>(0, asked - attached));
  }
  Publish();
  v1::SessionInfo info = Info(created);
  info.set_attached_tokens(attached);
  return info;
}

SessionStore::Session& SessionStore::Insert(const std::string& key, Session session) {
  ended_.erase(key);  // a new session of that id: the old one's end no longer explains anything
  Session& s = sessions_[key] = std::move(session);
  ++owners_[s.owner].sessions;
  Recharge(&s);
  return s;
}

absl::StatusOr<v1::SessionInfo> SessionStore::Fork(const std::string& id, const std::string& new_id,
                                                   const SessionCaller& caller) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* source, Find(caller.owner, id, "session_id"));
  ASSIGN_OR_RETURN(std::string fork_id, NewId(caller.owner, new_id, "new_session_id"));
  RETURN_IF_ERROR(RoomForSession(caller.owner));  // may evict, but not the source: the fork's call holds it
  source->last_used = absl::Now();
  Session copy = *source;
  copy.id = fork_id;
  copy.table_bytes = 0;
  // The keys of the blocks it holds full; those its source was given for later blocks describe the source's tokens
  // to come, which the fork (beam search, other samples) need not append.
  int64_t full = static_cast<int64_t>(copy.prefix_keys.size());
  for (const Cache& cache : copy.caches) full = std::min(full, cache.length / cache.layout.block_tokens);
  copy.prefix_keys.resize(static_cast<size_t>(full));
  const std::string key = SessionKey(copy.owner, fork_id);
  // Its block tables are new memory though its blocks are shared: they count against the pool like blocks.
  const int64_t tables = TableBytes(key, copy);
  if (!FitTables(tables, caller.owner)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the KV cache is full: a fork's block tables take ", tables, " bytes of it (--kv_cache_mb), and ",
        pool_.used_bytes() + table_bytes_, " of ", pool_capacity_,
        " bytes are in use by sessions this token may not evict"));
  }
  for (Cache& cache : copy.caches) {
    for (char* block : cache.blocks) pool_.Ref(block);
  }
  const Session& fork = Insert(key, std::move(copy));
  Publish();
  return Info(fork);
}

absl::StatusOr<v1::SessionInfo> SessionStore::Truncate(const std::string& id, int64_t length,
                                                       const SessionCaller& caller) {
  if (length < 0) return absl::InvalidArgumentError(absl::StrCat("length must be >= 0, got ", length));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* s, Find(caller.owner, id, "session_id"));
  for (Cache& cache : s->caches) {
    if (length >= cache.length) continue;
    // The block cut into will hold other tokens: its key, and the later ones, no longer describe it.
    if (s->prefix_keys.size() > static_cast<size_t>(length / cache.layout.block_tokens)) {
      s->prefix_keys.resize(static_cast<size_t>(length / cache.layout.block_tokens));
      s->prefix_keys.shrink_to_fit();
    }
    cache.length = length;
    const size_t keep = static_cast<size_t>(CeilDiv(length, cache.layout.block_tokens));
    for (size_t b = cache.blocks.size(); b > keep; --b) {  // last first, as EndSession
      Unref(cache.blocks[b - 1], cache.layout.BlockBytes(), s->owner);
    }
    cache.blocks.resize(keep);
    cache.blocks.shrink_to_fit();
  }
  Recharge(s);
  s->last_used = absl::Now();
  Publish();
  return Info(*s);
}

absl::Status SessionStore::Close(const std::string& id, const SessionCaller& caller, const std::string& owner) {
  if (!owner.empty() && owner != caller.owner && !caller.admin) {
    return absl::PermissionDeniedError("owner: only an admin token may name another token's session");
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* s, Find(owner.empty() ? caller.owner : owner, id, "session_id"));
  EndSession(sessions_.find(SessionKey(s->owner, s->id)), EndReason::kClosed);
  Publish();
  return absl::OkStatus();
}

std::vector<v1::SessionInfo> SessionStore::List(const SessionCaller& caller) const {
  // One session at a time under the lock: a session's Info reads its whole block table, and a list of every one
  // at once held the lock for 0.8 s (F4 of #54). A session ending between the two steps is left out.
  std::vector<std::string> keys;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, s] : sessions_) {
      if (caller.admin || s.owner == caller.owner) keys.push_back(key);
    }
  }
  std::vector<v1::SessionInfo> list;
  for (const std::string& key : keys) {
    absl::MutexLock lock(&mu_);
    if (const auto it = sessions_.find(key); it != sessions_.end()) {
      list.push_back(Info(it->second, /*with_owner=*/caller.admin));
    }
  }
  // By key is by owner, then id: an admin's list is ordered by id (then owner) as everyone's.
  std::sort(list.begin(), list.end(), [](const v1::SessionInfo& a, const v1::SessionInfo& b) {
    return std::tie(a.session_id(), a.owner()) < std::tie(b.session_id(), b.owner());
  });
  return list;
}

absl::StatusOr<CacheView> SessionStore::View(const std::string& id, int64_t cache, const SessionCaller& caller,
                                             absl::string_view field) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const Session* s, Find(caller.owner, id, field));
  const int64_t caches = static_cast<int64_t>(s->caches.size());
  if (cache < 0 || cache >= caches) {
    return absl::InvalidArgumentError(absl::StrCat("layer_index must be in [0, ", caches, ") for session '", id,
                                                   "' (", caches, s->config.is_layer_session() ? " layers" : " caches",
                                                   "), got ", cache));
  }
  CacheView view;
  view.layer_session = s->config.is_layer_session();
  if (view.layer_session) view.layer = s->config.layers[cache];
  view.heads = s->config.HeadsOf(cache);
  view.layout = s->caches[cache].layout;
  view.length = s->caches[cache].length;
  view.max_tokens = s->config.max_tokens;
  view.num_caches = caches;
  return view;
}

absl::StatusOr<ExtendReservation> SessionStore::Reserve(absl::Span<const ReserveItem> items) {
  absl::MutexLock lock(&mu_);
  // Keys first, before any block is taken (an error return must not leave a reservation to abort under the lock).
  for (size_t i = 0; i < items.size(); ++i) {
    const auto found = sessions_.find(SessionKey(items[i].owner, items[i].id));
    if (found == sessions_.end()) return absl::InternalError("a held session vanished");
    RETURN_IF_ERROR(CheckPrefixKeys(found->second, items[i], found->second.caches[items[i].cache].length, i));
  }
  ExtendReservation reservation;
  reservation.store_ = this;
  int64_t needed = 0;       // blocks still wanted when the pool ran out
  int64_t block_bytes = 0;  // of the cache that wanted them
  for (const ReserveItem& want : items) {
    const Session& session = sessions_.at(SessionKey(want.owner, want.id));  // found above
    const Cache& cache = session.caches[want.cache];
    const int64_t tb = cache.layout.block_tokens, bytes = cache.layout.BlockBytes();
    block_bytes = bytes;
    ExtendReservation::Item item{SessionKey(want.owner, want.id), want.cache, cache.length, want.new_tokens,
                                 cache.blocks, {}, nullptr, 0, want.prefix_keys};
    // The new tokens' first slots lie in the last block when it is partly filled: a shared one is copied first.
    if (want.new_tokens > 0 && cache.length % tb != 0 && pool_.RefCount(cache.blocks.back()) > 1) {
      char* copy = AllocateEvicting(bytes, want.owner);
      if (copy == nullptr) {
        needed = 1 + CeilDiv(cache.length + want.new_tokens, tb) - static_cast<int64_t>(cache.blocks.size());
        reservation.items_.push_back(std::move(item));
        break;
      }
      std::memcpy(copy, cache.blocks.back(), bytes);
      item.replaced = cache.blocks.back();
      item.blocks.back() = copy;
      item.fresh.push_back(copy);
    }
    while (static_cast<int64_t>(item.blocks.size()) * tb < cache.length + want.new_tokens) {
      char* block = AllocateEvicting(bytes, want.owner);
      if (block == nullptr) {
        needed = CeilDiv(cache.length + want.new_tokens, tb) - static_cast<int64_t>(item.blocks.size());
        break;
      }
      item.blocks.push_back(block);
      item.fresh.push_back(block);
    }
    // Signed: the copy may hold less capacity than the table it copied.
    const int64_t growth =
        (static_cast<int64_t>(item.blocks.capacity()) - static_cast<int64_t>(cache.blocks.capacity())) *
        static_cast<int64_t>(sizeof(char*));
    if (needed == 0 && growth > 0) {
      if (FitTables(growth, want.owner)) {
        item.table_growth = growth;
        ChargeTables(want.owner, growth);
      } else {
        needed = 1;
      }
    }
    reservation.items_.push_back(std::move(item));
    if (needed > 0) break;
  }
  if (needed == 0) return reservation;
  const std::string message = FullMessage(items.front().owner, needed, block_bytes);
  Release(&reservation);
  return absl::ResourceExhaustedError(message);
}

void SessionStore::Commit(ExtendReservation* reservation) {
  absl::MutexLock lock(&mu_);
  int64_t tokens = 0;
  for (ExtendReservation::Item& item : reservation->items_) {
    Session& s = sessions_.at(item.key);  // held by the call: still there
    Cache& cache = s.caches[item.cache];
    cache.blocks = std::move(item.blocks);
    cache.length = item.length + item.new_tokens;
    if (item.replaced != nullptr) Unref(item.replaced, cache.layout.BlockBytes(), s.owner);
    const size_t from = static_cast<size_t>(item.length / cache.layout.block_tokens);
    if (!item.prefix_keys.empty() && s.prefix_keys.size() < from + item.prefix_keys.size()) {
      s.prefix_keys.resize(from + item.prefix_keys.size());
    }
    for (size_t j = 0; j < item.prefix_keys.size(); ++j) s.prefix_keys[from + j] = std::move(item.prefix_keys[j]);
    PublishFull(s, item.cache, item.length);
    ChargeTables(s.owner, -item.table_growth);  // charged at reservation; now the table itself counts
    Recharge(&s);
    s.last_used = absl::Now();
    tokens += item.new_tokens;
  }
  reservation->items_.clear();
  if (metrics_ != nullptr) metrics_->RecordTokensAppended(tokens);
  Publish();
}

void SessionStore::Abort(ExtendReservation* reservation) {
  absl::MutexLock lock(&mu_);
  Release(reservation);
}

void SessionStore::Release(ExtendReservation* reservation) {
  for (ExtendReservation::Item& item : reservation->items_) {
    const Session& s = sessions_.at(item.key);  // held by the call: still there
    for (char* block : item.fresh) Unref(block, s.caches[item.cache].layout.BlockBytes(), s.owner);
    ChargeTables(s.owner, -item.table_growth);
  }
  reservation->items_.clear();
  Publish();
}

void SessionStore::EndSession(std::map<std::string, Session>::iterator it, EndReason reason) {
  Session& s = it->second;
  // Last block first: indexed blocks turn idle in that order, so a prefix is evicted from its tail, and its first
  // blocks, which every longer prefix starts with, stay longest.
  for (Cache& cache : s.caches) {
    for (auto block = cache.blocks.rbegin(); block != cache.blocks.rend(); ++block) {
      Unref(*block, cache.layout.BlockBytes(), s.owner);
    }
  }
  ChargeTables(s.owner, -s.table_bytes);
  if (--owners_[s.owner].sessions == 0) {
    owners_.erase(s.owner);
    // Only a server scope shares indexed blocks across tokens: another's sessions may still hold some charged here.
    if (options_.prefix_scope_server) prefix_.ForgetOwner(s.owner);
  }
  while (end_order_.size() >= kRecentEnds) {
    const auto& [old_key, order] = end_order_.front();
    if (const auto old = ended_.find(old_key); old != ended_.end() && old->second.order == order) ended_.erase(old);
    end_order_.pop_front();
  }
  const std::string& key = it->first;
  end_order_.emplace_back(key, ++ends_);
  ended_[key] = {reason, absl::Now(), s.config.idle_timeout, ends_};
  if (reason != EndReason::kClosed && metrics_ != nullptr) {
    metrics_->RecordEviction(reason == EndReason::kExpired     ? "idle_timeout"
                             : reason == EndReason::kDisplaced ? "session_limit"
                                                               : "cache_full");
  }
  int64_t left_out = 0;
  if (reason != EndReason::kClosed && end_lines_.Take(absl::Now(), &left_out)) {
    const std::string more =
        left_out > 0 ? absl::StrCat(" (", left_out, " more session end(s) not logged before this one)") : "";
    if (reason == EndReason::kExpired) {
      spdlog::info("session {} expired: idle for more than {}{}", s.id, Seconds(s.config.idle_timeout), more);
    } else if (reason == EndReason::kEvicted) {
      spdlog::warn("session {} evicted to make room in the KV cache (least recently used, idle {}; {} of {} bytes "
                   "in use){}", s.id, Seconds(absl::Now() - s.last_used), pool_.used_bytes() + table_bytes_,
                   pool_capacity_, more);
    } else if (reason == EndReason::kDisplaced) {
      spdlog::warn("session {} evicted to make room for a session of a token below its share of --max_sessions "
                   "(least recently used of a token over its share, idle {}){}", s.id,
                   Seconds(absl::Now() - s.last_used), more);
    }
  }
  sessions_.erase(it);
}

int SessionStore::ExpireIdle(absl::Time now) {
  absl::MutexLock lock(&mu_);
  int expired = 0;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const auto next = std::next(it);
    if (now - it->second.last_used > it->second.config.idle_timeout && !sequencer_.InUse(it->first)) {
      EndSession(it, EndReason::kExpired);
      ++expired;
    }
    it = next;
  }
  if (expired > 0) Publish();
  return expired;
}

void SessionStore::Touch(absl::Span<const std::string> keys) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (const std::string& key : keys) {
    if (auto it = sessions_.find(key); it != sessions_.end()) it->second.last_used = now;
  }
}

SessionStore::Activity SessionStore::activity() const {
  absl::MutexLock lock(&mu_);
  Activity a;
  a.open = static_cast<int>(sessions_.size());
  for (const auto& [key, s] : sessions_) {
    a.last_used = std::max(a.last_used, s.last_used);
    a.in_use += sequencer_.InUse(key) ? 1 : 0;
  }
  a.cache_bytes = pool_.used_bytes();
  a.table_bytes = table_bytes_;
  a.prefix_blocks = prefix_.blocks();
  a.prefix_bytes = prefix_.bytes();
  a.prefix_idle_bytes = prefix_.idle_bytes();
  a.recent_ends = static_cast<int64_t>(end_order_.size());
  return a;
}

SessionStore::Activity SessionStore::EndAll(absl::string_view reason) {
  const Activity ended = activity();
  if (metrics_ != nullptr) {
    for (int i = 0; i < ended.open; ++i) metrics_->RecordEviction(reason);
  }
  return ended;
}

void SessionStore::Publish() const {
  if (metrics_ == nullptr) return;
  metrics_->SetSessions(static_cast<int>(sessions_.size()), pool_.used_bytes(), pool_capacity_,
                        pool_.shared_blocks());
  metrics_->SetPrefixCache(prefix_.blocks(), prefix_.bytes(), prefix_.idle_bytes());
}

}  // namespace mha
