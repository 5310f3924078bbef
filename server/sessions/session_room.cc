// SessionStore's accounting and room-making (session_store.h, "Shares between owners"): what each owner holds
// (blocks and the block tables' bytes, charged against the pool), and which idle session goes when a call needs
// room in the pool or under --max_sessions. Every function here runs under the store's lock.
#include "server/sessions/session_store.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

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
  bool rearranged = false;  // Compact and EvictChunkFor read every table: tried once per block, not per eviction
  for (;;) {
    if (!PastByteCap(owner, bytes)) {
      if (char* block = pool_.Allocate(bytes); block != nullptr) {
        owners_[owner].bytes += bytes;
        return block;
      }
      if (EvictIdlePrefix()) continue;  // blocks only the prefix index holds go before any session
      // The bytes are there, in chunks of other sizes: merge chunks, or else empty the one that costs fewest
      // sessions, rather than evict by age until some chunk happens to empty.
      if (!rearranged) {
        rearranged = true;
        if (Compact(bytes) || EvictChunkFor(owner, bytes)) continue;
      }
    }
    if (!EvictFor(owner, bytes)) return nullptr;
  }
}

bool SessionStore::EvictChunkFor(const std::string& owner, int64_t bytes) {
  if (!pool_.HasBytesFor(bytes)) return false;
  const int64_t share = pool_capacity_ / OwnersWith(owner);
  const bool within_share = !PastByteCap(owner, bytes) && UseOf(owner).bytes + bytes <= share;
  // The references to each block from idle sessions this owner may evict (EvictFor's first two tiers).
  std::map<const char*, std::vector<const std::string*>> refs;
  for (const auto& [key, s] : sessions_) {
    if (sequencer_.Held(key)) continue;
    if (s.owner != owner && !(within_share && owners_.at(s.owner).bytes > share)) continue;
    for (const Cache& cache : s.caches) {
      for (const char* block : cache.blocks) refs[block].push_back(&key);
    }
  }
  // The chunk whose blocks those sessions alone hold, emptied by evicting the fewest of them.
  std::set<std::string> cheapest;
  bool found = false;
  for (const BlockPool::ChunkUse& chunk : pool_.ChunksInUse()) {
    std::set<std::string> victims;
    bool freeable = true;
    for (const char* block : pool_.BlocksIn(chunk.index)) {
      const auto it = refs.find(block);
      if (it == refs.end() || static_cast<int>(it->second.size()) != pool_.RefCount(block)) {
        freeable = false;
        break;
      }
      for (const std::string* key : it->second) victims.insert(*key);
    }
    if (freeable && (!found || victims.size() < cheapest.size())) {
      cheapest = std::move(victims);
      found = true;
    }
  }
  if (!found) return false;
  for (const std::string& key : cheapest) EndSession(sessions_.find(key), EndReason::kEvicted);
  return true;
}

bool SessionStore::Compact(int64_t bytes) {
  if (!pool_.HasBytesFor(bytes)) return false;  // truly full
  // Where each block of an idle session is referenced; a block is movable when those are all its references.
  std::map<char*, std::vector<char**>> refs;
  for (auto& [key, s] : sessions_) {
    if (sequencer_.Held(key)) continue;
    for (Cache& cache : s.caches) {
      for (char*& block : cache.blocks) refs[block].push_back(&block);
    }
  }
  std::vector<BlockPool::ChunkUse> chunks = pool_.ChunksInUse();
  int64_t free_in_use = 0;  // free bytes of the chunks in use
  for (const BlockPool::ChunkUse& c : chunks) free_in_use += pool_.chunk_bytes() - c.used_bytes;
  std::sort(chunks.begin(), chunks.end(), [](const BlockPool::ChunkUse& a, const BlockPool::ChunkUse& b) {
    return a.used_bytes < b.used_bytes;
  });
  for (const BlockPool::ChunkUse& chunk : chunks) {
    // The emptiest chunk whose blocks the other chunks' free bytes could take, and which holds only movable ones;
    // its blocks move largest first into the runs that fit them most tightly. One that finds no run stays (what
    // moved stays moved: the same blocks elsewhere), and the next chunk is tried.
    if (free_in_use - (pool_.chunk_bytes() - chunk.used_bytes) < chunk.used_bytes) continue;
    const std::vector<char*> blocks = pool_.BlocksIn(chunk.index);
    const bool movable = std::all_of(blocks.begin(), blocks.end(), [&](char* block) {
      const auto found = refs.find(block);
      return found != refs.end() && static_cast<int>(found->second.size()) == pool_.RefCount(block);
    });
    if (!movable) continue;
    bool emptied = true;
    for (char* block : blocks) {
      char* moved = pool_.Relocate(block);
      if (moved == nullptr) {
        emptied = false;
        break;
      }
      std::vector<char**> to_repoint = std::move(refs[block]);
      refs.erase(block);
      for (char** ref : to_repoint) *ref = moved;
      refs[moved] = std::move(to_repoint);
    }
    if (emptied) return true;
  }
  return false;
}

