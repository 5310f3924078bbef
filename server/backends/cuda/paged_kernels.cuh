// The sessions' kernels as device code (paged_kernels.h says what they compute): the append of new keys and values
// into their cache slots, the split kernel that attends over a key range of the blocks, and the merge of the splits.
// Included by paged_kernels.cu, which launches them, and compiled for the host by tests/emulated_cuda.
//
// The split kernel keeps FlashAttention's online softmax per query row (running max m and sum l, fp32, natural
// units) and, when statistics are asked for, the CPU's three accumulators beside them (row_stats.h's RowSums):
// A = sum w (s - m), D = sum w |pos - j| and the sink keys' w, rescaled with l when m moves. The merge combines the
// splits' states by the same rule, so a split row and an unsplit one have the same statistics.
#ifndef MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_CUH_
#define MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "server/backends/cuda/attention_kernels.cuh"
#include "server/backends/cuda/paged_kernels.h"
#include "server/backends/cuda/paged_quant.cuh"

namespace mha {
namespace cuda {
namespace device {

inline constexpr int kPagedWarps = 4;
inline constexpr int kPagedThreads = 32 * kPagedWarps;
inline constexpr int kPagedStateFields = 5;  // m, l, A, D, sink (paged_kernels.h's partial_state)

// The sequence that row `row` of the call belongs to: sequences are in row order.
__device__ __forceinline__ int64_t SequenceOfRow(const PagedParams& p, int64_t row) {
  int64_t lo = 0, hi = p.num_sequences - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.sequences[mid].row <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Element d of head row x after RoPE at `position` for sequence `seq` (x itself without RoPE or past rope_dim): the
// rotation of pair i by position * inv_freq[i] (PagedParams::rope, the sequence's table or the call's one), the
// angle in double as the host backends compute it, the product in fp32 with cos and sin times the attention factor.
__device__ __forceinline__ float RopedValue(const float* x, int64_t d, int64_t position, int64_t seq,
                                            const PagedParams& p) {
  if (p.rope == nullptr || d >= p.rope_dim) return x[d];
  const int64_t half = p.rope_dim / 2;
  int64_t i, a, b;
  bool first;
  if (p.rope_interleaved) {
    i = d / 2;
    a = 2 * i;
    b = a + 1;
    first = d % 2 == 0;
  } else {
    first = d < half;
    i = first ? d : d - half;
    a = i;
    b = i + half;
  }
  const double* frequencies = p.rope + (p.rope_per_sequence ? seq : 0) * (half + 1);
  const double angle = static_cast<double>(position) * frequencies[i];
  const float c = static_cast<float>(cos(angle) * frequencies[half]);
  const float s = static_cast<float>(sin(angle) * frequencies[half]);
  return first ? x[a] * c - x[b] * s : x[b] * c + x[a] * s;
}

// Keys new token `token` of `seq` sees.
__device__ __forceinline__ int64_t PagedVisibleEnd(const PagedSequenceDesc& seq, int64_t token) {
  return seq.append ? seq.length + token + 1 : seq.length;
}

// One block per new row (grid.x) and KV head (grid.y): its key after RoPE and its value into their slot.
template <typename CacheT>
__global__ void __launch_bounds__(kPagedThreads) PagedAppendKernel(PagedParams p) {
  const int64_t row = blockIdx.x, g = blockIdx.y;
  const int64_t seq_index = SequenceOfRow(p, row);
  const PagedSequenceDesc seq = p.sequences[seq_index];
  if (!seq.append) return;
  const int64_t dk = p.head_dim, bt = p.block_tokens, position = seq.length + (row - seq.row);
  CacheT* block = reinterpret_cast<CacheT*>(p.blocks[seq.block_offset + position / bt]);
  CacheT* key = block + g * 2 * dk * bt + position % bt;                // K^T column: stride bt
  CacheT* value = block + g * 2 * dk * bt + dk * bt + position % bt * dk;  // V row
  const float* k = p.k + row * p.kv_stride + g * dk;
  const float* v = p.v + row * p.kv_stride + g * dk;
  for (int64_t d = threadIdx.x; d < dk; d += kPagedThreads) {
    key[d * bt] = FromFloat<CacheT>(RopedValue(k, d, position, seq_index, p));
    value[d] = FromFloat<CacheT>(v[d]);
  }
}

// An 8-bit cache's append: one block per appending sequence (grid.x) and KV head (grid.y), going through the blocks
// its new tokens land in, each block's tokens in one write as every backend writes them (quant::WriteTokens): the
// threads take the key channels (each channel's scale is the block's, grown by its new keys after RoPE), then the
// new tokens' value rows (a scale per token).
template <int kDtype>
__global__ void __launch_bounds__(kPagedThreads) PagedQuantAppendKernel(PagedParams p) {
  const int64_t seq_index = blockIdx.x, g = blockIdx.y;
  const PagedSequenceDesc seq = p.sequences[seq_index];
  if (!seq.append) return;
  const int64_t dk = p.head_dim, bt = p.block_tokens, depth = (dk + 1) / 2 * 2, last = seq.length + seq.new_tokens;
  for (int64_t t0 = seq.length; t0 < last;) {
    const int64_t t1 = last < (t0 / bt + 1) * bt ? last : (t0 / bt + 1) * bt;
    uint8_t* key_part = reinterpret_cast<uint8_t*>(p.blocks[seq.block_offset + t0 / bt]) + g * p.head_part_bytes;
    const int64_t row0 = seq.row + (t0 - seq.length);
    for (int64_t c = threadIdx.x; c < depth; c += kPagedThreads) {
      const auto key = [&](int64_t i) {
        return RopedValue(p.k + (row0 + i) * p.kv_stride + g * dk, c, t0 + i, seq_index, p);
      };
      WriteKeyChannel<kDtype>(key_part, c, dk, bt, t0 % bt, t1 - t0, key);
    }
    for (int64_t i = threadIdx.x; i < t1 - t0; i += kPagedThreads) {
      WriteValueRow<kDtype>(key_part + p.key_part_bytes, t0 % bt + i, dk, bt, p.v + (row0 + i) * p.kv_stride + g * dk);
    }
    t0 = t1;
  }
}

// 16 bytes of cache elements (aligned) as floats.
template <typename CacheT>
__device__ __forceinline__ void LoadVector(const CacheT* src, float* dst) {
  constexpr int kVec = 16 / sizeof(CacheT);
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const CacheT* values = reinterpret_cast<const CacheT*>(&raw);
  for (int e = 0; e < kVec; ++e) dst[e] = ToFloat(values[e]);
}

// One tile of kPagedTileKeys keys from t0 (keys at or past `end` read as 0) of one KV head into shared memory as
// fp32: K^T [kDim][kTile + 1] (`key` = true) or V [kTile][kDim]. When block_tokens is a multiple of the tile and
// head_dim of the 16-byte vector, the tile lies in one block: K's rows are runs of kTile slots and V's rows one run
// of kTile * head_dim elements, read 16 bytes at a time; otherwise element by element through the block table.
template <typename CacheT, int kDim, bool kKey>
__device__ __forceinline__ void LoadTile(const PagedParams& p, char* const* blocks, int64_t base, int64_t t0,
                                         int64_t end, float* tile) {
  constexpr int kTile = kPagedTileKeys, kVec = 16 / sizeof(CacheT);
  const int64_t dk = p.head_dim, bt = p.block_tokens;
  if (bt % kTile == 0 && dk % kVec == 0) {
    const CacheT* block = reinterpret_cast<const CacheT*>(blocks[t0 / bt]) + base;
    const int64_t slot0 = t0 % bt;
    float v[kVec];
    if (kKey) {
      constexpr int kPerRow = kTile / kVec;
      for (int idx = threadIdx.x; idx < dk * kPerRow; idx += kPagedThreads) {
        const int64_t d = idx / kPerRow, jj = idx % kPerRow * kVec;
        LoadVector(block + d * bt + slot0 + jj, v);
        for (int e = 0; e < kVec; ++e) tile[d * (kTile + 1) + jj + e] = v[e];
      }
    } else {
      for (int idx = threadIdx.x; idx < kTile * dk / kVec; idx += kPagedThreads) {
        const int64_t e0 = static_cast<int64_t>(idx) * kVec, jj = e0 / dk, d = e0 % dk;
        LoadVector(block + slot0 * dk + e0, v);
        const bool inside = t0 + jj < end;  // slots past the cache may hold anything, NaN included
        for (int e = 0; e < kVec; ++e) tile[jj * kDim + d + e] = inside ? v[e] : 0.0f;
      }
    }
    return;
  }
  for (int idx = threadIdx.x; idx < dk * kTile; idx += kPagedThreads) {
    const int64_t a = idx / (kKey ? kTile : dk), b = idx % (kKey ? kTile : dk);  // K: (d, jj); V: (jj, d)
    const int64_t jj = kKey ? b : a, d = kKey ? a : b, j = t0 + jj;
    float value = 0;
    if (j < end) {
      const CacheT* block = reinterpret_cast<const CacheT*>(blocks[j / bt]) + base;
      value = ToFloat(kKey ? block[d * bt + j % bt] : block[j % bt * dk + d]);
    }
    tile[kKey ? d * (kTile + 1) + jj : jj * kDim + d] = value;
  }
}

// LoadTile for the split kernel's cache type: elements, or an 8-bit cache's codes times their scales.
template <typename CacheT, int kDim, bool kKey>
__device__ __forceinline__ void LoadAnyTile(const PagedParams& p, char* const* blocks, int64_t base, int64_t t0,
                                            int64_t end, float* tile) {
  if constexpr (IsCode8<CacheT>::value) {
    LoadCodeTile<CacheT::kCacheDtype, kDim, kKey>(p, blocks, base, t0, end, tile);
  } else {
    LoadTile<CacheT, kDim, kKey>(p, blocks, base, t0, end, tile);
  }
}

// The softmax state of one query row in a split: this lane's part of the output and the row's sums (equal on every
// lane of the warp).
template <int kChunks>
struct RowState {
  float m = -INFINITY, l = 0, a = 0, dist = 0, sink = 0;
  float acc[kChunks] = {};
};

// Adds one tile's scores (this lane's key j, -inf when hidden) to `state`; returns this lane's weight exp(s - m) in
// the updated state's units (0 for a hidden key), or -1 when no key of the row was visible yet.
template <int kChunks>
__device__ __forceinline__ float UpdateRow(RowState<kChunks>& st, float score, int64_t j, int64_t position,
                                           bool stats, int64_t sink_tokens) {
  const float m_new = fmaxf(st.m, WarpMax(score));
  if (m_new == -INFINITY) return -1.0f;
  const float alpha = expf(st.m - m_new);  // 0 while m was -inf
  const bool visible = score != -INFINITY;
  const float w = visible ? expf(score - m_new) : 0.0f;
  if (stats) {
    const float kept = st.l > 0 ? alpha * (st.a + st.l * (st.m - m_new)) : 0.0f;
    st.a = kept + WarpSum(visible ? w * (score - m_new) : 0.0f);
    st.dist = alpha * st.dist + WarpSum(w * fabsf(static_cast<float>(position - j)));
    st.sink = alpha * st.sink + WarpSum(j < sink_tokens ? w : 0.0f);
  }
  st.l = alpha * st.l + WarpSum(w);
  for (int c = 0; c < kChunks; ++c) st.acc[c] *= alpha;
  st.m = m_new;
  return w;
}

// Scratch slots per (row, head): the splits, then the shared splits with shared units (paged_kernels.h's
// partial_out).
__device__ __forceinline__ int64_t PagedSlots(const PagedParams& p) {
  return p.cascade != nullptr ? p.splits + p.shared_splits : p.splits;
}

// Who row r of a unit is: its sequence's index and the fields of its PagedSequenceDesc the kernel reads, its new
// token and query head. Plain fields (no initializers): the kernel keeps its rows' in shared memory.
struct UnitRow {
  int64_t length, new_tokens, row, weights_offset;
  int32_t append, seq_index, token, head;

  __device__ __forceinline__ int64_t Position() const { return length + token; }
  __device__ __forceinline__ int64_t VisibleEnd() const { return append ? length + token + 1 : length; }
  __device__ __forceinline__ int64_t Keys() const { return append ? length + new_tokens : length; }
};

__device__ __forceinline__ int UnitRows(const PagedUnit& u) {
  return u.members > 0 ? u.members * u.heads : u.heads * u.tokens;
}

__device__ __forceinline__ UnitRow RowOfUnit(const PagedParams& p, const PagedUnit& u, int r) {
  UnitRow row;
  row.seq_index = u.members > 0 ? p.cascade[u.member0 + r / u.heads] : u.seq;
  row.token = u.members > 0 ? 0 : u.token0 + r / u.heads;
  row.head = u.head0 + r % u.heads;
  const PagedSequenceDesc& seq = p.sequences[row.seq_index];
  row.length = seq.length;
  row.new_tokens = seq.new_tokens;
  row.row = seq.row;
  row.weights_offset = seq.weights_offset;
  row.append = seq.append;
  return row;
}

// The unit's query rows into q_shared, rotated at each token's position; zeros past the rows and head_dim.
template <int kRows, int kDim>
__device__ __forceinline__ void LoadUnitQueries(const PagedParams& p, int rows, const UnitRow* unit_rows,
                                                float (*q_shared)[kDim]) {
  const int64_t dk = p.head_dim;
  for (int idx = threadIdx.x; idx < kRows * kDim; idx += kPagedThreads) {
    const int r = idx / kDim, d = idx % kDim;
    float value = 0;
    if (r < rows && d < dk) {
      const UnitRow& row = unit_rows[r];
      value = RopedValue(p.q + (row.row + row.token) * p.q_stride + row.head * dk, d, row.Position(), row.seq_index, p);
    }
    q_shared[r][d] = value;
  }
}

// One row's result of a split, for the merge: this lane's part of its output, and (lane 0) its softmax state, in
// slot `slot` of the row's.
template <int kChunks>
__device__ __forceinline__ void WriteSplitRow(const PagedParams& p, const UnitRow& row, int64_t split_slot,
                                              const RowState<kChunks>& state, int lane) {
  const int64_t dk = p.head_dim;
  const int64_t slot = ((row.row + row.token) * p.heads + row.head) * PagedSlots(p) + split_slot;
  for (int c = 0; c < kChunks; ++c) {
    if (lane + 32 * c < dk) p.partial_out[slot * dk + lane + 32 * c] = state.acc[c];
  }
  if (lane == 0) {
    float* s = p.partial_state + slot * kPagedStateFields;
    s[0] = state.m;
    s[1] = state.l;
    s[2] = state.a;
    s[3] = state.dist;
    s[4] = state.sink;
  }
}

// Split kernel: grid (units, splits), kPagedThreads threads. Warp w computes the unit's rows w, w + 4, ...; each K
// tile and V tile of 32 keys is read from the blocks once into shared memory (fp32) for all of them.
template <typename CacheT, int kChunks>
__global__ void __launch_bounds__(kPagedThreads, 5) PagedSplitKernel(PagedParams p) {
  constexpr int kRows = kChunks > 4 ? 8 : 16;  // PagedRowsPerUnit
  constexpr int kRowsPerWarp = kRows / kPagedWarps;
  constexpr int kDim = kChunks * 32;
  constexpr int kTile = kPagedTileKeys;
  __shared__ float q_shared[kRows][kDim];
  // K^T [kDim][kTile + 1] (padded against bank conflicts) and V [kTile][kDim]: both tiles are loaded together (twice
  // the bytes in flight per block) up to head_dim 128; above it V takes K's room after the scores (48 KiB of static
  // shared memory).
  constexpr bool kBothTiles = kChunks <= 4;
  __shared__ float tile[kDim * (kTile + 1)];
  __shared__ float v_room[kBothTiles ? kTile * kDim : 1];
  float* const v_tile = kBothTiles ? v_room : tile;
  __shared__ float w_shared[kRows][kTile];
  __shared__ UnitRow unit_rows[kRows];
  const PagedUnit u = p.units[blockIdx.x];
  const int64_t split = blockIdx.y;
  const int64_t dk = p.head_dim, bt = p.block_tokens;
  const int rows = UnitRows(u);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (static_cast<int>(threadIdx.x) < rows) unit_rows[threadIdx.x] = RowOfUnit(p, u, static_cast<int>(threadIdx.x));
  // KV head g's K and V within each block: elements of CacheT, or bytes of an 8-bit cache's parts.
  const int64_t key_base = IsCode8<CacheT>::value ? u.kv_head * p.head_part_bytes : u.kv_head * 2 * dk * bt;
  const int64_t value_base = key_base + (IsCode8<CacheT>::value ? p.key_part_bytes : dk * bt);
  // Keys: a shared unit's [0, shared_keys) of its first member's blocks (every member's), into the rows' second
  // set of slots; a sequence's unit from its shared keys on.
  const bool shared_unit = u.members > 0;
  const PagedSequenceDesc lead = p.sequences[shared_unit ? p.cascade[u.member0] : u.seq];
  char* const* blocks = p.blocks + lead.block_offset;
  const int64_t unit_begin = shared_unit ? 0 : lead.shared_keys;
  const int64_t unit_end = shared_unit ? lead.shared_keys : PagedVisibleEnd(lead, u.token0 + u.tokens - 1);
  const int64_t begin = unit_begin + split * p.split_keys;
  const int64_t end = unit_end < begin + p.split_keys ? unit_end : begin + p.split_keys;
  const bool stats = p.lse != nullptr || p.entropy != nullptr;
  RowState<kChunks> state[kRowsPerWarp];
  __syncthreads();  // unit_rows
  LoadUnitQueries<kRows, kDim>(p, rows, unit_rows, q_shared);

  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    __syncthreads();  // the previous tile's V (and, the first time, q_shared) is no longer read / now written
    LoadAnyTile<CacheT, kDim, true>(p, blocks, key_base, t0, end, tile);
    if (kBothTiles) LoadAnyTile<CacheT, kDim, false>(p, blocks, value_base, t0, end, v_tile);
    __syncthreads();
    const int64_t j = t0 + lane;
    float score[kRowsPerWarp];
    #pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp + rr * kPagedWarps;
      score[rr] = -INFINITY;
      if (r >= rows) continue;
      float dot = 0;
      for (int64_t d = 0; d < dk; ++d) dot += q_shared[r][d] * tile[d * (kTile + 1) + lane];
      if (j < end && j < unit_rows[r].VisibleEnd()) score[rr] = dot * p.scale;
    }
    if (!kBothTiles) {
      __syncthreads();  // every warp has read the K tile
      LoadAnyTile<CacheT, kDim, false>(p, blocks, value_base, t0, end, v_tile);
      __syncthreads();
    }
    #pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp + rr * kPagedWarps;
      if (r >= rows) continue;
      const UnitRow& row = unit_rows[r];
      const float w = UpdateRow(state[rr], score[rr], j, row.Position(), stats, p.sink_tokens);
      if (w < 0) continue;  // nothing visible to this row yet (the whole warp agrees)
      if (p.weights != nullptr && score[rr] != -INFINITY) {
        p.weights[row.weights_offset + (row.head * row.new_tokens + row.token) * row.Keys() + j] = score[rr];
      }
      w_shared[r][lane] = w;
      __syncwarp();
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float sum = 0;
        for (int jj = 0; jj < kTile; ++jj) sum += w_shared[r][jj] * v_tile[jj * kDim + lane + 32 * c];
        state[rr].acc[c] += sum;
      }
      __syncwarp();
    }
  }

