// The cascade kernel (paged_kernels.h's PagedParams::num_mma_units): shared units of up to kCascadeRows query rows,
// the decoding rows of a cascade group's members stacked for one KV head, read the group's shared blocks once per
// unit on tensor cores (FlashInfer's cascade attention, whose shared part is a prefill kernel for the same reason:
// one tile read feeds many rows only where the products are cheap). Included by paged_kernels.cu; compiled for the
// host by tests/emulated_cuda.
//
// A block of kCascadeWarps warps owns a unit and one split of its shared keys: each warp holds 16 of the stacked
// rows of Q (rotated at each member's position, rounded to T) as mma.sync A fragments, as the tensor-core flash kernel
// does (attention_kernels.cuh), and streams 64-key tiles of K and V from the blocks through shared memory. K keeps
// the cache's transposed layout there ([head_dim][keys]): a transposed ldmatrix reads it as the B fragments of S =
// Q K^T. Every row sees every shared key (they precede all members' new tokens); the split's output and softmax
// state (with the statistics' sums when asked for) go to the rows' shared split slots, for the merge. No weights
// (paged_plan.h's CascadeOnTensorCores leaves those calls on the split kernel's shared units).
#ifndef MHA_SERVER_BACKENDS_CUDA_PAGED_CASCADE_CUH_
#define MHA_SERVER_BACKENDS_CUDA_PAGED_CASCADE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "server/backends/cuda/attention_kernels.cuh"
#include "server/backends/cuda/paged_kernels.cuh"
#include "server/backends/cuda/paged_kernels.h"

