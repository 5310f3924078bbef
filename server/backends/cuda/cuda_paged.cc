// The CUDA backend's sessions: Backend::PagedAttention on the paged kernels (paged_kernels.h). The caches' blocks
// are read and written in place when the device can address them (the session store's arena in CUDA managed
// memory, CudaBackend::AllocateCacheArena); otherwise the blocks a call reads are staged through the lane's device
// buffer and those that receive new tokens are copied back.
//
// The new tokens' inputs are small (a decode step is one row per sequence): head sessions' q, k, v are widened to
// fp32 on the host as they are staged; a layer session's x goes to the device in its wire dtype and is projected
// there (cuBLAS, in that dtype, like the stateless layer). Outputs come back in fp32 and are narrowed on the host.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/cuda/cuda_backend_impl.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"
#include "server/backends/cuda/paged_plan.h"
#include "server/backends/float_io.h"

namespace mha {
namespace {

// Whether the device reads `p` in place: device or managed memory.
bool DeviceAddressable(const void* p) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // host memory the runtime never saw: not an error worth keeping
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

// The layer's view of a paged problem, for the resident-layer cache and its offsets: keys and values come from x.
AttentionShape LayerShape(const PagedProblem& p, int64_t rows) {
  AttentionShape s;
  s.batch = 1;
  s.q_len = s.kv_len = rows;
  s.d_model = s.d_kv_in = s.d_v_in = p.d_model;
  s.heads = p.heads;
  return s;
}

}  // namespace

// The host side of one paged call: what it asks for, and what is staged where (Staged pieces of the lane's
// buffers; the other pointers are device scratch).
struct CudaBackend::Impl::PagedCall {
  bool layer = false, inline_layer = false, wide = false;  // wide: fp32 on the wire
  bool in_place = false;  // the blocks are device-addressable
  std::array<bool, 5> wanted = {};  // lse, entropy, confidence, distance, sink
  bool contribution = false;
  LayerOffsets offsets;
  cuda::PagedPlan plan;
  std::vector<cuda::PagedSequenceDesc> descs;
  std::vector<char*> table;  // device-addressable block pointers, sequences in order
  std::vector<double> rope;  // PagedParams::rope: a table per sequence, or one (rope_per_sequence); empty without RoPE
  Staged descs_in, units_in, cascade_in, table_in, rope_in, qkv_in, x_in;
  Staged heads_out, layer_out, weights_out;
  Staged stats_out[5];  // [H, n] per sequence, in `wanted`'s order
  Staged contribution_out;
  char* projected = nullptr;  // layer: [rows, q_width + 2 kv_width] in the wire dtype
  char* qkv_f32 = nullptr;    // layer, 16-bit wire: the projection widened to fp32
  char* heads_t = nullptr;    // layer, 16-bit wire: the heads narrowed for W_O
  char* partials = nullptr;
  char* dense_scratch = nullptr;  // the dense path's q, k and v, one sequence at a time
  char* staged_blocks = nullptr;  // staging: every block of the call, in table order
  char* layer_matrices = nullptr;
  float *layer_biases = nullptr, *layer_staging = nullptr;

