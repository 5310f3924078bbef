// The memory of the sessions' KV caches: blocks carved from one arena of capacity_bytes, reserved at start as
// address space only. A page is backed by memory when a block on it is first written, and a chunk whose blocks are
// all free goes back to the system (madvise), so the process holds at most the capacity, and about what the blocks
// in use need. Blocks of any size (a cache's block size follows its head configuration and dtype) share every
// chunk: a block is a run of bytes in one chunk, taken from the chunk in use whose longest free run fits it most
// tightly, so that the pool refuses a block only when no chunk has a run that long, not when its size has no chunk
// of its own (one size per chunk refused calls with most of the pool free while sessions of other sizes held a
// little of every chunk). Blocks can be moved into other chunks (Relocate, which the store uses on idle sessions'
// blocks) to empty a chunk. Blocks are reference counted: forks share them copy-on-write.
//
// Or the arena is memory the caller lends (a backend's CacheArena: CUDA managed memory, which GPU kernels read in
// place): the same blocks and chunks, but the pool neither advises nor unmaps that memory; an emptied chunk simply
// stays with the pool for the next blocks.
//
// Not thread-safe: the SessionStore serialises every call. A block's bytes may be read and written without the
// store's lock by the one call that holds it (see SessionStore).
#ifndef MHA_SERVER_SESSIONS_BLOCK_POOL_H_
#define MHA_SERVER_SESSIONS_BLOCK_POOL_H_

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace mha {

class BlockPool {
 public:
  // Chunks are huge-page sized, so that the kernel may back a chunk full of blocks with one page: the default, and
  // the largest. A small pool takes smaller ones (ChunkBytesFor), so that it holds several block sizes at once.
  static constexpr int64_t kChunkBytes = int64_t{2} << 20;
  static constexpr int64_t kMinChunkBytes = int64_t{256} << 10;
  // The chunk size for a pool of `capacity_bytes`: a 32nd of it rounded down to a power of two, within
  // [kMinChunkBytes, kChunkBytes] (pools of 64 MiB and more: kChunkBytes).
  static int64_t ChunkBytesFor(int64_t capacity_bytes);
  // Block sizes are rounded up to a multiple of this, so that every block starts on a cache line.
  static constexpr int64_t kAlignment = 64;

  // An arena of capacity_bytes rounded down to whole chunks (at least one). Up to keep_resident_bytes of emptied
  // chunks stay backed by memory for the next blocks (faulting 4 MiB of pages in again cost a 512-token prefill a
  // tenth of its time); the rest go back to the system at once. Aborts if the address space cannot be reserved
  // (the server checks --kv_cache_mb before).
  explicit BlockPool(int64_t capacity_bytes, int64_t keep_resident_bytes = int64_t{64} << 20,
                     int64_t chunk_bytes = kChunkBytes);
  // An arena of the caller's memory: `bytes` from `base` rounded down to whole chunks. The caller keeps the memory
  // and must keep it until the pool is destroyed. Aborts unless base is kAlignment-aligned and bytes holds a chunk
  // (programming errors: the server sizes the arena from --kv_cache_mb, at least 2 MiB).
  BlockPool(char* base, int64_t bytes, int64_t chunk_bytes = kChunkBytes);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of `bytes` (1..chunk_bytes()) with one reference, its contents unspecified; nullptr when no chunk in use
  // has a free run that long and no chunk is free, or when the block would take the blocks' bytes and the reserved
  // bytes past the capacity.
  char* Allocate(int64_t bytes);
  // Adds a reference to a block that has one.
  void Ref(char* block);
  // Drops a reference; the last one frees the block (true), and the last block of a chunk frees the chunk.
  bool Unref(char* block);
  // Bytes of the capacity spent outside the blocks (the store's block tables, which live on the heap): blocks are
  // allocated only while used_bytes() + reserved_bytes() stays within the capacity. May be set past what is free;
  // Allocate then refuses until blocks are freed.
  void set_reserved_bytes(int64_t bytes) { reserved_bytes_ = bytes; }
  int64_t reserved_bytes() const { return reserved_bytes_; }

  // Compaction: what a chunk in use holds, and a block moved to another chunk, so that a chunk can be emptied for a
  // block that no free run fits. The caller moves only blocks nobody reads or writes meanwhile, and repoints every
  // reference to the block.
  struct ChunkUse {
    int64_t index = 0;
    int32_t used = 0;         // blocks allocated
    int64_t used_bytes = 0;   // their (rounded) sizes
    int64_t largest_free = 0; // its longest free run
  };
  std::vector<ChunkUse> ChunksInUse() const;
  // The blocks allocated in chunk `index`, largest first.
  std::vector<char*> BlocksIn(int64_t index) const;
  // Moves `block` (its bytes and references) into a free run of another chunk in use (the one whose longest run
  // fits it most tightly); returns its new address, or nullptr when no other chunk in use has a run that long. The
  // old block is freed (and its chunk, when it was the chunk's last).
  char* Relocate(char* block);
  int RefCount(const char* block) const;
  int64_t BlockBytes(const char* block) const;  // its (rounded) size

  int64_t capacity_bytes() const { return static_cast<int64_t>(chunks_.size()) * chunk_bytes_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }  // the largest block it holds
  // Whether the arena is the caller's memory (the second constructor) rather than the pool's own mapping.
  bool external_arena() const { return !owns_arena_; }
  int64_t used_bytes() const { return used_bytes_; }        // allocated blocks' (rounded) sizes
  int64_t chunks_in_use() const { return chunks_in_use_; }  // chunks holding at least one block
  int64_t shared_blocks() const { return shared_blocks_; }  // blocks with more than one reference
  // Whether the capacity has the bytes for a block of `bytes` beside the blocks and the reserved bytes (though
  // maybe in no run that long).
  bool HasBytesFor(int64_t bytes) const { return used_bytes_ + reserved_bytes_ + Rounded(bytes) <= capacity_bytes(); }
  // Whether Allocate(bytes) would succeed now.
  bool HasRoom(int64_t bytes) const;

 private:
  struct Block {
    int64_t bytes = 0;  // rounded
    int32_t refs = 0;
  };
  struct Chunk {
    std::map<int64_t, Block> blocks;   // by offset in the chunk
    std::map<int64_t, int64_t> runs;   // free runs, coalesced: offset -> length; empty while the chunk is not in use
    int64_t used_bytes = 0;
    int64_t largest = 0;               // its longest free run
  };
  static int64_t Rounded(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
  int64_t ChunkOf(const char* block) const { return (block - base_) / chunk_bytes_; }
  int64_t OffsetOf(const char* block) const { return (block - base_) % chunk_bytes_; }
  Block& BlockAt(const char* block) { return chunks_[ChunkOf(block)].blocks.at(OffsetOf(block)); }
  const Block& BlockAt(const char* block) const { return chunks_[ChunkOf(block)].blocks.at(OffsetOf(block)); }
  // The chunk in use, other than `except`, whose longest free run fits `size` most tightly; -1 when none.
  int64_t TightestChunk(int64_t size, int64_t except) const;
  // A free chunk (resident ones first) put in use as one free run; -1 when none is free.
  int64_t OpenChunk();
  // A block of `size` from chunk c's free run that fits it most tightly, with `refs` references; c has such a run.
  char* Carve(int64_t c, int64_t size, int32_t refs);
  // Returns the block's bytes to its chunk's free runs (the chunk is freed with its last block).
  void Release(char* block);
  void SetLargest(int64_t c, int64_t largest);

  char* base_ = nullptr;
  const bool owns_arena_;  // mmap'd by the pool: advised, given back and unmapped by it
  const int64_t chunk_bytes_;
  std::vector<Chunk> chunks_;
  std::vector<int64_t> free_chunks_;      // chunks holding no block, their pages given back
  std::vector<int64_t> resident_chunks_;  // chunks holding no block, their pages kept; taken first
  const int64_t keep_resident_;           // chunks resident_chunks_ may hold (all of them in a lent arena)
  std::set<std::pair<int64_t, int64_t>> by_largest_;  // (longest free run, chunk) of the chunks in use with one
  int64_t used_bytes_ = 0;
  int64_t reserved_bytes_ = 0;
  int64_t chunks_in_use_ = 0;
  int64_t shared_blocks_ = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_BLOCK_POOL_H_
