// The sessions' block pool: blocks from one arena, never past it; reference counts; blocks of every size sharing
// chunks, refused only when no free run fits them; chunks that go back to the system when empty; and the same over
// memory a backend lends (a CacheArena), which the pool never gives back or unmaps.
#include "server/sessions/block_pool.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace mha {
namespace {

constexpr int64_t kChunk = BlockPool::kChunkBytes;

TEST(BlockPool, CapacityIsWholeChunksAndAtLeastOne) {
  EXPECT_EQ(BlockPool(3 * kChunk + 5).capacity_bytes(), 3 * kChunk);
  EXPECT_EQ(BlockPool(1).capacity_bytes(), kChunk);
}

TEST(BlockPool, AllocatesUpToItsCapacityThenRefuses) {
  BlockPool pool(2 * kChunk);
  std::vector<char*> blocks;
  for (int i = 0; i < 8; ++i) {
    char* block = pool.Allocate(kChunk / 4);
    ASSERT_NE(block, nullptr) << i;
    blocks.push_back(block);
  }
  EXPECT_FALSE(pool.HasRoom(kChunk / 4));
  EXPECT_EQ(pool.Allocate(kChunk / 4), nullptr);
  EXPECT_EQ(pool.Allocate(64), nullptr);  // nor a block of any other size: the bytes are all used
  EXPECT_EQ(pool.used_bytes(), 2 * kChunk);
  EXPECT_EQ(std::set<char*>(blocks.begin(), blocks.end()).size(), blocks.size());
}

TEST(BlockPool, BlocksStartOnCacheLinesAndDoNotOverlap) {
  BlockPool pool(kChunk);
  std::vector<char*> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(pool.Allocate(100));  // rounded up to 128
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(blocks[i]) % BlockPool::kAlignment, 0u);
    std::memset(blocks[i], static_cast<int>(i), 100);
  }
  for (size_t i = 0; i < blocks.size(); ++i) EXPECT_EQ(blocks[i][99], static_cast<char>(i));
  EXPECT_EQ(pool.used_bytes(), 10 * 128);
}

TEST(BlockPool, RejectsSizesNoChunkHolds) {
  BlockPool pool(kChunk);
  EXPECT_EQ(pool.Allocate(0), nullptr);
  EXPECT_EQ(pool.Allocate(kChunk + 1), nullptr);
  EXPECT_FALSE(pool.HasRoom(kChunk + 1));
  EXPECT_NE(pool.Allocate(kChunk), nullptr);
}

TEST(BlockPool, TheLastReferenceFreesABlock) {
  BlockPool pool(kChunk);
  char* block = pool.Allocate(4096);
  EXPECT_EQ(pool.RefCount(block), 1);
  pool.Ref(block);
  pool.Ref(block);
  EXPECT_EQ(pool.RefCount(block), 3);
  EXPECT_EQ(pool.shared_blocks(), 1);
  EXPECT_FALSE(pool.Unref(block));
  EXPECT_FALSE(pool.Unref(block));
  EXPECT_EQ(pool.RefCount(block), 1);
  EXPECT_EQ(pool.shared_blocks(), 0);
  EXPECT_EQ(pool.used_bytes(), 4096);
  EXPECT_TRUE(pool.Unref(block));
  EXPECT_EQ(pool.used_bytes(), 0);
  EXPECT_EQ(pool.chunks_in_use(), 0);
}

// Bytes spent outside the blocks (the store's block tables) count against the capacity: blocks fill only the rest.
TEST(BlockPool, ReservedBytesLeaveLessForBlocks) {
  BlockPool pool(kChunk);
  pool.set_reserved_bytes(kChunk - 8192);
  EXPECT_NE(pool.Allocate(4096), nullptr);
  EXPECT_NE(pool.Allocate(4096), nullptr);
  EXPECT_FALSE(pool.HasRoom(4096));
  EXPECT_EQ(pool.Allocate(4096), nullptr);
  pool.set_reserved_bytes(kChunk);  // past what is free: nothing more until blocks go
  EXPECT_EQ(pool.Allocate(64), nullptr);
  pool.set_reserved_bytes(0);
  EXPECT_NE(pool.Allocate(4096), nullptr);
}