  // Cuts the call's pieces off `device` and `host` (null: only measures); returns the bytes of each.
  std::pair<int64_t, int64_t> Carve(const PagedProblem& pr, char* device, char* host) {
    const int64_t rows = plan.rows, in_size = DTypeSize(pr.input_dtype);
    const int64_t qw = pr.heads.q_width(), width = qw + 2 * pr.heads.kv_width();
    Carver d(device), p(host);
    for (Staged* x : {&descs_in, &units_in, &cascade_in, &table_in, &rope_in, &qkv_in, &x_in, &heads_out, &layer_out,
                      &weights_out, &contribution_out, &stats_out[0], &stats_out[1], &stats_out[2], &stats_out[3],
                      &stats_out[4]}) {
      x->device = d.Take(x->bytes);
      x->pinned = p.Take(x->bytes);
    }
    partials = d.Take(cuda::PagedScratchBytes(pr, plan));
    dense_scratch = d.Take(plan.dense_scratch_bytes);
    if (layer) {
      projected = d.Take(rows * width * in_size);
      if (!wide) {
        qkv_f32 = d.Take(rows * width * 4);
        heads_t = d.Take(rows * qw * in_size);
      }
      if (inline_layer) {
        layer_matrices = d.Take(offsets.weights * in_size);
        layer_biases = reinterpret_cast<float*>(d.Take(offsets.biases * 4));
        if (!wide) layer_staging = reinterpret_cast<float*>(d.Take(offsets.weights * 4));
      }
    }
    if (!in_place) staged_blocks = d.Take(static_cast<int64_t>(table.size()) * pr.cache.BlockBytes());
    return {d.used(), p.used()};
  }
};

namespace {

// The softmax statistics of `s` in the kernels' order (PagedParams: lse, entropy, confidence, distance, sink).
std::array<float*, 5> StatsArrays(const RowStats& s) { return {s.lse, s.entropy, s.confidence, s.distance, s.sink}; }

absl::Status CopyToDevice(const Staged& s, const void* data, cudaStream_t stream, const char* what) {
  if (s.bytes == 0) return absl::OkStatus();
  if (data != nullptr) std::memcpy(s.pinned, data, s.bytes);
  return CudaStatus(cudaMemcpyAsync(s.device, s.pinned, s.bytes, cudaMemcpyHostToDevice, stream), what);
}

// What a paged call asks for, its plan, its sequences' descriptions and block table, and the sizes of its staged
// pieces.
void DescribePaged(const PagedArgs& a, int multiprocessors, CudaBackend::Impl::PagedCall& c) {
  const PagedProblem& pr = a.problem;
  const HeadSpec& h = pr.heads;
  c.layer = pr.d_model > 0;
  c.inline_layer = c.layer && a.weights.resident_id == 0;
  c.wide = pr.input_dtype == v1::FP32;
  c.in_place = DeviceAddressable(a.sequences[0].blocks[0]);
  c.plan = cuda::PlanPaged(pr, a.sequences, multiprocessors);
  int64_t row = 0, block = 0, weights = 0;
  for (const PagedSequence& seq : a.sequences) {
    // A batched call's sequences ask for the same statistics; any sequence's ask counts.
    const std::array<float*, 5> arrays = StatsArrays(seq.stats);
    for (int i = 0; i < 5; ++i) c.wanted[i] = c.wanted[i] || arrays[i] != nullptr;
    c.contribution = c.contribution || (c.layer && seq.stats.contribution != nullptr);
    cuda::PagedSequenceDesc d;
    d.block_offset = block;
    d.length = seq.length;
    d.new_tokens = seq.new_tokens;
    d.row = row;
    d.weights_offset = weights;
    d.append = seq.append ? 1 : 0;
    d.shared_keys = c.plan.shared_keys[c.descs.size()];
    d.dense = c.plan.dense[c.descs.size()] ? 1 : 0;
    c.descs.push_back(d);
    row += seq.new_tokens;
    block += static_cast<int64_t>(seq.blocks.size());
    if (pr.return_weights) weights += h.num_heads * seq.new_tokens * seq.Keys();
    for (char* b : seq.blocks) c.table.push_back(b);
    // One table serves every sequence unless the frequencies depend on the length (computed on the host per call).
    if (h.has_rope() && (c.rope.empty() || h.rope_scaling.length_dependent())) {
      const cuda::RopeTable rope = RopeTableOf(h, seq.length + seq.new_tokens);
      c.rope.insert(c.rope.end(), rope.inv_freq, rope.inv_freq + h.rope_dim / 2);
      c.rope.push_back(rope.attention_factor);
    }
  }
  const int64_t rows = c.plan.rows, qw = h.q_width(), width = qw + 2 * h.kv_width();
  if (c.layer) c.offsets = OffsetsFor(LayerShape(pr, rows), a.weights);
  c.descs_in.bytes = static_cast<int64_t>(c.descs.size() * sizeof(cuda::PagedSequenceDesc));
  c.units_in.bytes = static_cast<int64_t>(c.plan.units.size() * sizeof(cuda::PagedUnit));
  c.cascade_in.bytes = static_cast<int64_t>(c.plan.cascade.size() * sizeof(int32_t));
  c.table_in.bytes = static_cast<int64_t>(c.table.size() * sizeof(char*));
  c.rope_in.bytes = static_cast<int64_t>(c.rope.size() * sizeof(double));
  c.x_in.bytes = c.layer ? rows * pr.d_model * DTypeSize(pr.input_dtype) : 0;
  c.layer_out.bytes = c.layer ? rows * pr.d_model * 4 : 0;
  c.qkv_in.bytes = c.layer ? 0 : rows * width * 4;
  c.heads_out.bytes = rows * qw * 4;
  c.weights_out.bytes = c.plan.weights_elements * 4;
  for (int i = 0; i < 5; ++i) c.stats_out[i].bytes = c.wanted[i] ? rows * h.num_heads * 4 : 0;
  c.contribution_out.bytes = c.contribution ? rows * h.num_heads * 4 : 0;
}

// The blocks (staged when the device cannot address them: the table then points at the copies), the call's tables
// and the new tokens' inputs, enqueued on `stream`. Head sessions' q, k, v are widened to fp32 as they are staged.
absl::Status StagePaged(const PagedArgs& a, CudaBackend::Impl::PagedCall& c, cudaStream_t stream) {
  const PagedProblem& pr = a.problem;
  const int64_t block_bytes = pr.cache.BlockBytes();
  if (!c.in_place) {
    for (size_t b = 0; b < c.table.size(); ++b) {
      char* copy = c.staged_blocks + b * block_bytes;
      RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(copy, c.table[b], block_bytes, cudaMemcpyHostToDevice, stream),
                           "staging a cache block");
      c.table[b] = copy;
    }
  }
  RETURN_IF_ERROR_STATUS(CopyToDevice(c.descs_in, c.descs.data(), stream, "copying the sequences to the device"));
  RETURN_IF_ERROR_STATUS(CopyToDevice(c.units_in, c.plan.units.data(), stream, "copying the work units"));
  RETURN_IF_ERROR_STATUS(CopyToDevice(c.cascade_in, c.plan.cascade.data(), stream, "copying the cascade groups"));
  RETURN_IF_ERROR_STATUS(CopyToDevice(c.table_in, c.table.data(), stream, "copying the block table"));
  RETURN_IF_ERROR_STATUS(CopyToDevice(c.rope_in, c.rope.data(), stream, "copying the RoPE frequencies"));
  const int64_t in_size = DTypeSize(pr.input_dtype), qw = pr.heads.q_width(), kvw = pr.heads.kv_width();
  const int64_t width = qw + 2 * kvw;
  for (size_t i = 0; i < a.sequences.size(); ++i) {
    const PagedSequence& seq = a.sequences[i];
    const int64_t n = seq.new_tokens, r0 = c.descs[i].row;
    if (c.layer) {
      std::memcpy(c.x_in.pinned + r0 * pr.d_model * in_size, seq.x.data, n * pr.d_model * in_size);
      continue;
    }
    float* rows_at = reinterpret_cast<float*>(c.qkv_in.pinned) + r0 * width;
    const FloatInput q(seq.q, n * qw);
    for (int64_t r = 0; r < n; ++r) std::memcpy(rows_at + r * width, q.data() + r * qw, qw * 4);
    if (seq.append) {
      const FloatInput k(seq.k, n * kvw), v(seq.v, n * kvw);
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(rows_at + r * width + qw, k.data() + r * kvw, kvw * 4);
        std::memcpy(rows_at + r * width + qw + kvw, v.data() + r * kvw, kvw * 4);
      }
    }
  }
  for (const Staged* x : {&c.qkv_in, &c.x_in}) {
    RETURN_IF_ERROR_STATUS(CopyToDevice(*x, nullptr, stream, "copying the new tokens to the device"));
  }
  return absl::OkStatus();
}

