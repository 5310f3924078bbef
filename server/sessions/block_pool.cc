#include "server/sessions/block_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace mha {

int64_t BlockPool::ChunkBytesFor(int64_t capacity_bytes) {
  int64_t chunk = kChunkBytes;
  while (chunk > kMinChunkBytes && chunk * 32 > capacity_bytes) chunk /= 2;
  return chunk;
}

BlockPool::BlockPool(int64_t capacity_bytes, int64_t keep_resident_bytes, int64_t chunk_bytes)
    : owns_arena_(true), chunk_bytes_(chunk_bytes), keep_resident_(keep_resident_bytes / chunk_bytes) {
  const int64_t chunks = std::max<int64_t>(1, capacity_bytes / chunk_bytes_);
  // Address space only: MAP_NORESERVE commits nothing, pages are backed when first written.
  void* base = mmap(nullptr, chunks * chunk_bytes_, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    std::fprintf(stderr, "BlockPool: cannot reserve %lld bytes of address space\n",
                 static_cast<long long>(chunks * chunk_bytes_));
    std::abort();
  }
  // Transparent huge pages where the system allows them (THP "madvise"): decode streams whole blocks, and 2 MiB
  // pages spare it a TLB miss every 4 KiB. Advice only; without it the pool works the same.
  madvise(base, chunks * chunk_bytes_, MADV_HUGEPAGE);
  base_ = static_cast<char*>(base);
  chunks_.resize(chunks);
  // Lowest chunks first, so that a lightly used pool touches few of them.
  for (int64_t c = chunks - 1; c >= 0; --c) free_chunks_.push_back(c);
}

// The lender's memory is not ours to advise or give back: every emptied chunk stays resident.
BlockPool::BlockPool(char* base, int64_t bytes, int64_t chunk_bytes)
    : owns_arena_(false), chunk_bytes_(chunk_bytes), keep_resident_(bytes / chunk_bytes) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kAlignment != 0 || bytes < chunk_bytes_) {
    std::fprintf(stderr, "BlockPool: a lent arena needs a %lld-aligned base and at least %lld bytes, got %p, %lld\n",
                 static_cast<long long>(kAlignment), static_cast<long long>(chunk_bytes_), static_cast<void*>(base),
                 static_cast<long long>(bytes));
    std::abort();
  }
  base_ = base;
  const int64_t chunks = bytes / chunk_bytes_;
  chunks_.resize(chunks);
  for (int64_t c = chunks - 1; c >= 0; --c) free_chunks_.push_back(c);
}

BlockPool::~BlockPool() {
  if (owns_arena_) munmap(base_, capacity_bytes());
}

bool BlockPool::HasRoom(int64_t bytes) const {
  if (bytes < 1 || bytes > chunk_bytes_) return false;
  if (!HasBytesFor(bytes)) return false;
  const auto partial = partial_chunks_.find(Rounded(bytes));
  return !free_chunks_.empty() || !resident_chunks_.empty() ||
         (partial != partial_chunks_.end() && !partial->second.empty());
}

char* BlockPool::Allocate(int64_t bytes) {
  if (bytes < 1 || bytes > chunk_bytes_) return nullptr;
  const int64_t size = Rounded(bytes);
  if (!HasBytesFor(size)) return nullptr;
  std::set<int64_t>& partial = partial_chunks_[size];
  if (partial.empty()) {
    std::vector<int64_t>& source = !resident_chunks_.empty() ? resident_chunks_ : free_chunks_;
    if (source.empty()) return nullptr;
    const int64_t c = source.back();
    source.pop_back();
    Chunk& chunk = chunks_[c];
    const int32_t blocks = static_cast<int32_t>(chunk_bytes_ / size);
    chunk.block_bytes = size;
    chunk.refs.assign(blocks, 0);
    chunk.free.clear();
    for (int32_t b = blocks - 1; b >= 0; --b) chunk.free.push_back(b);
    partial.insert(c);
    ++chunks_in_use_;
  }
  const int64_t c = *partial.begin();
  Chunk& chunk = chunks_[c];
  const int32_t index = chunk.free.back();
  chunk.free.pop_back();
  chunk.refs[index] = 1;
  ++chunk.used;
  if (chunk.free.empty()) partial.erase(c);
  used_bytes_ += size;
  return base_ + c * chunk_bytes_ + index * size;
}