TEST(BlockPool, ASmallPoolTakesSmallerChunks) {
  EXPECT_EQ(BlockPool::ChunkBytesFor(int64_t{1} << 30), BlockPool::kChunkBytes);
  EXPECT_EQ(BlockPool::ChunkBytesFor(int64_t{64} << 20), BlockPool::kChunkBytes);
  EXPECT_EQ(BlockPool::ChunkBytesFor(int64_t{32} << 20), int64_t{1} << 20);
  EXPECT_EQ(BlockPool::ChunkBytesFor(int64_t{4} << 20), BlockPool::kMinChunkBytes);
  BlockPool pool(int64_t{4} << 20, 0, BlockPool::ChunkBytesFor(int64_t{4} << 20));
  EXPECT_EQ(pool.capacity_bytes(), int64_t{4} << 20);
  for (const int64_t bytes : {65536, 4096, 16384, 8192, 1024}) {
    ASSERT_NE(pool.Allocate(bytes), nullptr) << bytes;
  }
  EXPECT_EQ(pool.chunks_in_use(), 1);  // sizes share a chunk
  EXPECT_EQ(pool.Allocate(BlockPool::kMinChunkBytes + 64), nullptr);  // larger than its chunks
}

// Compaction: a block moves with its bytes and references into a free run of another chunk, and the chunk it
// leaves is free for a block of any size once empty.
TEST(BlockPool, ARelocatedBlockKeepsItsBytesAndReferencesAndEmptiesItsChunk) {
  BlockPool pool(2 * kChunk);
  std::vector<char*> first;
  for (int i = 0; i < 512; ++i) first.push_back(pool.Allocate(4096));  // chunk A, full
  char* lone = pool.Allocate(4096);                                     // chunk B
  pool.Unref(first[7]);                                                 // a free run in A
  std::memset(lone, 0x5a, 4096);
  pool.Ref(lone);
  char* moved = pool.Relocate(lone);
  ASSERT_NE(moved, nullptr);
  EXPECT_EQ(moved, first[7]);  // the free run of the other chunk
  EXPECT_EQ(moved[0], 0x5a);
  EXPECT_EQ(moved[4095], 0x5a);
  EXPECT_EQ(pool.RefCount(moved), 2);
  EXPECT_EQ(pool.shared_blocks(), 1);
  EXPECT_EQ(pool.used_bytes(), 512 * 4096);
  EXPECT_EQ(pool.chunks_in_use(), 1);  // B is empty: a block of any size may take it
  EXPECT_NE(pool.Allocate(kChunk), nullptr);
}

TEST(BlockPool, ABlockNoOtherChunkHasARunForStays) {
  BlockPool pool(2 * kChunk);
  char* block = pool.Allocate(4096);
  pool.Allocate(8192);
  EXPECT_EQ(pool.Relocate(block), nullptr);  // its own chunk is the only one in use
  EXPECT_EQ(pool.RefCount(block), 1);
  ASSERT_EQ(pool.ChunksInUse().size(), 1u);
  EXPECT_EQ(pool.BlocksIn(pool.ChunksInUse()[0].index).size(), 2u);
}

TEST(BlockPool, AFreedBlockIsReusedBeforeAFreshChunk) {
  BlockPool pool(2 * kChunk);
  char* a = pool.Allocate(4096);
  char* b = pool.Allocate(4096);
  pool.Unref(a);
  EXPECT_EQ(pool.Allocate(4096), a);  // the run that fits it most tightly
  EXPECT_EQ(pool.chunks_in_use(), 1);
  pool.Unref(b);
}

TEST(BlockPool, BlocksOfEverySizeShareAChunk) {
  BlockPool pool(2 * kChunk);
  char* small = pool.Allocate(1024);
  char* medium = pool.Allocate(16384);
  char* large = pool.Allocate(kChunk - 1024 - 16384);
  ASSERT_NE(small, nullptr);
  ASSERT_NE(medium, nullptr);
  ASSERT_NE(large, nullptr);
  EXPECT_EQ(pool.chunks_in_use(), 1);
  EXPECT_NE(pool.Allocate(kChunk), nullptr);  // the second chunk, whole
  EXPECT_EQ(pool.chunks_in_use(), 2);
}