// The kernels' parameters for the call, the new tokens' fp32 q|k|v rows at `qkv`.
cuda::PagedParams ParamsOf(const PagedArgs& a, const CudaBackend::Impl::PagedCall& c, const float* qkv) {
  const PagedProblem& pr = a.problem;
  const HeadSpec& h = pr.heads;
  const int64_t qw = h.q_width(), kvw = h.kv_width();
  cuda::PagedParams p;
  p.sequences = reinterpret_cast<const cuda::PagedSequenceDesc*>(c.descs_in.device);
  p.blocks = reinterpret_cast<char* const*>(c.table_in.device);
  p.units = reinterpret_cast<const cuda::PagedUnit*>(c.units_in.device);
  p.cascade = reinterpret_cast<const int32_t*>(c.cascade_in.device);  // null without shared units
  p.num_sequences = static_cast<int64_t>(c.descs.size());
  p.num_units = static_cast<int64_t>(c.plan.units.size());
  p.num_mma_units = c.plan.mma_units;
  p.rows = c.plan.rows;
  p.q = qkv;
  p.k = qkv + qw;
  p.v = qkv + qw + kvw;
  p.q_stride = p.kv_stride = qw + 2 * kvw;
  p.heads = h.num_heads;
  p.kv_heads = h.num_kv_heads;
  p.head_dim = h.head_dim;
  p.block_tokens = pr.cache.block_tokens;
  p.cache_dtype = pr.cache.dtype;
  if (pr.cache.Quantized()) {
    p.key_part_bytes = pr.cache.KeyBytes();
    p.head_part_bytes = pr.cache.HeadBytes();
  }
  p.scale = h.scale;
  if (h.has_rope()) {
    p.rope = reinterpret_cast<const double*>(c.rope_in.device);
    p.rope_per_sequence = h.rope_scaling.length_dependent();
    p.rope_dim = static_cast<int>(h.rope_dim);
    p.rope_interleaved = h.rope_interleaved;
  }
  p.splits = c.plan.splits;
  p.split_keys = c.plan.split_keys;
  p.shared_splits = c.plan.shared_splits;
  p.shared_split_keys = c.plan.shared_split_keys;
  p.partial_out = reinterpret_cast<float*>(c.partials);
  p.partial_state = p.partial_out + c.plan.rows * h.num_heads * cuda::PagedSlotsOf(c.plan) * h.head_dim;
  p.out = reinterpret_cast<float*>(c.heads_out.device);
  p.weights = reinterpret_cast<float*>(c.weights_out.device);
  float** stats[5] = {&p.lse, &p.entropy, &p.confidence, &p.distance, &p.sink};
  for (int i = 0; i < 5; ++i) *stats[i] = reinterpret_cast<float*>(c.stats_out[i].device);
  p.sink_tokens = a.sequences[0].stats.sink_tokens;
  return p;
}

