// SessionStore's accounting and room-making (session_store.h, "Shares between owners"): what each owner holds
// (blocks and the block tables' bytes, charged against the pool), and which idle session goes when a call needs
// room in the pool or under --max_sessions. Every function here runs under the store's lock.
#include "server/sessions/session_store.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mha {

absl::Status SessionStore::RoomForSession(const std::string& owner) {
  const OwnerUse mine = UseOf(owner);
  if (options_.max_sessions_per_owner > 0 && mine.sessions >= options_.max_sessions_per_owner) {
    return absl::ResourceExhaustedError(absl::StrCat("this token has ", mine.sessions, " sessions open, its limit "
                                                     "(--max_sessions_per_token); close one, or let idle ones expire"));
  }
  if (static_cast<int>(sessions_.size()) < options_.max_sessions) return absl::OkStatus();
  const int owners = OwnersWith(owner);
  const int share = std::max(1, options_.max_sessions / owners);
  if (mine.sessions < share) {
    auto victim = sessions_.end();
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
      if (owners_.at(it->second.owner).sessions <= share || sequencer_.Held(it->first)) continue;
      if (victim == sessions_.end() || it->second.last_used < victim->second.last_used) victim = it;
    }
    if (victim != sessions_.end()) {
      EndSession(victim, EndReason::kDisplaced);
      return absl::OkStatus();
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      sessions_.size(), " sessions are open, the server's limit (--max_sessions); ",
      owners > 1 ? absl::StrCat("this token holds ", mine.sessions, ", its share while ", owners,
                                " tokens hold sessions is ", share, "; ")
                 : "",
      "close one, or let idle ones expire"));
}

char* SessionStore::AllocateEvicting(int64_t bytes, const std::string& owner) {
  for (;;) {
    if (!PastByteCap(owner, bytes)) {
      if (char* block = pool_.Allocate(bytes); block != nullptr) {
        owners_[owner].bytes += bytes;
        return block;
      }
    }
    if (!EvictFor(owner, bytes)) return nullptr;
  }
}

bool SessionStore::FitTables(int64_t bytes, const std::string& owner) {
  while (PastByteCap(owner, bytes) || pool_.used_bytes() + table_bytes_ + bytes > pool_capacity_) {
    if (!EvictFor(owner, bytes)) return false;
  }
  return true;
}

SessionStore::OwnerUse SessionStore::UseOf(const std::string& owner) const {
  const auto it = owners_.find(owner);
  return it != owners_.end() ? it->second : OwnerUse{};
}

int SessionStore::OwnersWith(const std::string& owner) const {
  return static_cast<int>(owners_.size()) + (owners_.count(owner) == 0 ? 1 : 0);
}

bool SessionStore::PastByteCap(const std::string& owner, int64_t bytes) const {
  return options_.max_bytes_per_owner > 0 && UseOf(owner).bytes + bytes > options_.max_bytes_per_owner;
}

bool SessionStore::EvictFor(const std::string& owner, int64_t bytes) {
  const int64_t share = pool_capacity_ / OwnersWith(owner);
  const bool within_share = !PastByteCap(owner, bytes) && UseOf(owner).bytes + bytes <= share;
  // The least recently used idle session among those `eligible` accepts.
  const auto lru = [&](auto eligible) {
    auto victim = sessions_.end();
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
      if (!eligible(it->second) || sequencer_.Held(it->first)) continue;
      if (victim == sessions_.end() || it->second.last_used < victim->second.last_used) victim = it;
    }
    return victim;
  };
  auto victim = sessions_.end();
  if (within_share) {
    victim = lru([&](const Session& s) { return s.owner != owner && owners_.at(s.owner).bytes > share; });
  }
  if (victim == sessions_.end()) victim = lru([&](const Session& s) { return s.owner == owner; });
  // Nobody over a share, yet no room (blocks of other sizes hold the chunks): anyone's, for an owner within its.
  if (victim == sessions_.end() && within_share) victim = lru([](const Session&) { return true; });
  if (victim == sessions_.end()) return false;
  EndSession(victim, EndReason::kEvicted);
  return true;
}

std::string SessionStore::FullMessage(const std::string& owner, int64_t needed, int64_t block_bytes) const {
  if (PastByteCap(owner, block_bytes)) {
    return absl::StrCat("this token's sessions hold ", UseOf(owner).bytes, " bytes of the KV cache, its limit "
                        "(--kv_cache_mb_per_token) being ", options_.max_bytes_per_owner, "; this call needs at "
                        "least ", needed, " more block(s) of ", block_bytes, " bytes");
  }
  int in_use = 0, idle_of_others = 0;
  for (const auto& [key, s] : sessions_) {
    const bool held = sequencer_.Held(key);
    in_use += held ? 1 : 0;
    idle_of_others += !held && s.owner != owner ? 1 : 0;
  }
  const int owners = OwnersWith(owner);
  std::string message = absl::StrCat("the KV cache is full: ", pool_.used_bytes() + table_bytes_, " of ",
                                     pool_capacity_, " bytes (--kv_cache_mb) in blocks and tables of ",
                                     sessions_.size(), " sessions, ", in_use, " in use by calls");
  if (idle_of_others > 0) {
    absl::StrAppend(&message, ", ", idle_of_others, " idle of other tokens, which this one may not evict: it holds ",
                    UseOf(owner).bytes, " bytes, and its share while ", owners, " tokens hold sessions is ",
                    pool_capacity_ / owners);
  }
  absl::StrAppend(&message, "; this call needs at least ", needed, " more block(s)");
  return message;
}

int64_t SessionStore::TableBytes(const std::string& key, const Session& s) {
  // The map's node (its links and the pair), the strings' characters, and every vector's capacity.
  int64_t bytes = static_cast<int64_t>(sizeof(std::pair<const std::string, Session>)) + 32;
  bytes += static_cast<int64_t>(key.size() + s.id.size() + s.owner.size());
  bytes += static_cast<int64_t>(s.caches.capacity() * sizeof(Cache));
  for (const Cache& cache : s.caches) bytes += static_cast<int64_t>(cache.blocks.capacity() * sizeof(char*));
  bytes += static_cast<int64_t>(s.config.layers.capacity() * sizeof(SessionLayer));
  for (const SessionLayer& layer : s.config.layers) bytes += static_cast<int64_t>(layer.name.size());
  return bytes;
}

void SessionStore::ChargeTables(const std::string& owner, int64_t bytes) {
  table_bytes_ += bytes;
  owners_[owner].bytes += bytes;
  pool_.set_reserved_bytes(table_bytes_);
}

void SessionStore::Recharge(Session* s) {
  const int64_t now = TableBytes(SessionKey(s->owner, s->id), *s);
  ChargeTables(s->owner, now - s->table_bytes);
  s->table_bytes = now;
}

void SessionStore::Unref(char* block, int64_t bytes, const std::string& owner) {
  if (pool_.Unref(block)) owners_[owner].bytes -= bytes;
}

}  // namespace mha