// The one way it refuses with bytes free: no run of any chunk is as long as the block.
TEST(BlockPool, ABlockIsRefusedOnlyWhenNoFreeRunFitsIt) {
  BlockPool pool(kChunk);
  std::vector<char*> blocks;
  for (int i = 0; i < 512; ++i) blocks.push_back(pool.Allocate(4096));
  for (int i = 0; i < 512; i += 2) pool.Unref(blocks[i]);  // half free, in runs of 4 KiB
  EXPECT_TRUE(pool.HasBytesFor(8192));
  EXPECT_FALSE(pool.HasRoom(8192));
  EXPECT_EQ(pool.Allocate(8192), nullptr);
  EXPECT_NE(pool.Allocate(4096), nullptr);
  pool.Unref(blocks[3]);  // runs on either side coalesce: 4 + 4 + 4 KiB
  char* wide = pool.Allocate(12288);
  EXPECT_EQ(wide, blocks[2]);
}

// Blocks of several sizes, freed in any order, leave the chunk whole again.
TEST(BlockPool, FreedRunsCoalesceIntoAWholeChunk) {
  BlockPool pool(2 * kChunk);
  std::vector<char*> blocks;
  for (int i = 0; i < 60; ++i) blocks.push_back(pool.Allocate(1024 * (1 + i % 5)));
  ASSERT_EQ(pool.chunks_in_use(), 1);
  char* other = pool.Allocate(kChunk);  // keeps the second chunk busy, so the first must be reused whole
  ASSERT_NE(other, nullptr);
  for (int i = 0; i < 60; i += 2) pool.Unref(blocks[i]);
  for (int i = 59; i > 0; i -= 2) pool.Unref(blocks[i]);
  EXPECT_EQ(pool.chunks_in_use(), 1);
  EXPECT_EQ(pool.used_bytes(), kChunk);
  EXPECT_NE(pool.Allocate(kChunk), nullptr);
}

TEST(BlockPool, AnEmptiedChunkBeyondWhatItKeepsGoesBackToTheSystem) {
  // MADV_DONTNEED on private anonymous memory: the next touch reads zeros, the sign that the pages were dropped.
  BlockPool pool(kChunk, /*keep_resident_bytes=*/0);
  std::vector<char*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.Allocate(kChunk / 16));
    std::memset(blocks.back(), 0x5a, kChunk / 16);
  }
  for (char* block : blocks) pool.Unref(block);
  char* again = pool.Allocate(kChunk);
  ASSERT_NE(again, nullptr);
  for (int64_t i = 0; i < kChunk; i += 4096) ASSERT_EQ(again[i], 0) << i;
}

TEST(BlockPool, EmptiedChunksItKeepsServeTheNextBlocksFirst) {
  BlockPool pool(4 * kChunk, /*keep_resident_bytes=*/kChunk);
  char* a = pool.Allocate(kChunk);
  char* b = pool.Allocate(kChunk);
  std::memset(a, 0x5a, kChunk);
  pool.Unref(a);  // kept resident
  pool.Unref(b);  // beyond what is kept: given back
  char* again = pool.Allocate(kChunk);
  EXPECT_EQ(again, a);
  EXPECT_EQ(again[kChunk - 1], 0x5a);  // its pages were kept
  EXPECT_TRUE(pool.HasRoom(kChunk));
}

// Memory lent to a pool, as a backend's CacheArena lends it: the test owns it and frees it after the pool.
class LentMemory {
 public:
  explicit LentMemory(int64_t bytes)
      : bytes_(bytes), base_(static_cast<char*>(std::aligned_alloc(kChunk, static_cast<size_t>(bytes)))) {}
  ~LentMemory() { std::free(base_); }
  char* base() const { return base_; }
  int64_t bytes() const { return bytes_; }
  bool Holds(const char* p, int64_t n) const { return p >= base_ && p + n <= base_ + bytes_; }