// The dense sequences (PagedPlan::dense), one after another in the call's dense scratch: their queries and gathered
// K and V in PagedDenseDtype, then the tensor-core flash kernel, causal bottom-right with append (token i
// sees length + i + 1 keys) and over the cache alone without, writing their fp32 rows of the heads' output and the
// statistics asked for.
absl::Status DensePaged(const PagedArgs& a, const CudaBackend::Impl::PagedCall& c, const cuda::PagedParams& p,
                        cudaStream_t stream) {
  const PagedProblem& pr = a.problem;
  const HeadSpec& h = pr.heads;
  for (size_t s = 0; s < a.sequences.size(); ++s) {
    if (!c.plan.dense[s]) continue;
    const PagedSequence& seq = a.sequences[s];
    AttentionShape shape;
    shape.batch = 1;
    shape.q_len = seq.new_tokens;
    shape.kv_len = seq.Keys();
    shape.heads = h;
    shape.heads.causal = seq.append;
    const auto dtype = static_cast<v1::DataType>(cuda::PagedDenseDtype(pr.cache.dtype));
    absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(shape, dtype);
    if (!plan.ok()) return plan.status();
    if (plan->kernel != cuda::FlashKernel::kTensorCore) {
      return absl::InternalError("a dense paged sequence did not get the tensor-core kernel");
    }
    char* q = c.dense_scratch;
    char* k = q + seq.new_tokens * h.q_width() * 2;
    char* v = k + shape.kv_len * h.kv_width() * 2;
    RETURN_IF_CUDA_ERROR(cuda::LaunchPagedDenseInputs(p, static_cast<int64_t>(s), seq.new_tokens, shape.kv_len, q, k,
                                                      v, stream),
                         "gathering a prefill chunk's keys and values");
    cuda::AttentionParams ap = ShapeParams(shape, AttentionMask(), DeviceMask());
    ap.q = q;
    ap.k = k;
    ap.v = v;
    ap.q_row_stride = h.q_width();
    ap.kv_row_stride = h.kv_width();
    ap.dtype = dtype;
    ap.out = c.heads_out.device + c.descs[s].row * h.q_width() * 4;
    ap.out_dtype = cuda::kF32;
    // The statistics asked for: the sequence's [H, n] at H times its first row, the layout the merge writes.
    float** stats[5] = {&ap.lse, &ap.entropy, &ap.confidence, &ap.distance, &ap.sink};
    for (int i = 0; i < 5; ++i) {
      if (c.wanted[i]) *stats[i] = reinterpret_cast<float*>(c.stats_out[i].device) + h.num_heads * c.descs[s].row;
    }
    ap.sink_tokens = p.sink_tokens;
    RETURN_IF_CUDA_ERROR(cuda::LaunchAttention(ap, *plan, stream), "launching a prefill chunk's attention");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::Impl::Paged(const PagedArgs& a) {
  RETURN_IF_ERROR_STATUS(CheckPagedArgs(a));
  const PagedProblem& pr = a.problem;
  for (const PagedSequence& seq : a.sequences) {
    if (pr.d_model > 0 && seq.x.dtype != pr.input_dtype) {
      return absl::InternalError("paged call: a layer input's dtype differs from the problem's");
    }
  }
  PagedCall c;
  DescribePaged(a, props_.multiProcessorCount, c);
  Lease lane(*this);
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const auto [device_bytes, host_bytes] = c.Carve(pr, nullptr, nullptr);
  RETURN_IF_ERROR_STATUS(Reserve(*lane, device_bytes, host_bytes));
  c.Carve(pr, lane->device.data(), lane->host.data());
  cudaStream_t stream = lane->stream;
  RETURN_IF_ERROR_STATUS(StagePaged(a, c, stream));
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));

  // A layer's projections, on its resident copy (or this call's upload of inline weights).
  std::shared_ptr<const DeviceLayer> resident;
  const float* qkv = reinterpret_cast<const float*>(c.qkv_in.device);
  if (c.layer) {
    const AttentionShape s = LayerShape(pr, c.plan.rows);
    RETURN_IF_ERROR_STATUS(LayerOnDevice(*lane, s, a.weights, pr.input_dtype, c.offsets, &c.layer_matrices,
                                         &c.layer_biases, c.layer_staging, &resident));
    RETURN_IF_ERROR_STATUS(ProjectPaged(*lane, pr, a.weights.fused_qkv, c.offsets, c, c.plan.rows));
    qkv = reinterpret_cast<const float*>(c.wide ? c.projected : c.qkv_f32);
  }

  const cuda::PagedParams p = ParamsOf(a, c, qkv);
  RETURN_IF_CUDA_ERROR(cuda::LaunchPagedAppend(p, stream), "launching the cache append");
  RETURN_IF_CUDA_ERROR(cuda::LaunchPagedAttention(p, stream), "launching paged attention");
  RETURN_IF_ERROR_STATUS(DensePaged(a, c, p, stream));
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));
  if (c.layer) RETURN_IF_ERROR_STATUS(OutputPaged(*lane, pr, c.offsets, c, c.plan.rows, c.contribution));
  return FinishPaged(a, c, stream);
}

