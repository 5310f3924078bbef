// The CUDA backend's attention kernels, as device code: flash attention on tensor cores (fp16/bf16, head_dim 64 and
// 128), a SIMT flash kernel for every other dtype and head_dim, and the attention-weights pass; and which kernel
// instantiation a plan runs (ChooseAttentionKernel, ChooseWeightsKernel). Included by attention_kernels.cu, which
// launches them, and by tests/cuda_kernels_emulated_test.cc, which compiles this very code for the host and runs it
// on the CPU (MHA_CUDA_EMULATION: tests/cuda_emulation.h supplies the CUDA built-ins and the warp-wide
// instructions, which this file then leaves out).
//
// Both attention kernels stream the keys in tiles with an online softmax (running max m and sum l per query row,
// fp32), never holding a [Tq, Tk] buffer. A masked score is -inf; a row whose scores are all -inf keeps m = -inf
// and l = 0 and writes zeros. A NaN score is not skipped by the max (fmaxf ignores it) but reaches exp, the sum and
// the output, as in PyTorch.
#ifndef MHA_SERVER_BACKENDS_CUDA_ATTENTION_KERNELS_CUH_
#define MHA_SERVER_BACKENDS_CUDA_ATTENTION_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "server/backends/cuda/kernels.h"

namespace mha {
namespace cuda {
namespace device {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float WarpMax(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The additive mask's row for query i of batch item b, or null.
__device__ __forceinline__ const float* MaskRow(const AttentionParams& p, int64_t b, int64_t i) {
  if (p.additive == nullptr) return nullptr;
  return p.additive + ((p.additive_per_batch ? b * p.q_len : 0) + i) * p.kv_len;
}

// The SIMT kernel's softmax statistics of one query row, as SimtAttention describes them: this lane's shares of
// l, A, D and K over its keys.
struct SimtRowStats {
  float l_lane = 0.0f, entropy_lane = 0.0f, distance_lane = 0.0f, sink_lane = 0.0f;

  // Key j, of score s and weight pj = exp(s - base), after the running max moved from m to base (correction =
  // exp(m - base)); position is the query's.
  __device__ __forceinline__ void Add(float s, float pj, float m, float base, float correction, float position,
                                      int64_t j, int64_t sink_tokens) {
    // l_lane == 0: nothing seen yet (m may be -inf, m - base NaN). correction == 0: what was seen vanishes against
    // the new max (m - base may have overflowed to -inf: lowest against largest float).
    entropy_lane = correction == 0.0f ? 0.0f
                                      : correction * (entropy_lane + (l_lane == 0.0f ? 0.0f : l_lane * (m - base)));
    distance_lane *= correction;
    sink_lane *= correction;
    l_lane = l_lane * correction + pj;
    if (pj != 0.0f) {  // a masked key adds nothing (and 0 * -inf would be NaN); a NaN pj makes the row NaN
      entropy_lane = fmaf(pj, s - base, entropy_lane);
      distance_lane = fmaf(pj, fabsf(position - static_cast<float>(j)), distance_lane);
      if (j < sink_tokens) sink_lane += pj;
    }
  }

  // The whole warp: adds the lanes' shares and, on lane 0, writes the row's statistics at `row` of p's lse ..
  // sink (those asked for), from the row's max m and sum l.
  __device__ __forceinline__ void Write(const AttentionParams& p, int64_t row, float m, float l, int lane) const {
    const float entropy_sum = WarpSum(entropy_lane), distance_sum = WarpSum(distance_lane),
                sink_sum = WarpSum(sink_lane);
    if (lane == 0) StoreRowStats(p, row, m, l, entropy_sum, distance_sum, sink_sum);
  }

  // A row's statistics from its max m and sum l (natural units) and its sums A, D and K over all keys.
  __device__ __forceinline__ static void StoreRowStats(const AttentionParams& p, int64_t row, float m, float l,
                                                       float entropy_sum, float distance_sum, float sink_sum) {
    float lse = -INFINITY, entropy = 0.0f, confidence = 0.0f, distance = 0.0f, sink = 0.0f;
    if (l != l) {  // NaN: a NaN score
      lse = entropy = confidence = distance = sink = l;
    } else if (l > 0.0f) {
      const float log_sum = logf(l), inverse = 1.0f / l;
      lse = m + log_sum;
      entropy = fmaxf(0.0f, log_sum - entropy_sum * inverse);  // rounding can leave one key's a hair below 0
      confidence = inverse;
      distance = distance_sum * inverse;
      sink = sink_sum * inverse;
    }
    if (p.lse != nullptr) p.lse[row] = lse;
    if (p.entropy != nullptr) p.entropy[row] = entropy;
    if (p.confidence != nullptr) p.confidence[row] = confidence;
    if (p.distance != nullptr) p.distance[row] = distance;
    if (p.sink != nullptr) p.sink[row] = sink;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// SIMT kernel: one warp per query row. Lane l scores key j0 + l of each step of 32 keys; the output row's head_dim
// values are spread over the lanes, kChunks per lane (head_dim <= 32 kChunks).
//
// kStats: the softmax statistics (AttentionParams' lse .. sink) too. Each lane keeps, beside its share l_lane of the
// sum l, the accumulators A = sum w (s - m), D = sum w |pos - j| and K = the w of the sink keys over its keys, w =
// exp(s - m) against the running max m; when m moves to m', A' = e^(m - m') (A + l_lane (m - m')) and D, K, l_lane
// scale by e^(m - m'). The warp adds the lanes' shares at the end: lse = m + ln l, entropy = ln l - A / l,
// confidence = 1 / l, distance = D / l, sink = K / l. (A separate instantiation, so that the plain kernel keeps its
// registers.)
template <typename T, typename OutT, int kChunks, bool kStats>
__global__ void __launch_bounds__(kSimtThreads) SimtAttention(AttentionParams p) {
  __shared__ float q_shared[kSimtWarps][kChunks * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 32-bit division (64-bit division is a function call): batch * heads < 2^31 (PlanFlash).
  const int heads = static_cast<int>(p.heads);
  const int64_t b = static_cast<int>(blockIdx.x) / heads, h = static_cast<int>(blockIdx.x) % heads;
  const int64_t kv_head = static_cast<int>(h) / (heads / static_cast<int>(p.kv_heads));
  const int64_t i = QueryTileOf(p.causal, gridDim.y, blockIdx.y) * kSimtWarps + warp;
  if (i >= p.q_len) return;  // the whole warp: nothing below synchronises the block
  const int d_k = static_cast<int>(p.head_dim);
  const T* q = static_cast<const T*>(p.q) + (b * p.q_len + i) * p.q_row_stride + h * d_k;
  const T* k = static_cast<const T*>(p.k) + b * p.kv_len * p.kv_row_stride + kv_head * d_k;
  const T* v = static_cast<const T*>(p.v) + b * p.kv_len * p.kv_row_stride + kv_head * d_k;
  float* qs = q_shared[warp];
  #pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int d = lane + 32 * c;
    qs[d] = d < d_k ? ToFloat(q[d]) : 0.0f;
  }
  __syncwarp();
  const int64_t n = VisibleKeyEnd(p.q_len, p.kv_len, p.causal, p.key_lengths ? p.key_lengths[b] : -1, i);
  const float* mask = MaskRow(p, b, i);
  float m = -INFINITY, l = 0.0f, o[kChunks];
  #pragma unroll
  for (int c = 0; c < kChunks; ++c) o[c] = 0.0f;
  // kStats: this lane's shares (see above), and the query's position (bottom-right aligned).
  SimtRowStats stats;
  const float position = static_cast<float>(i + p.kv_len - p.q_len);
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j < n) {
      const T* kj = k + j * p.kv_row_stride;
      float dot = 0.0f;
      for (int d = 0; d < d_k; ++d) dot = fmaf(qs[d], ToFloat(kj[d]), dot);
      s = dot * p.scale;
      if (mask != nullptr) s += mask[j];
    }
    const float m_new = fmaxf(m, WarpMax(s));
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    const float pj = expf(s - base);  // 0 for -inf
    const float correction = expf(m - base);
    l = l * correction + WarpSum(pj);
    if constexpr (kStats) stats.Add(s, pj, m, base, correction, position, j, p.sink_tokens);
    #pragma unroll
    for (int c = 0; c < kChunks; ++c) o[c] *= correction;
    const int count = n - j0 < 32 ? static_cast<int>(n - j0) : 32;
    for (int t = 0; t < count; ++t) {
      const float pt = __shfl_sync(kFullMask, pj, t);
      const T* vt = v + (j0 + t) * p.kv_row_stride;
      #pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int d = lane + 32 * c;
        if (d < d_k) o[c] = fmaf(pt, ToFloat(vt[d]), o[c]);
      }
    }
    m = m_new;
  }
  // l == 0: no visible key. A NaN l (a NaN score) makes the row NaN.
  const float factor = (l == 0.0f ? 0.0f : 1.0f / l) * (p.head_mask != nullptr ? p.head_mask[h] : 1.0f);
  OutT* out = static_cast<OutT*>(p.out) + ((b * p.q_len + i) * p.heads + h) * d_k;
  #pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int d = lane + 32 * c;
    if (d < d_k) out[d] = FromFloat<OutT>(o[c] * factor);
  }
  if (p.row_stats != nullptr && lane == 0) {
    float* stats = p.row_stats + 2 * ((b * p.heads + h) * p.q_len + i);
    stats[0] = m;
    stats[1] = l;
  }
  if constexpr (kStats) stats.Write(p, (b * p.heads + h) * p.q_len + i, m, l, lane);
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core kernel (FlashAttention-2's structure): a block of kWarps warps (4 or 8: the plan's block_m / 16) owns
// 16 kWarps query rows of one (batch, head); each warp holds its 16 rows of Q as mma.sync A fragments in
// registers, streams 64-key tiles of K and V through shared memory, computes S = Q K^T and O += P V with m16n8k16
// MMAs (fp32 accumulators), and reuses S's accumulator layout as P's A fragments. With kAsync (the plan's
// async_copies) the tiles come by cp.async in FlashAttention-2's order: V(j) is copied while S(j) is computed,
// K(j + 1) while O += P(j) V(j) is, so that one K tile and one V tile of shared memory suffice. Fragment layouts
// (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4, A holds rows g and g + 8, columns 2t, 2t + 1 and
// 2t + 8, 2t + 9; B holds columns (k) 2t, 2t + 1 and 2t + 8, 2t + 9 of row (n) g; C holds rows g and g + 8, columns
// 2t and 2t + 1.

#ifndef MHA_CUDA_EMULATION
// The warp-wide instructions, one function each (tests/cuda_emulation.h defines them for the host instead).
// m16n8k16 MMA with fp32 accumulators: c += a b, a and b as the fragment layouts above, bf16 or fp16 elements.
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ldmatrix: four 8x8 matrices of 16-bit elements from shared memory, lane i giving the address of row i % 8 of
// matrix i / 8 (16-byte aligned). Lane l receives in r[j] row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix
// j; with .trans, rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4 (the transposed matrix's).
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const void* shared) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t (&r)[4], const void* shared) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 16 bytes from global to shared memory without passing through registers (sm_80+): the copy runs while the
// thread goes on, until WaitCopies.
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global) : "memory");
}
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits for this thread's copies; a __syncthreads() after it makes every thread's copies visible to the block.
__device__ __forceinline__ void WaitCopies() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
#endif  // MHA_CUDA_EMULATION

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void Run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    MmaBf16(c, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  __device__ __forceinline__ static void Run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    MmaF16(c, a, b0, b1);
  }
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Two 16-bit elements as one register, the lower address in the low half.
template <typename T>
__device__ __forceinline__ uint32_t Pair(const T* x) {
  return *reinterpret_cast<const uint32_t*>(x);
}
// Copies `rows` rows of kD 16-bit elements (row stride `stride` elements, 16-byte aligned) into shared memory
// (row stride kRow) with the block's kThreads threads; rows past `valid` become zeros. kAsync: with cp.async (then
// CommitCopies, WaitCopies and a barrier before use); else plain loads (a barrier before use).
template <bool kAsync, int kThreads, typename T, int kD, int kRow>
__device__ __forceinline__ void LoadTile(T* shared, const T* global, int64_t stride, int rows, int64_t valid) {
  constexpr int kVectors = kD / 8;  // 16-byte vectors per row
  for (int idx = threadIdx.x; idx < rows * kVectors; idx += kThreads) {
    const int r = idx / kVectors, c = (idx % kVectors) * 8;
    uint4* to = reinterpret_cast<uint4*>(shared + r * kRow + c);
    if (r >= valid) {
      *to = make_uint4(0, 0, 0, 0);
    } else if constexpr (kAsync) {
      CopyAsync16(to, global + r * stride + c);
    } else {
      *to = *reinterpret_cast<const uint4*>(global + r * stride + c);
    }
  }
}

