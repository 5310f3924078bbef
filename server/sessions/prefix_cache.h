// The shared-prefix index (mha.v1 CreateSessionRequest.prefix_keys): full cache blocks findable by the key a client
// gave them, within a scope (the caller's token and cache salt, or the whole server's) and a cache configuration
// (a layer's, or a head session's per cache index). The index holds one reference to each of its blocks (the
// SessionStore takes and drops it in the BlockPool); a block only it references is idle, and idle blocks are evicted
// least recently used first. A block's bytes are charged to the token whose session holds it (the one that filled
// it, or that attached it while it was idle) and to nobody while it is idle.
//
// Lookups are by an entry key that joins scope, configuration and key unambiguously, so a lookup in one scope can
// neither find nor take longer for another scope's blocks (a hash map: no ordering by key content).
//
// Not thread-safe: the SessionStore serialises every call.
#ifndef MHA_SERVER_SESSIONS_PREFIX_CACHE_H_
#define MHA_SERVER_SESSIONS_PREFIX_CACHE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

namespace mha {

class PrefixCache {
 public:
  // The entry key of `key` in `scope` for caches of `config` (any bytes each).
  static std::string EntryKey(absl::string_view scope, absl::string_view config, absl::string_view key);

  // The block under `entry`, or nullptr. A block's place in the LRU order is when it last turned idle (a session
  // attaching it takes it out of the order).
  char* Find(const std::string& entry) const;
  // Indexes `block` (of `bytes`, charged to `owner`) under `entry`; false (nothing changes) when the entry is
  // taken or the block is indexed already. The caller has added the index's reference.
  bool Insert(const std::string& entry, char* block, int64_t bytes, const std::string& owner);
  bool Contains(const char* block) const { return by_block_.count(block) != 0; }
  // The token charged for an indexed block, if any: none while idle, or once that token's last session ended while
  // another token's session still holds the block (ForgetOwner).
  const std::string* ChargedOwner(const char* block) const;
  // `owner` holds no session any more: the blocks charged to it stay with the sessions of other tokens (a server
  // scope), charged to nobody, so that a later entry of that token is not undercharged when they turn idle.
  void ForgetOwner(const std::string& owner);
  // An indexed block is now referenced by the index alone: idle, charged to nobody, last in the LRU order.
  void MarkIdle(const char* block);
  // An idle indexed block is referenced by a session of `owner` again, which it is now charged to.
  void MarkUsed(const char* block, const std::string& owner);
  bool IsIdle(const char* block) const;
  // Removes the least recently used idle block from the index and returns it (the caller drops the index's
  // reference, which frees it); nullptr when none is idle.
  char* PopIdle();

  int64_t blocks() const { return static_cast<int64_t>(by_block_.size()); }
  int64_t bytes() const { return bytes_; }
  int64_t idle_bytes() const { return idle_bytes_; }
  // The heap the index holds (entries and their keys), an estimate counted against the pool like block tables.
  int64_t table_bytes() const { return table_bytes_; }

 private:
  struct Entry {
    char* block = nullptr;
    int64_t bytes = 0;
    std::string owner;      // charged, when `charged`
    bool charged = false;
    uint64_t idle_seq = 0;  // its place in idle_ while idle, else 0
  };
  static int64_t EntryBytes(const std::string& entry) { return static_cast<int64_t>(2 * entry.size() + 160); }

  absl::flat_hash_map<std::string, Entry> entries_;
  absl::flat_hash_map<const char*, std::string> by_block_;  // block -> its entry key
  std::map<uint64_t, const char*> idle_;                   // LRU order: oldest first
  uint64_t next_seq_ = 1;
  int64_t bytes_ = 0;
  int64_t idle_bytes_ = 0;
  int64_t table_bytes_ = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_PREFIX_CACHE_H_