// Q|K|V = x W (+ b) for a layer session's new rows, in the wire dtype, and widened to fp32 for the kernels.
absl::Status CudaBackend::Impl::ProjectPaged(Lane& lane, const PagedProblem& pr, bool fused,
                                             const LayerOffsets& o, PagedCall& c, int64_t rows) const {
  const int t = pr.input_dtype;
  const int64_t in_size = DTypeSize(pr.input_dtype);
  const int64_t qw = pr.heads.q_width(), kvw = pr.heads.kv_width(), width = qw + 2 * kvw;
  const auto matrix = [&](int64_t offset) { return c.layer_matrices + offset * in_size; };
  const auto bias = [&](int64_t offset) {
    return offset < 0 ? nullptr : c.layer_biases + offset;
  };
  if (fused) {
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, c.x_in.device, rows, pr.d_model, pr.d_model, matrix(o.q), o.ld_q,
                                  bias(o.bq), width, c.projected, width));
  } else {
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, c.x_in.device, rows, pr.d_model, pr.d_model, matrix(o.q), o.ld_q,
                                  bias(o.bq), qw, c.projected, width));
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, c.x_in.device, rows, pr.d_model, pr.d_model, matrix(o.k), o.ld_k,
                                  bias(o.bk), kvw, c.projected + qw * in_size, width));
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, c.x_in.device, rows, pr.d_model, pr.d_model, matrix(o.v), o.ld_v,
                                  bias(o.bv), kvw, c.projected + (qw + kvw) * in_size, width));
  }
  if (t != cuda::kF32) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchConvert(c.projected, t, c.qkv_f32, cuda::kF32, rows * width, lane.stream),
                         "widening the projections");
  }
  return absl::OkStatus();
}