// The max and the sum over the quad of threads that holds one row of an MMA accumulator (lanes 4g .. 4g + 3).
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

// This thread's two rows of O (the accumulator layout: rows g and g + 8) times their corrections.
template <int kD>
__device__ __forceinline__ void RescaleOutput(float (&o)[kD / 8][4], const float (&correction)[2]) {
  #pragma unroll
  for (int nb = 0; nb < kD / 8; ++nb) {
    o[nb][0] *= correction[0];
    o[nb][1] *= correction[0];
    o[nb][2] *= correction[1];
    o[nb][3] *= correction[1];
  }
}

// This warp's 16 query rows, from `rows` in shared memory (row stride kRow elements), as A fragments for the kD / 16
// k-steps of S = Q K^T.
template <typename T, int kD, int kRow>
__device__ __forceinline__ void LoadQueryFragments(uint32_t (&q_frag)[kD / 16][4], const T* rows, int lane) {
  const T* base = rows + (lane >> 2) * kRow + 2 * (lane & 3);
  #pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    q_frag[kk][0] = Pair(base + kk * 16);
    q_frag[kk][1] = Pair(base + 8 * kRow + kk * 16);
    q_frag[kk][2] = Pair(base + kk * 16 + 8);
    q_frag[kk][3] = Pair(base + 8 * kRow + kk * 16 + 8);
  }
}

