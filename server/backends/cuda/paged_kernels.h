// The CUDA backend's kernels for sessions (paged_kernels.cu): new tokens' keys and values written into their cache
// slots, and attention of the new tokens' queries over the cache's blocks in place, split over the keys
// (flash-decoding) and merged by the splits' log-sum-exp on the device.
//
// The cache layout is the sessions' one (backend.h's KvCacheLayout): per block and KV head, K transposed
// [head_dim][block_tokens] then V [block_tokens][head_dim]. A tile of 32 keys is then 32 consecutive slots of each
// of K's rows and 32 rows of V: both coalesced reads, so the GPU keeps the CPU's layout (one layout for every
// backend: the store and the CPU paths need no conversion).
//
// A work unit is one KV head of one sequence with up to PagedRowsPerUnit(head_dim) of its query rows (the query heads
// of the group times some of the new tokens): the unit reads each K/V tile of its key range once for all its rows,
// which is how GQA's query heads share one read of their KV head. Every pointer is device memory (the blocks:
// device-accessible memory, managed or staged). Not thread-safe per stream.
#ifndef MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_H_
#define MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mha {
namespace cuda {

// Keys per tile of the split kernel (one per lane).
inline constexpr int kPagedTileKeys = 32;

// The most query rows a unit computes: 16, or 8 at head_dim above 128 (the unit's shared memory stays under 48 KiB).
inline constexpr int PagedRowsPerUnit(int64_t head_dim) { return head_dim > 128 ? 8 : 16; }
// The most query rows a shared unit of the cascade kernel (tensor cores) stacks, and the keys per tile it reads.
inline constexpr int kCascadeRows = 64;
inline constexpr int kCascadeTileKeys = 64;

// One sequence of a paged call.
struct PagedSequenceDesc {
  int64_t block_offset = 0;    // index of its first block pointer in PagedParams::blocks
  int64_t length = 0;          // tokens cached before the call
  int64_t new_tokens = 0;      // n
  int64_t row = 0;             // its first row among the call's new-token rows (q, k, v, out)
  int64_t weights_offset = 0;  // element offset of its [H, n, keys] scores/weights in PagedParams::weights
  int32_t append = 1;          // 1: the new tokens join the cache (causal among them); 0: they see the cache alone
  // Keys [0, shared_keys) are its cascade group's common blocks, which shared units compute for every member (its
  // own units start there); 0: it is in no group.
  int64_t shared_keys = 0;
  // 1: a prefill chunk the dense path computes (LaunchPagedDenseInputs, then the tensor-core flash kernel): it has
  // no units, and the merge leaves its rows alone.
  int32_t dense = 0;
};

// A work unit: query heads [head0, head0 + heads) of KV head `kv_head` (all in its group) for new tokens
// [token0, token0 + tokens) of sequence `seq`; heads * tokens <= PagedRowsPerUnit. Row r of the unit is head
// head0 + r % heads of token token0 + r / heads.
// A shared unit (members > 0; cascade decode) stacks the rows of `members` sequences, PagedParams::cascade[member0
// ..], each with one new token: row r is head head0 + r % heads of sequence cascade[member0 + r / heads]'s token;
// members * heads <= PagedRowsPerUnit (kCascadeRows for the cascade kernel's). It reads keys [0, shared_keys) of its
// first member's blocks, which are every member's, once for all of them (FlashInfer's cascade attention), into their
// shared split slots.
struct PagedUnit {
  int32_t seq = 0, kv_head = 0, head0 = 0, heads = 0, token0 = 0, tokens = 0;
  int32_t members = 0, member0 = 0;
};

struct PagedParams {
  const PagedSequenceDesc* sequences = nullptr;  // [num_sequences]
  char* const* blocks = nullptr;                 // block pointers, each sequence's from its block_offset
  const PagedUnit* units = nullptr;              // [num_units]
  // The shared units' members (sequence indices); null without shared units. With them, each (row, head) has
  // splits + shared_splits slots in the scratch below: its own units' splits, then its shared units' splits.
  const int32_t* cascade = nullptr;
  int64_t num_sequences = 0, num_units = 0, rows = 0;  // rows: new tokens over all sequences
  // The last num_mma_units of `units` are shared units the cascade kernel (tensor cores) computes; the split kernel
  // computes the others.
  int64_t num_mma_units = 0;
  // The new tokens' rows in fp32: q [rows, q_stride] (head h at h * head_dim), k and v [rows, kv_stride] (KV head g at
  // g * head_dim), before RoPE.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t q_stride = 0, kv_stride = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, block_tokens = 0;
  int cache_dtype = 1;  // DeviceDType (kernels.h): kF32, kF16, kBF16, or the 8-bit kI8, kE4M3, kE5M2
  // 8-bit caches (quantized_cache.h's layout): bytes of one KV head's K part, and of its K and V parts together.
  int64_t key_part_bytes = 0, head_part_bytes = 0;
  float scale = 1.0f;
  // RoPE: sequence s's frequencies at rope + s * (rope_dim / 2 + 1) (rope_per_sequence), else one table at rope
  // for every sequence: rope_dim / 2 inv_freq then the attention factor (rope_frequencies.h, for a sequence of
  // length + new_tokens tokens: only dynamic and longrope depend on it).
  const double* rope = nullptr;  // null: no RoPE
  bool rope_per_sequence = false;
  int rope_dim = 0;
  bool rope_interleaved = false;
  // Splits of each unit's key range: split s covers keys [begin + s * split_keys, begin + (s + 1) * split_keys), begin
  // the sequence's shared_keys for its own units, else 0 (paged_plan.h chooses them: at least kMinSplitKeys keys
  // each, enough to fill the GPU).
  int splits = 1;
  int64_t split_keys = 0;  // a multiple of kPagedTileKeys
  // The shared units' splits of [0, shared_keys): split s covers [s * shared_split_keys, (s + 1) *
  // shared_split_keys). The split kernel's shared units use splits and split_keys (the planner sets these equal).
  int shared_splits = 0;
  int64_t shared_split_keys = 0;  // a multiple of kPagedTileKeys (of kCascadeTileKeys for the cascade kernel)
  // Scratch: per (row, head, split) the unnormalised output [head_dim] and the softmax state
  // (max, sum, sum w (s - max), sum w |pos - j|, sink sum).
  float* partial_out = nullptr;    // [rows, heads, slots, head_dim], slots = splits (+ shared_splits with `cascade`)
  float* partial_state = nullptr;  // [rows, heads, slots, 5]
  // Outputs.
  float* out = nullptr;  // [rows, heads, head_dim] fp32
  // Scaled scores, then (after the merge) weights, fp32: sequence s's [heads, n, keys] at its weights_offset, keys =
  // length + n (append) or length. Null when not asked for.
  float* weights = nullptr;
  // Softmax statistics [heads, n] per sequence at heads * its row, each null when not asked for (RowStats' rules).
  float* lse = nullptr;
  float* entropy = nullptr;
  float* confidence = nullptr;
  float* distance = nullptr;
  float* sink = nullptr;
  int64_t sink_tokens = 4;
};

// Writes every appending sequence's new keys (after RoPE at positions length..length+n-1) and values into their cache
// slots, rounded to the cache's dtype.
cudaError_t LaunchPagedAppend(const PagedParams& p, cudaStream_t stream);

// softmax(q k^T scale) v of every new token over its visible keys, read from the blocks in place: the split kernel
// on a grid of (num_units - num_mma_units, splits), the cascade kernel on (num_mma_units, shared_splits), then the
// merge of the splits into out, the statistics and the weights. Run after LaunchPagedAppend on the same stream (new
// tokens see each other through the cache). Dense sequences' rows are left alone.
cudaError_t LaunchPagedAttention(const PagedParams& p, cudaStream_t stream);

// The dtype the dense path computes in for a cache of `cache_dtype`: the cache's own 16-bit dtype, or bf16 for an
// 8-bit cache (its codes times their scales need more than fp16's range would safely hold).
int PagedDenseDtype(int cache_dtype);

// The dense path's inputs for sequence `seq` (a 16-bit or 8-bit cache), whose new_tokens and visible keys (length +
// new_tokens with append, else length) the host passes: its new queries after RoPE, rounded to PagedDenseDtype, into
// q [new_tokens, heads, head_dim], and its keys' K and V gathered from the blocks (an 8-bit cache's dequantized,
// rounded to bf16) into k and v [keys, kv_heads, head_dim]. Run after LaunchPagedAppend.
cudaError_t LaunchPagedDenseInputs(const PagedParams& p, int64_t seq, int64_t new_tokens, int64_t keys, void* q,
                                   void* k, void* v, cudaStream_t stream);

}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_H_