// y = heads W_O (+ b_O) in fp32 for a layer session, and the heads' contributions when asked for.
absl::Status CudaBackend::Impl::OutputPaged(Lane& lane, const PagedProblem& pr, const LayerOffsets& o, PagedCall& c,
                                            int64_t rows, bool contribution) const {
  const int t = pr.input_dtype;
  const int64_t in_size = DTypeSize(pr.input_dtype), qw = pr.heads.q_width();
  const char* heads = c.heads_out.device;
  if (t != cuda::kF32) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchConvert(heads, cuda::kF32, c.heads_t, t, rows * qw, lane.stream),
                         "narrowing the heads");
    heads = c.heads_t;
  }
  const float* b_o = o.bo < 0 ? nullptr : c.layer_biases + o.bo;
  RETURN_IF_ERROR_STATUS(Linear(lane, t, cuda::kF32, heads, rows, qw, qw, c.layer_matrices + o.o * in_size,
                                pr.d_model, b_o, pr.d_model, c.layer_out.device, pr.d_model));
  if (contribution) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchHeadContributions(heads, t, rows, pr.heads.num_heads, pr.heads.head_dim,
                                                       c.layer_matrices + o.o * in_size, t, c.layer_out.device,
                                                       cuda::kF32, pr.d_model,
                                                       reinterpret_cast<float*>(c.contribution_out.device),
                                                       lane.stream),
                         "launching the head contributions");
  }
  return absl::OkStatus();
}