namespace mha {
namespace cuda {
namespace device {

// A call rather than inlined code on the GPU: RopedValue's double-precision sine and cosine have a slow path that
// is a call, around which the inlined kernel spilled registers (ptxas, head_dim 64).
#ifdef MHA_CUDA_EMULATION
#define MHA_CASCADE_NOINLINE
#else
#define MHA_CASCADE_NOINLINE __noinline__
#endif

inline constexpr int kCascadeWarps = kCascadeRows / 16;
inline constexpr int kCascadeThreads = 32 * kCascadeWarps;

// Keys [t0, t0 + kCascadeTileKeys) of KV head g (zeros at or past `end`) into the tiles, in T: K^T as k_shared
// [kD][kRowK], V as v_shared [kCascadeTileKeys][kRowV]. A 16-bit cache (CacheT is T) whose blocks hold whole
// 16-byte runs of 8 keys (block_tokens a multiple of 8; `end`, a block boundary or a split's, then is one too) is
// copied 16 bytes at a time; otherwise element by element through CachedAt (an 8-bit cache's codes times their
// scales, rounded to T).
template <typename T, typename CacheT, int kD, int kRowK, int kRowV>
__device__ __forceinline__ void LoadCascadeTiles(const PagedParams& p, char* const* blocks, int64_t g, int64_t t0,
                                                 int64_t end, T* k_shared, T* v_shared) {
  constexpr int kN = kCascadeTileKeys;
  const int64_t bt = p.block_tokens;
  if constexpr (!IsCode8<CacheT>::value) {
    if (bt % 8 == 0) {
      const int64_t base = g * 2 * kD * bt;
      for (int idx = threadIdx.x; idx < kD * (kN / 8); idx += kCascadeThreads) {
        const int d = idx / (kN / 8), jj = idx % (kN / 8) * 8;
        const int64_t j = t0 + jj;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (j < end) {
          x = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(blocks[j / bt]) + base + d * bt + j % bt);
        }
        *reinterpret_cast<uint4*>(k_shared + d * kRowK + jj) = x;
      }
      for (int idx = threadIdx.x; idx < kN * (kD / 8); idx += kCascadeThreads) {
        const int jj = idx / (kD / 8), c = idx % (kD / 8) * 8;
        const int64_t j = t0 + jj;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (j < end) {
          x = *reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(blocks[j / bt]) + base + kD * bt +
                                              j % bt * kD + c);
        }
        *reinterpret_cast<uint4*>(v_shared + jj * kRowV + c) = x;
      }
      return;
    }
  }
  for (int idx = threadIdx.x; idx < kD * kN; idx += kCascadeThreads) {
    const int d = idx / kN, jj = idx % kN;  // K^T's element (d, jj)
    k_shared[d * kRowK + jj] = FromFloat<T>(t0 + jj < end ? CachedAt<CacheT, true>(p, blocks, g, t0 + jj, d) : 0.0f);
    const int vj = idx / kD, vd = idx % kD;  // V's element (vj, vd)
    v_shared[vj * kRowV + vd] =
        FromFloat<T>(t0 + vj < end ? CachedAt<CacheT, false>(p, blocks, g, t0 + vj, vd) : 0.0f);
  }
}

// The unit's rows of Q, rotated at each member's position and rounded to T, into `staging` [kCascadeRows][kRow];
// zeros past the unit's rows.
template <typename T, int kD, int kRow>
__device__ MHA_CASCADE_NOINLINE void StageCascadeQueries(const PagedParams& p, int rows, const UnitRow* unit_rows,
                                                             T* staging) {
  for (int idx = threadIdx.x; idx < kCascadeRows * kD; idx += kCascadeThreads) {
    const int r = idx / kD, d = idx % kD;
    float value = 0.0f;
    if (r < rows) {
      const UnitRow& row = unit_rows[r];
      value = RopedValue(p.q + (row.row + row.token) * p.q_stride + row.head * kD, d, row.Position(), row.seq_index, p);
    }
    staging[r * kRow + d] = FromFloat<T>(value);
  }
}

// The online softmax of this thread's two rows of the accumulator layout (rows g and g + 8): the running max m (log2
// domain) and this thread's share of the sum l; with kStats, its shares of the statistics' sums as the split kernel
// keeps them (RowState): A = sum w (s - m) in natural units, D = sum w |position - j| and the sink keys' w.
template <bool kStats>
struct CascadeRows {
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float a[2] = {0.0f, 0.0f}, dist[2] = {0.0f, 0.0f}, sink[2] = {0.0f, 0.0f};
  int64_t position[2] = {0, 0};  // the rows' query positions (kStats)
};

// S's scores (this thread's two rows, keys key0 + nb * 8 + 2t (+1)) scaled into the log2 domain, keys at or past
// `end` hidden; then the online softmax: the rows' state moves to the tile's max, s becomes the weights exp2(s - m),
// and `correction` is what the rows' earlier output must be multiplied by.
template <int kN, bool kStats>
__device__ __forceinline__ void CascadeSoftmax(float (&s)[kN / 8][4], int64_t key0, int64_t end, float score_scale,
                                               int t, int64_t sink_tokens, CascadeRows<kStats>& st,
                                               float (&correction)[2]) {
  float tile_max[2] = {-INFINITY, -INFINITY};
  #pragma unroll
  for (int nb = 0; nb < kN / 8; ++nb) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t j = key0 + nb * 8 + 2 * t + (e & 1);
      s[nb][e] = j < end ? s[nb][e] * score_scale : -INFINITY;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nb][e]);
    }
  }
  float base[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(st.m[r], QuadMax(tile_max[r]));
    base[r] = m_new == -INFINITY ? 0.0f : m_new;
    correction[r] = exp2f(st.m[r] - base[r]);  // 0 while m was -inf
    if constexpr (kStats) {  // as the split kernel's UpdateRow, before l moves to the new max
      const float kept = st.l[r] > 0.0f ? st.l[r] * (st.m[r] - base[r]) * kLn2 : 0.0f;
      st.a[r] = correction[r] == 0.0f ? 0.0f : correction[r] * (st.a[r] + kept);
      st.dist[r] *= correction[r];
      st.sink[r] *= correction[r];
    }
    st.m[r] = m_new;
    st.l[r] *= correction[r];  // this thread's part of the row sum; the quad adds its parts at the end
  }
  #pragma unroll
  for (int nb = 0; nb < kN / 8; ++nb) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const float score = s[nb][e];
      s[nb][e] = exp2f(score - base[r]);
      st.l[r] += s[nb][e];
      if constexpr (kStats) {
        if (s[nb][e] != 0.0f) {  // a hidden key adds nothing (0 * -inf would be NaN)
          const int64_t j = key0 + nb * 8 + 2 * t + (e & 1);
          st.a[r] = fmaf(s[nb][e], (score - base[r]) * kLn2, st.a[r]);
          st.dist[r] = fmaf(s[nb][e], fabsf(static_cast<float>(st.position[r] - j)), st.dist[r]);
          if (j < sink_tokens) st.sink[r] += s[nb][e];
        }
      }
    }
  }
}