void BlockPool::Ref(char* block) {
  Chunk& chunk = chunks_[ChunkOf(block)];
  int32_t& refs = chunk.refs[IndexOf(block, chunk)];
  if (++refs == 2) ++shared_blocks_;
}

bool BlockPool::Unref(char* block) {
  const int64_t c = ChunkOf(block);
  Chunk& chunk = chunks_[c];
  const int32_t index = IndexOf(block, chunk);
  int32_t& refs = chunk.refs[index];
  if (--refs == 1) --shared_blocks_;
  if (refs > 0) return false;
  used_bytes_ -= chunk.block_bytes;
  if (chunk.free.empty()) partial_chunks_[chunk.block_bytes].insert(c);
  chunk.free.push_back(index);
  if (--chunk.used > 0) return true;
  // The chunk is empty: it may serve another block size; its pages stay for the next blocks, or go back to the
  // system beyond what the pool keeps.
  partial_chunks_[chunk.block_bytes].erase(c);
  chunk = Chunk();
  --chunks_in_use_;
  if (!owns_arena_ || static_cast<int64_t>(resident_chunks_.size()) < keep_resident_) {
    resident_chunks_.push_back(c);
    return true;
  }
  madvise(base_ + c * chunk_bytes_, chunk_bytes_, MADV_DONTNEED);
  free_chunks_.push_back(c);
  return true;
}

std::vector<BlockPool::ChunkUse> BlockPool::ChunksInUse() const {
  std::vector<ChunkUse> in_use;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks_.size()); ++c) {
    const Chunk& chunk = chunks_[c];
    if (chunk.used == 0) continue;
    in_use.push_back({c, chunk.block_bytes, chunk.used, static_cast<int32_t>(chunk.refs.size())});
  }
  return in_use;
}

std::vector<char*> BlockPool::BlocksIn(int64_t index) const {
  std::vector<char*> blocks;
  const Chunk& chunk = chunks_[index];
  for (size_t b = 0; b < chunk.refs.size(); ++b) {
    if (chunk.refs[b] > 0) blocks.push_back(base_ + index * chunk_bytes_ + static_cast<int64_t>(b) * chunk.block_bytes);
  }
  return blocks;
}

char* BlockPool::Relocate(char* block) {
  const int64_t from = ChunkOf(block);
  const int64_t size = chunks_[from].block_bytes;
  int64_t to = -1;
  for (const int64_t c : partial_chunks_[size]) {
    if (c != from && (to < 0 || chunks_[c].used > chunks_[to].used)) to = c;
  }
  if (to < 0) return nullptr;
  Chunk& target = chunks_[to];
  const int32_t index = target.free.back();
  target.free.pop_back();
  ++target.used;
  if (target.free.empty()) partial_chunks_[size].erase(to);
  char* moved = base_ + to * chunk_bytes_ + static_cast<int64_t>(index) * size;
  std::memcpy(moved, block, static_cast<size_t>(size));
  Chunk& source = chunks_[from];
  const int32_t refs = source.refs[IndexOf(block, source)];
  target.refs[index] = refs;
  used_bytes_ += size;
  // The references went with the bytes (a shared block stays one shared block): the old one is freed.
  source.refs[IndexOf(block, source)] = 1;
  Unref(block);
  return moved;
}

int BlockPool::RefCount(const char* block) const {
  const Chunk& chunk = chunks_[ChunkOf(block)];
  return chunk.refs[IndexOf(block, chunk)];
}

}  // namespace mha