// Copies the outputs back, writes them into each sequence's tensors (narrowed to their dtypes, statistics from
// [H, n] per sequence, contributions from [rows, H]), and returns staged blocks that received new tokens.
absl::Status CudaBackend::Impl::FinishPaged(const PagedArgs& a, PagedCall& c, cudaStream_t stream) const {
  const PagedProblem& pr = a.problem;
  const HeadSpec& h = pr.heads;
  const int64_t bt = pr.cache.block_tokens, block_bytes = pr.cache.BlockBytes();
  std::vector<const Staged*> outputs = {&c.heads_out, &c.weights_out, &c.contribution_out};
  if (pr.d_model > 0) outputs[0] = &c.layer_out;
  for (const Staged& s : c.stats_out) outputs.push_back(&s);
  for (const Staged* s : outputs) RETURN_IF_ERROR_STATUS(StartCopyOut(*s, stream));
  std::vector<std::pair<char*, int64_t>> returned;  // host block, table index
  if (!c.in_place) {
    for (size_t i = 0; i < a.sequences.size(); ++i) {
      const PagedSequence& seq = a.sequences[i];
      if (!seq.append) continue;
      for (int64_t b = seq.length / bt; b <= (seq.length + seq.new_tokens - 1) / bt; ++b) {
        const int64_t index = c.descs[i].block_offset + b;
        RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(seq.blocks[b], c.staged_blocks + index * block_bytes, block_bytes,
                                             cudaMemcpyDeviceToHost, stream),
                             "returning a cache block");
      }
    }
  }
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), "paged attention on the GPU");
  const int64_t width = pr.d_model > 0 ? pr.d_model : h.q_width();
  const float* out = reinterpret_cast<const float*>(outputs[0]->pinned);
  const float* weights = reinterpret_cast<const float*>(c.weights_out.pinned);
  const float* contribution = reinterpret_cast<const float*>(c.contribution_out.pinned);
  for (size_t i = 0; i < a.sequences.size(); ++i) {
    const PagedSequence& seq = a.sequences[i];
    const cuda::PagedSequenceDesc& d = c.descs[i];
    const int64_t n = seq.new_tokens;
    FloatOutput y(seq.out, n * width);
    std::memcpy(y.data(), out + d.row * width, n * width * 4);
    y.Finish();
    if (seq.weights.requested()) {
      const int64_t count = h.num_heads * n * seq.Keys();
      FloatOutput w(seq.weights, count);
      std::memcpy(w.data(), weights + d.weights_offset, count * 4);
      w.Finish();
    }
    const std::array<float*, 5> arrays = StatsArrays(seq.stats);
    for (int k = 0; k < 5; ++k) {
      if (arrays[k] != nullptr && c.stats_out[k].bytes > 0) {
        std::memcpy(arrays[k], reinterpret_cast<const float*>(c.stats_out[k].pinned) + h.num_heads * d.row,
                    h.num_heads * n * 4);
      }
    }
    if (seq.stats.contribution != nullptr && c.contribution_out.bytes > 0) {
      for (int64_t head = 0; head < h.num_heads; ++head) {
        for (int64_t r = 0; r < n; ++r) {
          seq.stats.contribution[head * n + r] = contribution[(d.row + r) * h.num_heads + head];
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SupportsPaged(const PagedProblem& problem) const {
  const HeadSpec& h = problem.heads;
  if (problem.mixed_inputs) {
    return absl::UnimplementedError("the CUDA backend computes one input dtype per call; this call's items mix them");
  }
  if (h.head_dim > cuda::kMaxHeadDim) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA paged kernels compute head_dim up to ", cuda::kMaxHeadDim, ", got ", h.head_dim));
  }
  for (int64_t n : {problem.new_tokens, problem.d_model, h.q_width() + 2 * h.kv_width()}) {
    if (n > INT_MAX) {
      return absl::UnimplementedError(absl::StrCat("a dimension of ", n, " exceeds cuBLAS's 32-bit sizes"));
    }
  }
  return absl::OkStatus();
}

int64_t CudaBackend::PagedWorkspaceBytes(const PagedProblem& problem) const {
  const HeadSpec& h = problem.heads;
  const int64_t rows = problem.new_tokens;
  // The splits are at most 2 per multiprocessor of the largest GPUs (about 132) and one per kMinSplitKeys keys.
  // Where sequences may form cascade groups, as many again for the shared splits (paged_plan.h: the split kernel's
  // equal the splits, the cascade kernel's are at most one per kMinCascadeSplitKeys keys).
  const int64_t splits = std::clamp<int64_t>(problem.max_length / cuda::kMinSplitKeys, 1, 264);
  const int64_t slots = problem.sequences > 1 ? 2 * splits : splits;
  int64_t bytes = rows * h.num_heads * slots * (h.head_dim + 5) * 4;
  // The dense path's q, k and v of its largest sequence (paged_plan.h).
  bytes += (problem.max_new_tokens * h.q_width() + 2 * problem.max_length * h.kv_width()) * 2;
  bytes += rows * (h.q_width() + 2 * h.kv_width()) * 8;  // inputs (fp32) and projections
  bytes += rows * std::max<int64_t>(problem.d_model, h.q_width()) * 8;  // heads and output
  if (problem.return_weights) bytes += h.num_heads * rows * problem.max_length * 4;
  return bytes;
}

absl::Status CudaBackend::PagedAttention(const PagedArgs& args) {
  RETURN_IF_ERROR_STATUS(SupportsPaged(args.problem));
  return impl_->Paged(args);
}

}  // namespace mha