 private:
  const int64_t bytes_;
  char* const base_;
};

TEST(BlockPoolLentArena, CapacityIsTheLentMemoryInWholeChunks) {
  LentMemory memory(3 * kChunk);
  EXPECT_EQ(BlockPool(memory.base(), 3 * kChunk).capacity_bytes(), 3 * kChunk);
  EXPECT_EQ(BlockPool(memory.base(), 2 * kChunk + kChunk / 2).capacity_bytes(), 2 * kChunk);
  EXPECT_TRUE(BlockPool(memory.base(), kChunk).external_arena());
  EXPECT_FALSE(BlockPool(kChunk).external_arena());
}

TEST(BlockPoolLentArena, BlocksComeFromTheLentMemoryUpToItsCapacityThenItRefuses) {
  LentMemory memory(2 * kChunk);
  BlockPool pool(memory.base(), memory.bytes());
  std::set<char*> blocks;
  for (int i = 0; i < 8; ++i) {
    char* block = pool.Allocate(kChunk / 4);
    ASSERT_NE(block, nullptr) << i;
    EXPECT_TRUE(memory.Holds(block, kChunk / 4)) << i;
    blocks.insert(block);
  }
  EXPECT_EQ(blocks.size(), 8u);
  EXPECT_EQ(pool.used_bytes(), 2 * kChunk);
  EXPECT_FALSE(pool.HasRoom(kChunk / 4));
  EXPECT_EQ(pool.Allocate(kChunk / 4), nullptr);
  EXPECT_EQ(pool.Allocate(64), nullptr);
}

TEST(BlockPoolLentArena, AFreedBlockIsReusedInPlace) {
  LentMemory memory(2 * kChunk);
  BlockPool pool(memory.base(), memory.bytes());
  char* a = pool.Allocate(4096);
  char* b = pool.Allocate(4096);
  EXPECT_EQ(b, a + 4096);  // lowest chunk first, blocks in order
  pool.Unref(a);
  EXPECT_EQ(pool.Allocate(4096), a);
  EXPECT_EQ(pool.chunks_in_use(), 1);
}

TEST(BlockPoolLentArena, AnEmptiedChunkStaysWithThePoolUntouched) {
  // No madvise: the bytes written before the chunk emptied are still there (a pool of its own would read zeros).
  LentMemory memory(kChunk);
  BlockPool pool(memory.base(), memory.bytes());
  std::vector<char*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.Allocate(kChunk / 16));
    std::memset(blocks.back(), 0x5a, kChunk / 16);
  }
  for (char* block : blocks) pool.Unref(block);
  EXPECT_EQ(pool.chunks_in_use(), 0);
  char* again = pool.Allocate(kChunk);  // the emptied chunk serves another size
  ASSERT_EQ(again, memory.base());
  for (int64_t i = 0; i < kChunk; i += 4096) ASSERT_EQ(again[i], 0x5a) << i;
}

TEST(BlockPoolLentArena, TheLentMemoryOutlivesThePool) {
  LentMemory memory(kChunk);
  {
    BlockPool pool(memory.base(), memory.bytes());
    std::memset(pool.Allocate(kChunk), 0x33, kChunk);
  }
  // Not unmapped by the pool: still the lender's to read and write.
  EXPECT_EQ(memory.base()[kChunk - 1], 0x33);
  memory.base()[0] = 1;
  EXPECT_EQ(memory.base()[0], 1);
}

TEST(BlockPoolLentArenaDeathTest, RefusesMemoryThatCannotHoldAnAlignedChunk) {
  LentMemory memory(2 * kChunk);
  EXPECT_DEATH(BlockPool(memory.base() + 1, kChunk), "lent arena");
  EXPECT_DEATH(BlockPool(memory.base(), kChunk - 1), "lent arena");
  EXPECT_DEATH(BlockPool(nullptr, kChunk), "lent arena");
}

}  // namespace
}  // namespace mha