bool SessionStore::FitTables(int64_t bytes, const std::string& owner) {
  while (PastByteCap(owner, bytes) || pool_.used_bytes() + table_bytes_ + bytes > pool_capacity_) {
    if (!PastByteCap(owner, bytes) && EvictIdlePrefix()) continue;
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
  if (pool_.HasBytesFor(block_bytes)) {
    absl::StrAppend(&message, "; the bytes are free, but in runs shorter than a block between blocks in use by "
                    "calls");
  }
  absl::StrAppend(&message, "; this call needs at least ", needed, " more block(s) of ", block_bytes, " bytes");
  return message;
}

namespace {

// A head configuration's heap: longrope's lists of frequency divisors (up to head_dim / 2 each, and a session may
// hold one per cache).
int64_t HeapBytes(const HeadSpec& heads) {
  return static_cast<int64_t>((heads.rope_scaling.short_factor.capacity() +
                               heads.rope_scaling.long_factor.capacity()) * sizeof(double));
}

}  // namespace

int64_t SessionStore::TableBytes(const std::string& key, const Session& s) {
  // The map's node (its links and the pair), the strings' characters, and every vector's capacity.
  int64_t bytes = static_cast<int64_t>(sizeof(std::pair<const std::string, Session>)) + 32;
  bytes += static_cast<int64_t>(key.size() + s.id.size() + s.owner.size());
  bytes += static_cast<int64_t>(s.caches.capacity() * sizeof(Cache));
  for (const Cache& cache : s.caches) bytes += static_cast<int64_t>(cache.blocks.capacity() * sizeof(char*));
  bytes += static_cast<int64_t>(s.config.layers.capacity() * sizeof(SessionLayer));
  bytes += static_cast<int64_t>(s.prefix_keys.capacity() * sizeof(std::string) + s.prefix_scope.size());
  for (const std::string& key : s.prefix_keys) bytes += static_cast<int64_t>(key.size());
  for (const SessionLayer& layer : s.config.layers) {
    bytes += static_cast<int64_t>(layer.name.size()) + HeapBytes(layer.heads);
  }
  bytes += static_cast<int64_t>(s.config.layer_heads.capacity() * sizeof(HeadSpec)) + HeapBytes(s.config.heads);
  for (const HeadSpec& heads : s.config.layer_heads) bytes += HeapBytes(heads);
  bytes += static_cast<int64_t>(s.config.cache_salt.size());
  return bytes;
}

void SessionStore::ChargeTables(const std::string& owner, int64_t bytes) {
  table_bytes_ += bytes;
  owners_[owner].bytes += bytes;
  pool_.set_reserved_bytes(table_bytes_);  // with the prefix index's bytes, which SyncPrefixTables keeps there
}

void SessionStore::Recharge(Session* s) {
  const int64_t now = TableBytes(SessionKey(s->owner, s->id), *s);
  ChargeTables(s->owner, now - s->table_bytes);
  s->table_bytes = now;
}

void SessionStore::Unref(char* block, int64_t bytes, const std::string& owner) {
  if (pool_.Unref(block)) {
    owners_[owner].bytes -= bytes;
    return;
  }
  // An indexed block that no session references any more: the index's alone, charged to nobody.
  if (pool_.RefCount(block) == 1 && prefix_.Contains(block) && !prefix_.IsIdle(block)) {
    const std::string* charged = prefix_.ChargedOwner(block);
    if (const auto it = charged != nullptr ? owners_.find(*charged) : owners_.end(); it != owners_.end()) {
      it->second.bytes -= bytes;
    }
    prefix_.MarkIdle(block);
  }
}

}  // namespace mha
