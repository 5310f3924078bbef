// SessionStore's shared prefixes (session_store.h, "Shared prefixes"): attaching indexed blocks to a new session,
// indexing the blocks a session fills under its keys, and evicting idle indexed blocks. Every function here runs
// under the store's lock.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/attention_shape.h"
#include "server/sessions/session_store.h"

namespace mha {

std::string SessionStore::PrefixConfig(const Session& s, int64_t c) const {
  const KvCacheLayout& layout = s.caches[c].layout;
  const std::string cache = absl::StrCat(layout.dtype, "|", layout.block_tokens, "|", layout.num_kv_heads, "|",
                                         layout.head_dim, "|");
  // A layer's id changes when it is replaced or reloaded: its blocks hold the old weights' keys and values.
  if (s.config.is_layer_session()) return absl::StrCat("layer|", s.config.layers[c].id, "|", cache);
  // Head sessions: RoPE and the scale enter the stored keys or their use; the whole configuration counts.
  return absl::StrCat("heads|", c, "|", cache, HeadConfigOf(s.config.HeadsOf(c)).SerializeAsString());
}

int64_t SessionStore::Attach(Session* s) {
  const int64_t tb = options_.block_tokens;
  int64_t run = std::min<int64_t>(static_cast<int64_t>(s->prefix_keys.size()), s->config.max_tokens / tb);
  std::vector<std::vector<char*>> found(s->caches.size());
  for (size_t c = 0; c < s->caches.size() && run > 0; ++c) {
    const std::string config = PrefixConfig(*s, static_cast<int64_t>(c));
    for (int64_t b = 0; b < run; ++b) {
      char* block = s->prefix_keys[b].empty()
                        ? nullptr
                        : prefix_.Find(PrefixCache::EntryKey(s->prefix_scope, config, s->prefix_keys[b]));
      if (block == nullptr) {
        run = b;
        break;
      }
      found[c].push_back(block);
    }
  }
  if (run == 0) return 0;
  for (size_t c = 0; c < s->caches.size(); ++c) {
    Cache& cache = s->caches[c];
    for (int64_t b = 0; b < run; ++b) {
      char* block = found[c][b];
      pool_.Ref(block);
      if (prefix_.IsIdle(block)) {  // nobody's until now: this token's while its sessions hold it
        prefix_.MarkUsed(block, s->owner);
        owners_[s->owner].bytes += cache.layout.BlockBytes();
      }
      cache.blocks.push_back(block);
    }
    cache.length = run * tb;
  }
  Recharge(s);
  return run * tb;
}

void SessionStore::PublishFull(const Session& s, int64_t c, int64_t old_length) {
  const Cache& cache = s.caches[c];
  const int64_t tb = cache.layout.block_tokens;
  const int64_t first = old_length / tb, full = std::min<int64_t>(cache.length / tb, s.prefix_keys.size());
  if (first >= full) return;
  const std::string config = PrefixConfig(s, c);
  for (int64_t b = first; b < full; ++b) {
    char* block = cache.blocks[b];
    if (s.prefix_keys[b].empty() || prefix_.Contains(block)) continue;
    // The first block indexed under a key stays its block; a second one filled alike stays its session's own.
    if (prefix_.Insert(PrefixCache::EntryKey(s.prefix_scope, config, s.prefix_keys[b]), block,
                       cache.layout.BlockBytes(), s.owner)) {
      pool_.Ref(block);
    }
  }
  SyncPrefixTables();
}

bool SessionStore::EvictIdlePrefix() {
  char* block = prefix_.PopIdle();
  if (block == nullptr) return false;
  pool_.Unref(block);  // the index's reference, its last: freed
  SyncPrefixTables();
  if (metrics_ != nullptr) metrics_->RecordPrefixEviction();
  return true;
}

void SessionStore::SyncPrefixTables() {
  table_bytes_ += prefix_.table_bytes() - prefix_tables_;
  prefix_tables_ = prefix_.table_bytes();
  pool_.set_reserved_bytes(table_bytes_);
}

absl::Status SessionStore::CheckPrefixKeys(const Session& s, const ReserveItem& item, int64_t length,
                                           size_t i) const {
  const int64_t from = length / options_.block_tokens;
  for (size_t j = 0; j < item.prefix_keys.size(); ++j) {
    const size_t b = static_cast<size_t>(from) + j;
    if (b < s.prefix_keys.size() && !s.prefix_keys[b].empty() && s.prefix_keys[b] != item.prefix_keys[j]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "items[", i, "].prefix_keys[", j, "] differs from the key session '", item.id, "' has for its block ", b,
          " (given at CreateSession or by an earlier Extend); a block's key cannot change"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mha