  #pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = warp + rr * kPagedWarps;
    if (r < rows) WriteSplitRow(p, unit_rows[r], (shared_unit ? p.splits : 0) + split, state[rr], lane);
  }
}

// Merge: one warp per (row, head), kPagedWarps of them per block. Combines the splits' states into the row's
// output, statistics and weights.
__global__ void __launch_bounds__(kPagedThreads) PagedMergeKernel(PagedParams p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kPagedWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= p.rows * p.heads) return;
  const int64_t row = item / p.heads, head = item % p.heads;
  const PagedSequenceDesc seq = p.sequences[SequenceOfRow(p, row)];
  if (seq.dense) return;  // the dense path writes its rows
  const int64_t token = row - seq.row, dk = p.head_dim;
  // Its own units' splits, then its shared units' when it is in a cascade group.
  const int64_t stride = PagedSlots(p), slots = seq.shared_keys > 0 ? stride : p.splits;
  const float* state = p.partial_state + item * stride * kPagedStateFields;
  float m = -INFINITY;
  for (int s = 0; s < slots; ++s) m = fmaxf(m, state[s * kPagedStateFields]);
  float l = 0, a = 0, dist = 0, sink = 0;
  if (m != -INFINITY) {
    for (int s = 0; s < slots; ++s) {
      const float* st = state + s * kPagedStateFields;
      if (!(st[1] > 0) && !std::isnan(st[1])) continue;  // an empty split
      const float f = expf(st[0] - m);
      l += f * st[1];
      a += f * (st[2] + st[1] * (st[0] - m));
      dist += f * st[3];
      sink += f * st[4];
    }
  }
  const float inverse = l > 0 ? 1.0f / l : 0.0f;
  for (int64_t d = lane; d < dk; d += 32) {
    float sum = 0;
    for (int s = 0; s < slots; ++s) {
      const float ms = state[s * kPagedStateFields];
      if (ms == -INFINITY) continue;
      sum += expf(ms - m) * p.partial_out[(item * stride + s) * dk + d];
    }
    p.out[item * dk + d] = std::isnan(l) ? l : sum * inverse;
  }
  const int64_t at = p.heads * seq.row + head * seq.new_tokens + token;  // [H, n] of the sequence
  if (lane == 0 && (p.lse != nullptr || p.entropy != nullptr)) {
    const bool none = l == 0;
    const float log_l = logf(l);
    if (p.lse != nullptr) p.lse[at] = none ? -INFINITY : m + log_l;
    if (p.entropy != nullptr) {
      p.entropy[at] = none ? 0.0f : log_l - a * inverse;
      p.confidence[at] = none ? 0.0f : inverse;
      p.distance[at] = none ? 0.0f : dist * inverse;
      p.sink[at] = none ? 0.0f : sink * inverse;
    }
  }
  if (p.weights != nullptr) {
    const int64_t keys = seq.append ? seq.length + seq.new_tokens : seq.length;
    const int64_t visible = PagedVisibleEnd(seq, token);
    float* w = p.weights + seq.weights_offset + (head * seq.new_tokens + token) * keys;
    for (int64_t j = lane; j < keys; j += 32) {
      w[j] = j < visible && l > 0 ? expf(w[j] - m) * inverse : (std::isnan(l) ? l : 0.0f);
    }
  }
}