// O += P V over one tile of kN keys: P is this warp's weights in S's accumulator layout (s[kN / 8][4], whose two
// neighbouring 8-key blocks make one A fragment), V the tile's [kN][kD] rows in shared memory (row stride kRow).
template <typename T, int kD, int kN, int kRow>
__device__ __forceinline__ void AccumulateValues(float (&o)[kD / 8][4], const float (&s)[kN / 8][4],
                                                 const T* v_shared, int lane) {
  #pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    const uint32_t a[4] = {Mma<T>::Pack(s[2 * kk][0], s[2 * kk][1]), Mma<T>::Pack(s[2 * kk][2], s[2 * kk][3]),
                           Mma<T>::Pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           Mma<T>::Pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
    // One transposed ldmatrix gives B fragments for 16 keys x 16 dims: matrix m holds keys kk*16 + 8 (m % 2)..
    // and dims (nb + m / 2) * 8.., so r[0], r[1] are B for dims nb*8.. and r[2], r[3] for dims (nb+1)*8..
    const T* value_rows = v_shared + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kRow + (lane >> 4) * 8;
    #pragma unroll
    for (int nb = 0; nb < kD / 8; nb += 2) {
      uint32_t b[4];
      LoadMatricesTransposed(b, value_rows + nb * 8);
      Mma<T>::Run(o[nb], a, b[0], b[1]);
      Mma<T>::Run(o[nb + 1], a, b[2], b[3]);
    }
  }
}

