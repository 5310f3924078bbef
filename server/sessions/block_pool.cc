#include "server/sessions/block_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

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
  return !free_chunks_.empty() || !resident_chunks_.empty() || TightestChunk(Rounded(bytes), -1) >= 0;
}

int64_t BlockPool::TightestChunk(int64_t size, int64_t except) const {
  for (auto it = by_largest_.lower_bound({size, -1}); it != by_largest_.end(); ++it) {
    if (it->second != except) return it->second;
  }
  return -1;
}

void BlockPool::SetLargest(int64_t c, int64_t largest) {
  Chunk& chunk = chunks_[c];
  if (chunk.largest > 0) by_largest_.erase({chunk.largest, c});
  chunk.largest = largest;
  if (largest > 0) by_largest_.insert({largest, c});
}

int64_t BlockPool::OpenChunk() {
  std::vector<int64_t>& source = !resident_chunks_.empty() ? resident_chunks_ : free_chunks_;
  if (source.empty()) return -1;
  const int64_t c = source.back();
  source.pop_back();
  chunks_[c].runs = {{0, chunk_bytes_}};
  SetLargest(c, chunk_bytes_);
  ++chunks_in_use_;
  return c;
}

char* BlockPool::Carve(int64_t c, int64_t size, int32_t refs) {
  Chunk& chunk = chunks_[c];
  auto best = chunk.runs.end();
  for (auto it = chunk.runs.begin(); it != chunk.runs.end(); ++it) {
    if (it->second >= size && (best == chunk.runs.end() || it->second < best->second)) best = it;
  }
  const int64_t offset = best->first, left = best->second - size;
  const bool was_largest = best->second == chunk.largest;
  chunk.runs.erase(best);
  if (left > 0) chunk.runs[offset + size] = left;
  if (was_largest) {
    int64_t largest = 0;
    for (const auto& [start, length] : chunk.runs) largest = std::max(largest, length);
    SetLargest(c, largest);
  }
  chunk.blocks[offset] = {size, refs};
  chunk.used_bytes += size;
  used_bytes_ += size;
  return base_ + c * chunk_bytes_ + offset;
}

char* BlockPool::Allocate(int64_t bytes) {
  if (bytes < 1 || bytes > chunk_bytes_) return nullptr;
  const int64_t size = Rounded(bytes);
  if (!HasBytesFor(size)) return nullptr;
  int64_t c = TightestChunk(size, -1);
  if (c < 0) c = OpenChunk();
  if (c < 0) return nullptr;
  return Carve(c, size, 1);
}

void BlockPool::Ref(char* block) {
  if (++BlockAt(block).refs == 2) ++shared_blocks_;
}

bool BlockPool::Unref(char* block) {
  int32_t& refs = BlockAt(block).refs;
  if (--refs == 1) --shared_blocks_;
  if (refs > 0) return false;
  Release(block);
  return true;
}

void BlockPool::Release(char* block) {
  const int64_t c = ChunkOf(block);
  Chunk& chunk = chunks_[c];
  int64_t offset = OffsetOf(block);
  const auto found = chunk.blocks.find(offset);
  int64_t length = found->second.bytes;
  chunk.blocks.erase(found);
  chunk.used_bytes -= length;
  used_bytes_ -= length;
  if (chunk.blocks.empty()) {
    // The chunk is empty: its pages stay for the next blocks, or go back to the system beyond what the pool keeps.
    SetLargest(c, 0);
    chunk.runs.clear();
    --chunks_in_use_;
    if (!owns_arena_ || static_cast<int64_t>(resident_chunks_.size()) < keep_resident_) {
      resident_chunks_.push_back(c);
      return;
    }
    madvise(base_ + c * chunk_bytes_, chunk_bytes_, MADV_DONTNEED);
    free_chunks_.push_back(c);
    return;
  }
  // Coalesced with the free runs on either side.
  auto next = chunk.runs.lower_bound(offset);
  if (next != chunk.runs.end() && next->first == offset + length) {
    length += next->second;
    next = chunk.runs.erase(next);
  }
  if (next != chunk.runs.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == offset) {
      offset = previous->first;
      length += previous->second;
      chunk.runs.erase(previous);
    }
  }
  chunk.runs[offset] = length;
  if (length > chunk.largest) SetLargest(c, length);
}

std::vector<BlockPool::ChunkUse> BlockPool::ChunksInUse() const {
  std::vector<ChunkUse> in_use;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks_.size()); ++c) {
    const Chunk& chunk = chunks_[c];
    if (chunk.blocks.empty()) continue;
    in_use.push_back({c, static_cast<int32_t>(chunk.blocks.size()), chunk.used_bytes, chunk.largest});
  }
  return in_use;
}

std::vector<char*> BlockPool::BlocksIn(int64_t index) const {
  std::vector<std::pair<int64_t, char*>> sized;
  for (const auto& [offset, block] : chunks_[index].blocks) {
    sized.push_back({block.bytes, base_ + index * chunk_bytes_ + offset});
  }
  std::stable_sort(sized.begin(), sized.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<char*> blocks;
  for (const auto& [bytes, block] : sized) blocks.push_back(block);
  return blocks;
}

char* BlockPool::Relocate(char* block) {
  const Block moving = BlockAt(block);
  const int64_t to = TightestChunk(moving.bytes, ChunkOf(block));
  if (to < 0) return nullptr;
  // The references go with the bytes (a shared block stays one shared block): the old one is released as it is.
  char* moved = Carve(to, moving.bytes, moving.refs);
  std::memcpy(moved, block, static_cast<size_t>(moving.bytes));
  Release(block);
  return moved;
}

int BlockPool::RefCount(const char* block) const { return BlockAt(block).refs; }

int64_t BlockPool::BlockBytes(const char* block) const { return BlockAt(block).bytes; }

}  // namespace mha
