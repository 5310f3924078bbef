// The CPU backend's attention core: softmax(scale * Q K^T + mask) V for every (batch, head) of head-packed
// [B, T, H, d_k] tensors, on the tile kernels (tile_kernels.h).
//
// Work is one OpenMP region over items (batch, head, query block of kQueryBlock rows), ordered so that the items
// of one KV head follow each other and handed out in runs: a thread packs its KV head's K^T and V into panels in
// its own L2 once for all those items (every query head of the GQA group, every query block). Each item's queries
// go a panel of a few rows at a time from the score kernel through the softmax to the value kernel while the
// panel's scores are in L1, and the next item's rows are prefetched meanwhile:
//  - weights not requested: FlashAttention's online softmax over key blocks (the kernels' key_block), so memory is
//    O(T) per head;
//  - weights requested: the exact row softmax written in place in the returned [B, H, Tq, Tk] tensor, then P V.
// Key blocks that causal masking or key_lengths hide from every row of a panel are never computed. GQA/MQA point
// each query head at its shared KV head; nothing is repeated.
//
// Thread-safe: scratch belongs to the calling OpenMP threads. Parallel over the calling thread's OpenMP team
// (omp_set_num_threads on that thread sets its size).
#ifndef MHA_SERVER_BACKENDS_CPU_ATTENTION_CORE_H_
#define MHA_SERVER_BACKENDS_CPU_ATTENTION_CORE_H_

#include <cstdint>

#include "server/backends/backend.h"
#include "server/backends/cpu/scratch.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha::cpu {

// Query rows per work item.
inline constexpr int64_t kQueryBlock = 128;

// A head-packed tensor: batch b, token t, head h starts at element (b * T + t) * row_stride + h * d_k of `data`
// (fp32), or of `bf16` where that is set instead (for the bf16 tile sets only: their products round every operand
// to bf16, so bf16 projections and wire tensors are read as they are).
struct Packed {
  const float* data;
  int64_t row_stride;  // in elements
  const uint16_t* bf16 = nullptr;
};

// Where Attend writes its output: head-packed as Packed above, fp32 into `data` or bf16 (rounded to nearest even)
// into `bf16` where that is set instead (bf16 sets only).
struct PackedOut {
  float* data;
  int64_t row_stride;  // in elements
  uint16_t* bf16 = nullptr;
};

// Writes attention over q [B, Tq, H, d_k], k and v [B, Tk, Hkv, d_k] into out and, when weights is not null, the
// probabilities into weights [B, H, Tq, Tk]. `stop` (may be null) is polled
// before each work item; once it says stop, the remaining items are skipped and its status returned. Q, K and V are
// either all fp32 or all bf16, and bf16 (inputs or output) only with a bf16 set (tiles.elements_per_float == 2);
// else INVALID_ARGUMENT.
// When stats.softmax(), also writes each row's softmax statistics into stats' [B, H, Tq] arrays (not
// contribution), query i at position i + Tk - Tq + position_shift.
absl::Status Attend(const kernels::TileKernels& tiles, const AttentionShape& shape, const AttentionMask& mask,
                    Packed q, Packed k, Packed v, PackedOut out, float* weights, const StopSignal* stop,
                    const RowStats& stats = {}, int64_t position_shift = 0);

// Scratch a thread keeps for its next call, per buffer: the backend's projections (enough for B T = 4096 tokens
// of width 4096) and the attention core's packed K and V (Tk = 65536 keys at d_k = 64). Larger buffers are freed
// when their call ends, so that one large call does not keep the process's memory up for good; smaller ones are
// kept because allocating them per call showed in the profiles of small calls.
inline constexpr int64_t kKeptCallScratchBytes = int64_t{64} << 20;
inline constexpr int64_t kKeptTileScratchBytes = int64_t{16} << 20;

// Bytes of scratch each OpenMP thread of Attend keeps for this shape.
int64_t AttendScratchBytesPerThread(const kernels::TileKernels& tiles, const AttentionShape& shape);

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_ATTENTION_CORE_H_