// kStats: the softmax statistics too, as the SIMT kernel keeps them (SimtRowStats): each thread's shares of A, D
// and K over its keys of its two rows beside its share of l, rescaled with it when the row's max moves, and added
// over the quad at the end.
template <typename T, typename OutT, int kD, int kWarps, bool kAsync, bool kStats = false>
__global__ void __launch_bounds__(32 * kWarps) TensorCoreAttention(AttentionParams p) {
  constexpr int kThreads = 32 * kWarps, kBlockM = 16 * kWarps;
  constexpr int kRow = kD + 8;  // padded shared-memory row, in elements
  // The K tile, then the V tile. Q passes through their room on its way to registers: the V tile's for 64 rows
  // (the first K tile is copied meanwhile), both for 128.
  static_assert(kBlockM <= 2 * kTcBlockN, "Q's staging must fit in the K and V tiles");
  __shared__ __align__(16) T tiles_shared[2 * kTcBlockN * kRow];
  T* const k_shared = tiles_shared;
  T* const v_shared = tiles_shared + kTcBlockN * kRow;
  T* const q_shared = tiles_shared + (2 * kTcBlockN - kBlockM) * kRow;
  constexpr bool kQInVTile = kBlockM <= kTcBlockN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // 32-bit division (64-bit division is a function call): batch * heads < 2^31 (PlanFlash).
  const int heads = static_cast<int>(p.heads);
  const int64_t b = static_cast<int>(blockIdx.x) / heads, h = static_cast<int>(blockIdx.x) % heads;
  const int64_t kv_head = static_cast<int>(h) / (heads / static_cast<int>(p.kv_heads));
  const int64_t row0 = QueryTileOf(p.causal, gridDim.y, blockIdx.y) * kBlockM;
  const T* q = static_cast<const T*>(p.q) + (b * p.q_len + row0) * p.q_row_stride + h * kD;
  const T* k = static_cast<const T*>(p.k) + b * p.kv_len * p.kv_row_stride + kv_head * kD;
  const T* v = static_cast<const T*>(p.v) + b * p.kv_len * p.kv_row_stride + kv_head * kD;
  const int64_t key_length = p.key_lengths ? p.key_lengths[b] : -1;
  const int64_t tiles = KeyTileCount(p.q_len, p.kv_len, p.causal, key_length, row0, kBlockM, kTcBlockN);

  // Q into this warp's A fragments through shared memory.
  LoadTile<kAsync, kThreads, T, kD, kRow>(q_shared, q, p.q_row_stride, kBlockM, p.q_len - row0);
  if constexpr (kAsync && kQInVTile) {
    // Q lies in the V tile's room: the first K tile is copied meanwhile.
    if (tiles > 0) LoadTile<true, kThreads, T, kD, kRow>(k_shared, k, p.kv_row_stride, kTcBlockN, p.kv_len);
  }
  if constexpr (kAsync) {
    CommitCopies();
    WaitCopies();
  }
  __syncthreads();
  uint32_t q_frag[kD / 16][4];
  LoadQueryFragments<T, kD, kRow>(q_frag, q_shared + warp * 16 * kRow, lane);

  // This thread's two query rows.
  const int64_t rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  int64_t visible[2];
  const float* mask[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    visible[r] = rows[r] < p.q_len ? VisibleKeyEnd(p.q_len, p.kv_len, p.causal, key_length, rows[r]) : 0;
    mask[r] = rows[r] < p.q_len ? MaskRow(p, b, rows[r]) : nullptr;
  }
  // Scores and the running max m are kept in the log2 domain (times log2 e), where exp2 is the hardware's
  // exponential and the scale folds into one multiply. With an additive mask they stay in natural units and each
  // exponent is scaled after its subtraction: a finite mask such as PyTorch's finfo(float32).min times log2 e
  // overflows to -inf (a row of them must get uniform weights, not none), and s - m of two such scores is exact.
  const bool natural = p.additive != nullptr;
  const float score_scale = natural ? p.scale : p.scale * kLog2e, to_log2 = natural ? kLog2e : 1.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  // kStats: this thread's shares of A = sum w (s - m) (natural units), D = sum w |pos - j| and K (sink keys' w).
  float stat_a[2] = {0.0f, 0.0f}, stat_d[2] = {0.0f, 0.0f}, stat_k[2] = {0.0f, 0.0f};
  const float to_natural = natural ? 1.0f : kLn2;
  float o[kD / 8][4];
  #pragma unroll
  for (int nb = 0; nb < kD / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.0f;

  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t key0 = tile * kTcBlockN;
    if constexpr (kAsync) {
      if (!kQInVTile && tile == 0) {
        // Q filled the K tile too: every warp has its fragments now, so the first K tile may come.
        __syncthreads();
        LoadTile<true, kThreads, T, kD, kRow>(k_shared, k, p.kv_row_stride, kTcBlockN, p.kv_len);
        CommitCopies();
      }
      // K(tile) has landed (issued before the previous O += P V) and every warp is done with v_shared (the
      // previous tile's V, or Q): V(tile) goes on its way while S is computed.
      WaitCopies();
      __syncthreads();
      LoadTile<true, kThreads, T, kD, kRow>(v_shared, v + key0 * p.kv_row_stride, p.kv_row_stride, kTcBlockN,
                                            p.kv_len - key0);
      CommitCopies();
    } else {
      __syncthreads();  // every warp is done with the previous tile (and with Q)
      LoadTile<false, kThreads, T, kD, kRow>(k_shared, k + key0 * p.kv_row_stride, p.kv_row_stride, kTcBlockN,
                                             p.kv_len - key0);
      LoadTile<false, kThreads, T, kD, kRow>(v_shared, v + key0 * p.kv_row_stride, p.kv_row_stride, kTcBlockN,
                                             p.kv_len - key0);
      __syncthreads();
    }

    // S = Q K^T. One ldmatrix gives B fragments for 8 keys x 32 dims: matrix m holds keys nb*8.. and dims
    // kk*16 + 8m.., so r[0], r[1] are B for dims kk*16.. and r[2], r[3] for dims (kk+1)*16..
    float s[kTcBlockN / 8][4];
    #pragma unroll
    for (int nb = 0; nb < kTcBlockN / 8; ++nb) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
      const T* key_rows = k_shared + (nb * 8 + (lane & 7)) * kRow + (lane >> 3) * 8;
      #pragma unroll
      for (int kk = 0; kk < kD / 16; kk += 2) {
        uint32_t b[4];
        LoadMatrices(b, key_rows + kk * 16);
        Mma<T>::Run(s[nb], q_frag[kk], b[0], b[1]);
        Mma<T>::Run(s[nb], q_frag[kk + 1], b[2], b[3]);
      }
    }
    // Scale (into the log2 domain), mask, and each row's running max over the quad of threads that shares it. A
    // tile whose keys both of this thread's rows see in full, without an additive mask, needs no test per key.
    float tile_max[2] = {-INFINITY, -INFINITY};
    const bool interior = key0 + kTcBlockN <= visible[0] && key0 + kTcBlockN <= visible[1] && mask[0] == nullptr &&
                          mask[1] == nullptr;
    if (interior) {
      #pragma unroll
      for (int nb = 0; nb < kTcBlockN / 8; ++nb) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nb][e] *= score_scale;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nb][e]);
        }
      }
    } else {
      #pragma unroll
      for (int nb = 0; nb < kTcBlockN / 8; ++nb) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int64_t j = key0 + nb * 8 + 2 * t + (e & 1);
          float score = -INFINITY;
          if (j < visible[r]) {
            score = s[nb][e] * score_scale;
            if (mask[r] != nullptr) score += mask[r][j];  // natural units (a mask means natural)
          }
          s[nb][e] = score;
          tile_max[r] = fmaxf(tile_max[r], score);
        }
      }
    }
    float correction[2], base[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = QuadMax(tile_max[r]);
      const float m_new = fmaxf(m[r], tile_max[r]);
      base[r] = m_new == -INFINITY ? 0.0f : m_new;
      correction[r] = exp2f((m[r] - base[r]) * to_log2);
      if constexpr (kStats) {  // as SimtRowStats::Add, before l moves to the new max
        stat_a[r] = correction[r] == 0.0f ? 0.0f
                                          : correction[r] * (stat_a[r] + (l[r] == 0.0f ? 0.0f
                                                                                      : l[r] * (m[r] - base[r]) *
                                                                                            to_natural));
        stat_d[r] *= correction[r];
        stat_k[r] *= correction[r];
      }
      m[r] = m_new;
      l[r] *= correction[r];  // this thread's part of the row sum; the quad adds its parts at the end
    }
    #pragma unroll
    for (int nb = 0; nb < kTcBlockN / 8; ++nb) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float score = s[nb][e];
        s[nb][e] = exp2f((score - base[r]) * to_log2);
        l[r] += s[nb][e];
        if constexpr (kStats) {
          if (s[nb][e] != 0.0f) {  // a hidden key adds nothing (0 * -inf would be NaN); a NaN makes the row NaN
            const int64_t j = key0 + nb * 8 + 2 * t + (e & 1);
            const int64_t position = rows[r] + p.kv_len - p.q_len;  // bottom-right aligned
            stat_a[r] = fmaf(s[nb][e], (score - base[r]) * to_natural, stat_a[r]);
            stat_d[r] = fmaf(s[nb][e], fabsf(static_cast<float>(position - j)), stat_d[r]);
            if (j < p.sink_tokens) stat_k[r] += s[nb][e];
          }
        }
      }
    }
    RescaleOutput<kD>(o, correction);
    if constexpr (kAsync) {
      // V(tile) has landed and every warp is done with k_shared: K(tile + 1) goes on its way during O += P V.
      WaitCopies();
      __syncthreads();
      if (tile + 1 < tiles) {
        LoadTile<true, kThreads, T, kD, kRow>(k_shared, k + (key0 + kTcBlockN) * p.kv_row_stride, p.kv_row_stride,
                                              kTcBlockN, p.kv_len - key0 - kTcBlockN);
      }
      CommitCopies();
    }
    // O += P V: P's A fragments are S's accumulators of two neighbouring 8-key blocks.
    AccumulateValues<T, kD, kTcBlockN, kRow>(o, s, v_shared, lane);
  }

  float factor[2];
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = QuadSum(l[r]);
    factor[r] = (l[r] == 0.0f ? 0.0f : 1.0f / l[r]) * (p.head_mask != nullptr ? p.head_mask[h] : 1.0f);
    if constexpr (kStats) {
      stat_a[r] = QuadSum(stat_a[r]);
      stat_d[r] = QuadSum(stat_d[r]);
      stat_k[r] = QuadSum(stat_k[r]);
      if (rows[r] < p.q_len && t == 0) {
        SimtRowStats::StoreRowStats(p, (b * p.heads + h) * p.q_len + rows[r], natural ? m[r] : m[r] * kLn2, l[r],
                                    stat_a[r], stat_d[r], stat_k[r]);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= p.q_len) continue;
    OutT* out = static_cast<OutT*>(p.out) + ((b * p.q_len + rows[r]) * p.heads + h) * kD;
    #pragma unroll
    for (int nb = 0; nb < kD / 8; ++nb) {
      out[nb * 8 + 2 * t] = FromFloat<OutT>(o[nb][2 * r] * factor[r]);
      out[nb * 8 + 2 * t + 1] = FromFloat<OutT>(o[nb][2 * r + 1] * factor[r]);
    }
    if (p.row_stats != nullptr && t == 0) {
      float* stats = p.row_stats + 2 * ((b * p.heads + h) * p.q_len + rows[r]);
      stats[0] = natural ? m[r] : m[r] * kLn2;
      stats[1] = l[r];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention weights exp(s - max) / sum from each row's statistics: one warp per query row, lane l writes keys l,
// l + 32, ... (Not exp(s - log-sum-exp): where the max is as large as PyTorch's finfo.min, max + log(sum) rounds
// back to max.)
template <typename T, typename WeightT>
__global__ void __launch_bounds__(kSimtThreads) AttentionWeights(AttentionParams p, void* weights) {
  __shared__ float q_shared[kSimtWarps][kMaxHeadDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 32-bit division (64-bit division is a function call): batch * heads < 2^31 (PlanFlash).
  const int heads = static_cast<int>(p.heads);
  const int64_t b = static_cast<int>(blockIdx.x) / heads, h = static_cast<int>(blockIdx.x) % heads;
  const int64_t kv_head = static_cast<int>(h) / (heads / static_cast<int>(p.kv_heads));
  const int64_t i = static_cast<int64_t>(blockIdx.y) * kSimtWarps + warp;
  if (i >= p.q_len) return;
  const int d_k = static_cast<int>(p.head_dim);
  const T* q = static_cast<const T*>(p.q) + (b * p.q_len + i) * p.q_row_stride + h * d_k;
  const T* k = static_cast<const T*>(p.k) + b * p.kv_len * p.kv_row_stride + kv_head * d_k;
  float* qs = q_shared[warp];
  for (int d = lane; d < d_k; d += 32) qs[d] = ToFloat(q[d]);
  __syncwarp();
  const int64_t n = VisibleKeyEnd(p.q_len, p.kv_len, p.causal, p.key_lengths ? p.key_lengths[b] : -1, i);
  const float* mask = MaskRow(p, b, i);
  const float* stats = p.row_stats + 2 * ((b * p.heads + h) * p.q_len + i);
  const float row_max = stats[0], row_sum = stats[1];
  WeightT* row = static_cast<WeightT*>(weights) + ((b * p.heads + h) * p.q_len + i) * p.kv_len;
  for (int64_t j = lane; j < p.kv_len; j += 32) {
    float w = 0.0f;
    if (j < n && row_sum != 0.0f) {
      const T* kj = k + j * p.kv_row_stride;
      float dot = 0.0f;
      for (int d = 0; d < d_k; ++d) dot = fmaf(qs[d], ToFloat(kj[d]), dot);
      float s = dot * p.scale;
      if (mask != nullptr) s += mask[j];
      w = expf(s - row_max) / row_sum;  // 0 for a masked (-inf) score
    }
    row[j] = FromFloat<WeightT>(w);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Which instantiation runs a call, with its launch shape. A null kernel: no kernel computes that combination.
struct AttentionLaunch {
  void (*kernel)(AttentionParams) = nullptr;
  dim3 grid;
  unsigned threads = 0;
};

template <typename T, typename OutT, int kD>
void (*TensorCoreKernel(const FlashPlan& plan, bool stats))(AttentionParams) {
  if (stats) {  // the statistics' instantiations copy asynchronously, as PlanFlash plans
    if (!plan.async_copies) return nullptr;
    if (plan.block_m == 64) return &TensorCoreAttention<T, OutT, kD, 4, true, true>;
    if (plan.block_m == 128) return &TensorCoreAttention<T, OutT, kD, 8, true, true>;
    return nullptr;
  }
  if (plan.block_m == 64) {
    return plan.async_copies ? &TensorCoreAttention<T, OutT, kD, 4, true> : &TensorCoreAttention<T, OutT, kD, 4, false>;
  }
  if (plan.block_m == 128) {
    return plan.async_copies ? &TensorCoreAttention<T, OutT, kD, 8, true> : &TensorCoreAttention<T, OutT, kD, 8, false>;
  }
  return nullptr;
}

template <typename T, typename OutT, bool kStats>
void (*SimtKernel(const AttentionParams& p))(AttentionParams) {
  const int64_t chunks = (p.head_dim + 31) / 32;
  if (chunks <= 1) return &SimtAttention<T, OutT, 1, kStats>;
  if (chunks <= 2) return &SimtAttention<T, OutT, 2, kStats>;
  if (chunks <= 4) return &SimtAttention<T, OutT, 4, kStats>;
  if (chunks <= 8) return &SimtAttention<T, OutT, 8, kStats>;
  return nullptr;
}

template <typename T, typename OutT>
void (*TypedKernel(const AttentionParams& p, const FlashPlan& plan))(AttentionParams) {
  if (plan.kernel == FlashKernel::kTensorCore) {
    if constexpr (std::is_same_v<T, float>) {
      return nullptr;
    } else {
      if (p.head_dim == 64) return TensorCoreKernel<T, OutT, 64>(plan, p.wants_stats());
      if (p.head_dim == 128) return TensorCoreKernel<T, OutT, 128>(plan, p.wants_stats());
      return nullptr;
    }
  }
  if (p.wants_stats()) return SimtKernel<T, OutT, true>(p);
  return SimtKernel<T, OutT, false>(p);
}

template <typename T>
void (*KernelForInput(const AttentionParams& p, const FlashPlan& plan))(AttentionParams) {
  if (p.out_dtype == kF32) return TypedKernel<T, float>(p, plan);
  if (p.out_dtype != p.dtype) return nullptr;
  return TypedKernel<T, T>(p, plan);
}

// The attention kernel for p's dtypes and head_dim as `plan` says, on plan's grid and block size.
inline AttentionLaunch ChooseAttentionKernel(const AttentionParams& p, const FlashPlan& plan) {
  AttentionLaunch launch;
  switch (p.dtype) {
    case kF32:
      launch.kernel = KernelForInput<float>(p, plan);
      break;
    case kF16:
      launch.kernel = KernelForInput<__half>(p, plan);
      break;
    case kBF16:
      launch.kernel = KernelForInput<__nv_bfloat16>(p, plan);
      break;
    default:
      break;
  }
  launch.grid = dim3(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y));
  launch.threads = static_cast<unsigned>(plan.threads);
  return launch;
}

// The weights pass's kernel, for p's input dtype and the weights' dtype, on its grid (one warp per query row).
struct WeightsLaunch {
  void (*kernel)(AttentionParams, void*) = nullptr;
  dim3 grid;
  unsigned threads = kSimtThreads;
};

template <typename T>
void (*WeightsKernelFor(int weights_dtype))(AttentionParams, void*) {
  switch (weights_dtype) {
    case kF32:
      return &AttentionWeights<T, float>;
    case kF16:
      return &AttentionWeights<T, __half>;
    case kBF16:
      return &AttentionWeights<T, __nv_bfloat16>;
    default:
      return nullptr;
  }
}

inline WeightsLaunch ChooseWeightsKernel(const AttentionParams& p, int weights_dtype) {
  WeightsLaunch launch;
  switch (p.dtype) {
    case kF32:
      launch.kernel = WeightsKernelFor<float>(weights_dtype);
      break;
    case kF16:
      launch.kernel = WeightsKernelFor<__half>(weights_dtype);
      break;
    case kBF16:
      launch.kernel = WeightsKernelFor<__nv_bfloat16>(weights_dtype);
      break;
    default:
      break;
  }
  launch.grid = dim3(static_cast<unsigned>(p.batch * p.heads),
                     static_cast<unsigned>((p.q_len + kSimtWarps - 1) / kSimtWarps));
  return launch;
}

}  // namespace device
}  // namespace cuda
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_ATTENTION_KERNELS_CUH_