// Grid (num_mma_units, shared_splits), kCascadeThreads threads: unit num_units - num_mma_units + blockIdx.x over
// shared keys [split * shared_split_keys, ...) of its first member's blocks. T: the products' dtype (the cache's
// 16-bit one, bf16 for an 8-bit cache); kD: head_dim, 64 or 128; kStats: the statistics' sums too (PagedParams' lse
// or entropy asked for).
template <typename T, typename CacheT, int kD, bool kStats>
__global__ void __launch_bounds__(kCascadeThreads) PagedCascadeKernel(PagedParams p) {
  constexpr int kN = kCascadeTileKeys, kRowK = kN + 8, kRowV = kD + 8;  // padded rows, in elements
  static_assert(kCascadeRows <= kN, "Q's staging must fit in the V tile");
  __shared__ __align__(16) T k_shared[kD * kRowK];
  __shared__ __align__(16) T v_shared[kN * kRowV];
  __shared__ UnitRow unit_rows[kCascadeRows];
  const PagedUnit u = p.units[p.num_units - p.num_mma_units + blockIdx.x];
  const int64_t split = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rows = UnitRows(u);
  const bool active = warp * 16 < rows;  // a warp whose 16 rows are all past the unit's computes nothing
  if (static_cast<int>(threadIdx.x) < rows) unit_rows[threadIdx.x] = RowOfUnit(p, u, static_cast<int>(threadIdx.x));
  __syncthreads();  // unit_rows
  StageCascadeQueries<T, kD, kRowV>(p, rows, unit_rows, v_shared);
  __syncthreads();
  uint32_t q_frag[kD / 16][4];
  LoadQueryFragments<T, kD, kRowV>(q_frag, v_shared + warp * 16 * kRowV, lane);

  const PagedSequenceDesc lead = p.sequences[p.cascade[u.member0]];
  char* const* blocks = p.blocks + lead.block_offset;
  const int64_t begin = split * p.shared_split_keys;
  const int64_t end = lead.shared_keys < begin + p.shared_split_keys ? lead.shared_keys : begin + p.shared_split_keys;
  const float score_scale = p.scale * kLog2e;
  CascadeRows<kStats> st;
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int unit_row = warp * 16 + g + 8 * r;
    if (kStats && unit_row < rows) st.position[r] = unit_rows[unit_row].Position();
  }
  float o[kD / 8][4];
  #pragma unroll
  for (int nb = 0; nb < kD / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.0f;

  for (int64_t key0 = begin; key0 < end; key0 += kN) {
    __syncthreads();  // every warp is done with the previous tiles (the first time: with Q's staging)
    LoadCascadeTiles<T, CacheT, kD, kRowK, kRowV>(p, blocks, u.kv_head, key0, end, k_shared, v_shared);
    __syncthreads();
    if (!active) continue;  // it still copies its share of the tiles
    // S = Q K^T. One transposed ldmatrix gives B fragments for 8 keys x 32 dims: lane i addresses K^T's row (dim)
    // kk*16 + i at keys nb*8.., so matrix m holds dims kk*16 + 8m..: r[0], r[1] are B for dims kk*16.. and r[2],
    // r[3] for dims (kk+1)*16..
    float s[kN / 8][4];
    #pragma unroll
    for (int nb = 0; nb < kN / 8; ++nb) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
      #pragma unroll
      for (int kk = 0; kk < kD / 16; kk += 2) {
        uint32_t b[4];
        LoadMatricesTransposed(b, k_shared + (kk * 16 + lane) * kRowK + nb * 8);
        Mma<T>::Run(s[nb], q_frag[kk], b[0], b[1]);
        Mma<T>::Run(s[nb], q_frag[kk + 1], b[2], b[3]);
      }
    }
    float correction[2];
    CascadeSoftmax<kN, kStats>(s, key0, end, score_scale, t, p.sink_tokens, st, correction);
    RescaleOutput<kD>(o, correction);
    AccumulateValues<T, kD, kN, kRowV>(o, s, v_shared, lane);
  }

  // The split's unnormalised output and state (natural units) in each row's shared slot.
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] = QuadSum(st.l[r]);
    if constexpr (kStats) {
      st.a[r] = QuadSum(st.a[r]);
      st.dist[r] = QuadSum(st.dist[r]);
      st.sink[r] = QuadSum(st.sink[r]);
    }
    const int unit_row = warp * 16 + g + 8 * r;
    if (unit_row >= rows) continue;
    const UnitRow& row = unit_rows[unit_row];
    const int64_t slot = ((row.row + row.token) * p.heads + row.head) * PagedSlots(p) + p.splits + split;
    float* out = p.partial_out + slot * kD;
    #pragma unroll
    for (int nb = 0; nb < kD / 8; ++nb) {
      out[nb * 8 + 2 * t] = o[nb][2 * r];
      out[nb * 8 + 2 * t + 1] = o[nb][2 * r + 1];
    }
    if (t == 0) {
      float* state = p.partial_state + slot * kPagedStateFields;
      state[0] = st.m[r] * kLn2;  // -inf stays -inf: an empty split
      state[1] = st.l[r];
      state[2] = st.a[r];  // zeros without kStats
      state[3] = st.dist[r];
      state[4] = st.sink[r];
    }
  }
}

// The cascade kernel for the cache dtype (kF16, kBF16 or an 8-bit one), head_dim (64 or 128) and whether the
// statistics are asked for; null otherwise.
template <typename CacheT, typename T>
void (*CascadeKernelFor(int64_t head_dim, bool stats))(PagedParams) {
  if (head_dim == 64) {
    return stats ? &PagedCascadeKernel<T, CacheT, 64, true> : &PagedCascadeKernel<T, CacheT, 64, false>;
  }
  if (head_dim == 128) {
    return stats ? &PagedCascadeKernel<T, CacheT, 128, true> : &PagedCascadeKernel<T, CacheT, 128, false>;
  }
  return nullptr;
}

}  // namespace device
}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_PAGED_CASCADE_CUH_
