#include "server/sessions/prefix_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace mha {

std::string PrefixCache::EntryKey(absl::string_view scope, absl::string_view config, absl::string_view key) {
  // Length-prefixed, so that no two (scope, config, key) triples join into one string.
  return absl::StrCat(scope.size(), ":", scope, config.size(), ":", config, key);
}

char* PrefixCache::Find(const std::string& entry) const {
  const auto it = entries_.find(entry);
  return it == entries_.end() ? nullptr : it->second.block;
}

bool PrefixCache::Insert(const std::string& entry, char* block, int64_t bytes, const std::string& owner) {
  if (entries_.count(entry) != 0 || by_block_.count(block) != 0) return false;
  entries_[entry] = {block, bytes, owner, true, 0};
  by_block_[block] = entry;
  bytes_ += bytes;
  table_bytes_ += EntryBytes(entry);
  return true;
}

const std::string* PrefixCache::ChargedOwner(const char* block) const {
  const Entry& e = entries_.at(by_block_.at(block));
  return e.charged ? &e.owner : nullptr;
}

void PrefixCache::ForgetOwner(const std::string& owner) {
  for (auto& [key, e] : entries_) {
    if (e.charged && e.owner == owner) e.charged = false;
  }
}

bool PrefixCache::IsIdle(const char* block) const {
  const auto it = by_block_.find(block);
  return it != by_block_.end() && entries_.at(it->second).idle_seq != 0;
}

void PrefixCache::MarkIdle(const char* block) {
  Entry& e = entries_.at(by_block_.at(block));
  if (e.idle_seq != 0) return;
  e.owner.clear();
  e.charged = false;
  e.idle_seq = next_seq_++;
  idle_[e.idle_seq] = e.block;
  idle_bytes_ += e.bytes;
}

void PrefixCache::MarkUsed(const char* block, const std::string& owner) {
  Entry& e = entries_.at(by_block_.at(block));
  if (e.idle_seq == 0) return;
  idle_.erase(e.idle_seq);
  e.idle_seq = 0;
  e.owner = owner;
  e.charged = true;
  idle_bytes_ -= e.bytes;
}

char* PrefixCache::PopIdle() {
  if (idle_.empty()) return nullptr;
  char* block = const_cast<char*>(idle_.begin()->second);
  idle_.erase(idle_.begin());
  const auto key = by_block_.find(block);
  const auto it = entries_.find(key->second);
  bytes_ -= it->second.bytes;
  idle_bytes_ -= it->second.bytes;
  table_bytes_ -= EntryBytes(it->first);
  entries_.erase(it);
  by_block_.erase(key);
  return block;
}

}  // namespace mha