// The dense path's queries (LaunchPagedDenseInputs): element e of sequence `s`'s q [n, heads, head_dim] in T.
template <typename T>
__global__ void PagedDenseQueryKernel(PagedParams p, int64_t s, T* q) {
  const PagedSequenceDesc seq = p.sequences[s];
  const int64_t dk = p.head_dim, total = seq.new_tokens * p.heads * dk;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = e / (p.heads * dk), head = e / dk % p.heads, d = e % dk;
    q[e] = FromFloat<T>(RopedValue(p.q + (seq.row + token) * p.q_stride + head * dk, d, seq.length + token, s, p));
  }
}

// Channel d of key j's K (kKey) or V of KV head g, from a sequence's block table `blocks`, as float: the cache's
// element, or an 8-bit cache's (Code8) code times its scale.
template <typename CacheT, bool kKey>
__device__ __forceinline__ float CachedAt(const PagedParams& p, char* const* blocks, int64_t g, int64_t j, int64_t d) {
  const int64_t dk = p.head_dim, bt = p.block_tokens, slot = j % bt;
  const char* block = blocks[j / bt];
  if constexpr (IsCode8<CacheT>::value) {
    constexpr int kDtype = CacheT::kCacheDtype;
    const uint8_t* key_part = reinterpret_cast<const uint8_t*>(block) + g * p.head_part_bytes;
    if constexpr (kKey) {
      return DecodeCode<kDtype>(key_part[KeyCodeAt<kDtype>(d, slot, bt)]) *
             ScaleOf(LoadScaleBits(key_part + KeyScaleAt(d, dk, bt)));
    }
    const uint8_t* value_part = key_part + p.key_part_bytes;
    return DecodeCode<kDtype>(value_part[ValueCodeAt<kDtype>(slot, d, dk)]) *
           ScaleOf(LoadScaleBits(value_part + ValueScaleAt(slot, dk, bt)));
  } else {
    const CacheT* head = reinterpret_cast<const CacheT*>(block) + g * 2 * dk * bt;
    return ToFloat(kKey ? head[d * bt + slot] : head[dk * bt + slot * dk + d]);
  }
}

// The dense path's keys and values: element e of sequence `s`'s k and v [keys, kv_heads, head_dim] in T, copied
// from its blocks (CacheT is T: exact through float), or an 8-bit cache's (Code8) codes times their scales, rounded
// to T.
template <typename CacheT, typename T>
__global__ void PagedDenseGatherKernel(PagedParams p, int64_t s, int64_t keys, T* k, T* v) {
  const PagedSequenceDesc seq = p.sequences[s];
  const int64_t dk = p.head_dim, total = keys * p.kv_heads * dk;
  char* const* blocks = p.blocks + seq.block_offset;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / (p.kv_heads * dk), g = e / dk % p.kv_heads, d = e % dk;
    k[e] = FromFloat<T>(CachedAt<CacheT, true>(p, blocks, g, j, d));
    v[e] = FromFloat<T>(CachedAt<CacheT, false>(p, blocks, g, j, d));
  }
}

// The split kernel for the cache dtype and head_dim (head_dim <= 256).
template <typename CacheT>
void (*SplitKernelFor(int64_t head_dim))(PagedParams) {
  const int64_t chunks = (head_dim + 31) / 32;
  if (chunks <= 1) return &PagedSplitKernel<CacheT, 1>;
  if (chunks <= 2) return &PagedSplitKernel<CacheT, 2>;
  if (chunks <= 4) return &PagedSplitKernel<CacheT, 4>;
  if (chunks <= 8) return &PagedSplitKernel<CacheT, 8>;
  return nullptr;
}

}  // namespace device
}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_PAGED_KERNELS_CUH_
