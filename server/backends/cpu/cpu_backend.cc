#include "server/backends/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/attention_core.h"
#include "server/backends/cpu/bf16_matmul.h"
#include "server/backends/cpu/cpu_info.h"
#include "server/backends/cpu/paged_attention.h"
#include "server/backends/cpu/scratch.h"
#include "server/backends/float_io.h"
#include "server/backends/rope.h"
#include "server/backends/synthetic.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

// Sets the calling thread's OpenMP thread count for a scope, and makes sure every team gets that many threads:
// oneDNN's sgemm splits its work for omp_get_max_threads() threads and computes only the parts of the threads its
// team has, so with OMP_DYNAMIC=true (on a loaded machine) or an OMP_THREAD_LIMIT below the count it left part of
// every projection zero.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()), saved_dynamic_(omp_get_dynamic()) {
    omp_set_dynamic(0);
    omp_set_num_threads(std::min(threads, omp_get_thread_limit()));
  }
  ~ScopedOmpThreads() {
    omp_set_num_threads(saved_);
    omp_set_dynamic(saved_dynamic_);
  }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  const int saved_;
  const int saved_dynamic_;
};

// Where FloatInput and FloatOutput convert on this backend: a buffer the calling thread keeps across calls (a fresh
// 8 MB buffer per call paid for its page faults, more than for the conversion), converted by the calling thread's
// OpenMP team in pieces of 64K elements.
class KeptBuffer final : public ConversionSpace {
 public:
  float* Room(int64_t count) override { return cpu::Grown(buffer_, count); }
  void ForEachPiece(int64_t count, absl::FunctionRef<void(int64_t, int64_t)> convert) override {
    constexpr int64_t kPiece = int64_t{1} << 16;
    const int64_t pieces = (count + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static) if (pieces > 1)
    for (int64_t p = 0; p < pieces; ++p) convert(p * kPiece, std::min(kPiece, count - p * kPiece));
  }
  void ReleaseIfLarge(int64_t kept) { cpu::ReleaseIfLarge(buffer_, kept); }

 private:
  cpu::ScratchVector<float> buffer_;
};

// Buffers a MultiHeadAttention call reuses from the previous call on the same thread (grown on demand, kept up to
// cpu::kKeptCallScratchBytes each): per thread, so that concurrent calls never share them.
struct CallScratch {
  cpu::ScratchVector<float> projected;  // Q|K|V projections
  cpu::ScratchVector<uint16_t> projected16;  // the same in bf16, for a bf16 attention core
  cpu::ScratchVector<float> heads;      // concatenated head outputs [B Tq, H d_k]
  cpu::ScratchVector<uint16_t> heads16;  // the same in bf16, for the bf16 output projection
  // fp32 copies of 16-bit (or unaligned) inputs and fp32 room for 16-bit outputs.
  KeptBuffer inputs[3], output, weights;
  cpu::ScratchVector<float> rotated_q, rotated_k;  // RoPE'd copies of an attention-core call's q and k
};

CallScratch& ThreadScratch() {
  thread_local CallScratch scratch;
  return scratch;
}

// Frees the calling thread's call scratch beyond cpu::kKeptCallScratchBytes when a call ends, however it ends.
class ScratchTrim {
 public:
  // Enough for the activations of an (8, 512, 512) call; a larger call's conversion buffers are freed at its end.
  static constexpr int64_t kKeptConversionBytes = int64_t{16} << 20;

  explicit ScratchTrim(CallScratch& scratch) : scratch_(scratch) {}
  ~ScratchTrim() {
    cpu::ReleaseIfLarge(scratch_.projected, cpu::kKeptCallScratchBytes);
    cpu::ReleaseIfLarge(scratch_.projected16, cpu::kKeptCallScratchBytes);
    cpu::ReleaseIfLarge(scratch_.heads, cpu::kKeptCallScratchBytes);
    cpu::ReleaseIfLarge(scratch_.heads16, cpu::kKeptCallScratchBytes);
    cpu::ReleaseIfLarge(scratch_.rotated_q, cpu::kKeptCallScratchBytes);
    cpu::ReleaseIfLarge(scratch_.rotated_k, cpu::kKeptCallScratchBytes);
    for (KeptBuffer& buffer : scratch_.inputs) buffer.ReleaseIfLarge(kKeptConversionBytes);
    scratch_.output.ReleaseIfLarge(kKeptConversionBytes);
    scratch_.weights.ReleaseIfLarge(kKeptConversionBytes);
  }
  ScratchTrim(const ScratchTrim&) = delete;
  ScratchTrim& operator=(const ScratchTrim&) = delete;

 private:
  CallScratch& scratch_;
};

// Calls above this many FLOPs poll their StopSignal; smaller ones finish within a millisecond anyway.
constexpr double kStopCheckFlops = 1e8;
// A projection runs in slices of rows of about this many FLOPs (tens of milliseconds), polling the StopSignal
// between them; one slice keeps sgemm's efficiency on every shape we serve.
constexpr double kProjectionSliceFlops = 8e9;

// y[m, n] (row stride ldy) = x[m, k] (row stride ldx) w[k, n] (row stride ldw) + bias[n] (bias may be null), on
// oneDNN's sgemm (faster than the matmul primitive on every projection shape we serve: docs/DESIGN.md, projections).
// The bias is broadcast into y first and accumulated with beta = 1. `stop` (may be null) is polled between slices.
absl::Status Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                    int64_t n, float* y, int64_t ldy, const StopSignal* stop) {
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * ldy, bias, n * sizeof(float));
  }
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
  const int64_t slices =
      stop == nullptr ? 1 : std::max<int64_t>(1, static_cast<int64_t>(flops / kProjectionSliceFlops));
  const int64_t rows = (m + slices - 1) / slices;
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    if (stop != nullptr) {
      if (absl::Status status = stop->Check(); !status.ok()) return status;
    }
    const int64_t r = std::min(rows, m - r0);
    const dnnl_status_t status = dnnl_sgemm('N', 'N', r, n, k, 1.0f, x + r0 * ldx, ldx, w, ldw,
                                            bias != nullptr ? 1.0f : 0.0f, y + r0 * ldy, ldy);
    if (status != dnnl_success) {
      return absl::InternalError(absl::StrCat("oneDNN's sgemm failed in a ", r, "x", k, "x", n,
                                              " projection (dnnl_status_t ", static_cast<int>(status), ")"));
    }
  }
  return absl::OkStatus();
}

// RoPE on a stateless call's projected q [B, Tq, H, d_k] and k [B, Tk, Hkv, d_k] (fp32 or bf16, in place): keys at
// 0..Tk-1, queries bottom-right aligned at Tk-Tq..Tk-1.
void RotateStateless(const AttentionShape& s, cpu::Packed q, cpu::Packed k) {
  const HeadSpec& h = s.heads;
  if (!h.has_rope()) return;
  const int64_t first = std::min<int64_t>(0, s.kv_len - s.q_len);
  const RopeAngles angles(h, first, s.kv_len - first);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t q0 = b * s.q_len * q.row_stride, k0 = b * s.kv_len * k.row_stride;
    if (q.bf16 != nullptr) {
      angles.RotateRows(s.q_len, s.kv_len - s.q_len, h.num_heads, const_cast<uint16_t*>(q.bf16) + q0, q.row_stride);
      angles.RotateRows(s.kv_len, 0, h.num_kv_heads, const_cast<uint16_t*>(k.bf16) + k0, k.row_stride);
    } else {
      angles.RotateRows(s.q_len, s.kv_len - s.q_len, h.num_heads, const_cast<float*>(q.data) + q0, q.row_stride);
      angles.RotateRows(s.kv_len, 0, h.num_kv_heads, const_cast<float*>(k.data) + k0, k.row_stride);
    }
  }
}

// The new tokens' q, k and v of a paged call, rows one sequence after another (PagedRows): projected from their x
// with the layer's weights, or decoded from the projected tensors. Q|K|V as one product for a fused layer. The rows
// are the call's scratch: RoPE rotates them in place.
absl::StatusOr<cpu::PagedQkv> ProjectPaged(const PagedArgs& a, const cpu::PagedRows& rows, CallScratch& scratch,
                                              const StopSignal* stop) {
  const PagedProblem& p = a.problem;
  const HeadSpec& h = p.heads;
  const int64_t qw = h.q_width(), kvw = h.kv_width(), n = rows.total;
  float* projected = cpu::Grown(scratch.projected, n * (qw + 2 * kvw));
  if (p.d_model == 0) {
    const cpu::PagedQkv out{projected, projected + n * qw, projected + n * (qw + kvw), qw, kvw, kvw};
    cpu::ForEachSequence(a.sequences, [&](size_t s) {
      const PagedSequence& seq = a.sequences[s];
      const int64_t r0 = rows.first_row[s];
      const struct {
        const ConstTensor& from;
        float* to;
        int64_t width;
      } parts[] = {{seq.q, out.q + r0 * qw, qw}, {seq.k, out.k + r0 * kvw, kvw}, {seq.v, out.v + r0 * kvw, kvw}};
      // Without append, k and v may be absent (and are unused); zeros stand in.
      for (int part = 1; part < 3; ++part) {
        if (parts[part].from.data == nullptr) std::fill_n(parts[part].to, seq.new_tokens * parts[part].width, 0.0f);
      }
      // A prefill's rows are megabytes: decoded on the call's threads, a piece each.
      constexpr int64_t kPieceRows = 64;
      const int64_t pieces = (seq.new_tokens + kPieceRows - 1) / kPieceRows;
#pragma omp parallel for schedule(static) collapse(2) if (pieces > 1)
      for (int part = 0; part < 3; ++part) {
        for (int64_t piece = 0; piece < pieces; ++piece) {
          const int64_t first = piece * kPieceRows, count = std::min(kPieceRows, seq.new_tokens - first);
          const int64_t width = parts[part].width;
          if (parts[part].from.data == nullptr) continue;
          DecodeToFloat(parts[part].from.dtype,
                        static_cast<const char*>(parts[part].from.data) +
                            first * width * static_cast<int64_t>(DTypeSize(parts[part].from.dtype)),
                        count * width, parts[part].to + first * width);
        }
      }
    });
    return out;
  }
  const LayerWeights& w = a.weights;
  float* x = scratch.inputs[0].Room(n * p.d_model);
  cpu::ForEachSequence(a.sequences, [&](size_t s) {
    const PagedSequence& seq = a.sequences[s];
    DecodeToFloat(seq.x.dtype, seq.x.data, seq.new_tokens * p.d_model, x + rows.first_row[s] * p.d_model);
  });
  if (w.fused_qkv) {
    const int64_t width = qw + 2 * kvw;
    if (absl::Status status = Linear(x, n, p.d_model, p.d_model, w.w_q, w.ld_q, w.b_q, width, projected, width, stop);
        !status.ok()) {
      return status;
    }
    return cpu::PagedQkv{projected, projected + qw, projected + qw + kvw, width, width, width};
  }
  const cpu::PagedQkv out{projected, projected + n * qw, projected + n * (qw + kvw), qw, kvw, kvw};
  absl::Status status = Linear(x, n, p.d_model, p.d_model, w.w_q, w.ld_q, w.b_q, qw, out.q, qw, stop);
  if (status.ok()) status = Linear(x, n, p.d_model, p.d_model, w.w_k, w.ld_k, w.b_k, kvw, out.k, kvw, stop);
  if (status.ok()) status = Linear(x, n, p.d_model, p.d_model, w.w_v, w.ld_v, w.b_v, kvw, out.v, kvw, stop);
  if (!status.ok()) return status;
  return out;
}

// Squared norms of rows of a [rows, n] product, in double.
void RowSquares(const float* y, int64_t rows, int64_t n, int64_t ld, float* out) {
#pragma omp parallel for schedule(static) if (rows * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < n; ++c) sum += static_cast<double>(y[r * ld + c]) * y[r * ld + c];
    out[r] = static_cast<float>(sum);
  }
}

// contribution[(b H + h) Tq + i] = ||heads[b Tq + i, head h] W_O[h]|| / ||out[b Tq + i]|| (0 for a zero output
// row), heads fp32 [B Tq, H d_k] after the head mask, out fp32 [B Tq, d_model]. For many rows through each head's
// Gram matrix G = W_O[h] W_O[h]^T (d_k x d_k): ||x W||^2 = x G x^T costs d_k^2 per row instead of d_k d_model; for
// few rows (a decode step) G would cost more than the rows, so the product itself.
absl::Status HeadContributions(const HeadSpec& h, int64_t batch, int64_t q_len, int64_t d_model, const float* heads,
                               const float* w_o, const float* out, float* contribution, const StopSignal* stop) {
  const int64_t rows = batch * q_len, dk = h.head_dim, qw = h.q_width();
  const bool gram = rows > dk;
  std::vector<float> out_square(rows), square(rows), term(rows * (gram ? dk : d_model)), g(gram ? dk * dk : 0);
  RowSquares(out, rows, d_model, d_model, out_square.data());
  for (int64_t head = 0; head < h.num_heads; ++head) {
    if (stop != nullptr) RETURN_IF_ERROR(stop->Check());
    const float* x = heads + head * dk;
    const float* w = w_o + head * dk * d_model;
    if (gram) {
      dnnl_status_t status = dnnl_sgemm('N', 'T', dk, dk, d_model, 1.0f, w, d_model, w, d_model, 0.0f, g.data(), dk);
      if (status == dnnl_success) {
        status = dnnl_sgemm('N', 'N', rows, dk, dk, 1.0f, x, qw, g.data(), dk, 0.0f, term.data(), dk);
      }
      if (status != dnnl_success) return absl::InternalError("oneDNN sgemm failed in the head contributions");
#pragma omp parallel for schedule(static) if (rows * dk > (1 << 16))
      for (int64_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (int64_t c = 0; c < dk; ++c) sum += static_cast<double>(x[r * qw + c]) * term[r * dk + c];
        square[r] = static_cast<float>(std::max(sum, 0.0));
      }
    } else {
      RETURN_IF_ERROR(Linear(x, rows, dk, qw, w, d_model, nullptr, d_model, term.data(), d_model, nullptr));
      RowSquares(term.data(), rows, d_model, d_model, square.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      contribution[((r / q_len) * h.num_heads + head) * q_len + r % q_len] =
          out_square[r] > 0 ? std::sqrt(square[r] / out_square[r]) : 0.0f;
    }
  }
  return absl::OkStatus();
}

// RoPE on each sequence's new q and k rows at their cache positions.
void RotatePaged(const PagedArgs& a, const cpu::PagedRows& rows, const cpu::PagedQkv& qkv) {
  const HeadSpec& h = a.problem.heads;
  if (!h.has_rope()) return;
  cpu::ForEachSequence(a.sequences, [&](size_t s) {
    const PagedSequence& seq = a.sequences[s];
    const RopeAngles angles(h, seq.length, seq.new_tokens);
    const int64_t r0 = rows.first_row[s];
    angles.RotateRows(seq.new_tokens, seq.length, h.num_heads, qkv.q + r0 * qkv.ldq, qkv.ldq);
    angles.RotateRows(seq.new_tokens, seq.length, h.num_kv_heads, qkv.k + r0 * qkv.ldk, qkv.ldk);
  });
}

// How a layer call (MultiHeadAttention) runs: bf16 projections straight from the wire's bytes (`bf16`), writing
// Q, K and V in bf16 for a bf16 attention core (`bf16_qkv`); the bf16 set's fast conversion, where there is one;
// the stop signal it checks.
struct LayerPath {
  bool bf16 = false;
  bool bf16_qkv = false;
  void (*to_bf16)(int64_t n, const float* src, uint16_t* dst) = nullptr;
  const StopSignal* stop = nullptr;
};

// Q, K and V of a layer call, projected into the scratch's projections (one product for Q|K|V where the call is
// self-attention on a fused layer, each then read through the fused row stride), as the attention core reads them.
absl::Status ProjectQkv(const MhaArgs& a, const LayerPath& path, CallScratch& scratch, cpu::Packed* q,
                        cpu::Packed* k, cpu::Packed* v) {
  const AttentionShape& s = a.shape;
  const LayerWeights& w = a.weights;
  const int64_t q_width = s.heads.q_width(), kv_width = s.heads.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const bool bf16 = path.bf16;
  const FloatInput query_in(bf16 ? ConstTensor{} : a.query, q_rows * s.d_model, &scratch.inputs[0]);
  const FloatInput key_in(bf16 || a.kv_source == KvSource::kQuery ? ConstTensor{} : a.key, kv_rows * s.d_kv_in,
                          &scratch.inputs[1]);
  const FloatInput value_in(!bf16 && a.kv_source == KvSource::kKeyValue ? a.value : ConstTensor{},
                            kv_rows * s.d_v_in, &scratch.inputs[2]);
  const float* query = query_in.data();
  const float* key_data = a.kv_source == KvSource::kQuery ? query : key_in.data();
  const float* value_data = a.kv_source == KvSource::kKeyValue ? value_in.data() : key_data;
  const void* key_bytes = a.kv_source == KvSource::kQuery ? a.query.data : a.key.data;
  const void* value_bytes = a.kv_source == KvSource::kKeyValue ? a.value.data : key_bytes;
  // y = x W + b on the path this call takes; x is fp32 (sgemm) or the wire's bf16 bytes, y is fp32, or bf16 with
  // bf16_qkv. Offsets and strides are in elements.
  const bool fused = a.kv_source == KvSource::kQuery && w.fused_qkv;
  const int64_t qkv_count = fused ? q_rows * (q_width + 2 * kv_width) : q_rows * q_width + 2 * kv_rows * kv_width;
  float* projected = path.bf16_qkv ? nullptr : cpu::Grown(scratch.projected, qkv_count);
  uint16_t* projected16 = path.bf16_qkv ? cpu::Grown(scratch.projected16, qkv_count) : nullptr;
  const auto project = [&](const float* x, const void* x16, int64_t rows, int64_t in, const float* wm, int64_t ld,
                           const float* b, int64_t n, int64_t y_offset, int64_t ldy) {
    if (path.bf16_qkv) {
      return cpu::MatmulBf16(x16, rows, in, in, {wm, ld, w.resident_id}, b, n, projected16 + y_offset,
                             cpu::MatmulOut::kBF16, ldy, path.stop);
    }
    if (bf16) {
      return cpu::MatmulBf16(x16, rows, in, in, {wm, ld, w.resident_id}, b, n, projected + y_offset,
                             cpu::MatmulOut::kF32, ldy, path.stop);
    }
    return Linear(x, rows, in, in, wm, ld, b, n, projected + y_offset, ldy, path.stop);
  };
  // Q, K or V at `offset` elements of the projections, `stride` elements per row.
  const auto packed = [&](int64_t offset, int64_t stride) {
    return path.bf16_qkv ? cpu::Packed{nullptr, stride, projected16 + offset}
                         : cpu::Packed{projected + offset, stride};
  };
  if (fused) {
    const int64_t width = q_width + 2 * kv_width;
    RETURN_IF_ERROR(project(query, a.query.data, q_rows, s.d_model, w.w_q, w.ld_q, w.b_q, width, 0, width));
    *q = packed(0, width);
    *k = packed(q_width, width);
    *v = packed(q_width + kv_width, width);
    return absl::OkStatus();
  }
  const int64_t k_offset = q_rows * q_width, v_offset = k_offset + kv_rows * kv_width;
  RETURN_IF_ERROR(project(query, a.query.data, q_rows, s.d_model, w.w_q, w.ld_q, w.b_q, q_width, 0, q_width));
  RETURN_IF_ERROR(
      project(key_data, key_bytes, kv_rows, s.d_kv_in, w.w_k, w.ld_k, w.b_k, kv_width, k_offset, kv_width));
  RETURN_IF_ERROR(
      project(value_data, value_bytes, kv_rows, s.d_v_in, w.w_v, w.ld_v, w.b_v, kv_width, v_offset, kv_width));
  *q = packed(0, q_width);
  *k = packed(k_offset, kv_width);
  *v = packed(v_offset, kv_width);
  return absl::OkStatus();
}

// A layer call's concatenated heads [B Tq, H d_k]: in fp32 (`fp32`), and in bf16 (`bf16`) for the bf16 output
// product; `bf16_only` when the attention core wrote them in bf16 alone.
struct HeadsOut {
  float* fp32 = nullptr;
  uint16_t* bf16 = nullptr;
  bool bf16_only = false;
};

// The head mask applied to the fp32 heads, then the output projection: sgemm in fp32, or for the bf16 path the
// heads in bf16 (unless the core wrote them so) and oneDNN's bf16 matmul writing a bf16 output in place, or fp32
// (converted after for fp16).
absl::Status ProjectOutput(const MhaArgs& a, const LayerPath& path, const HeadsOut& heads, CallScratch& scratch) {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const LayerWeights& w = a.weights;
  const int64_t q_rows = s.batch * s.q_len, q_width = h.q_width();
  if (!a.head_mask.empty()) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q_rows; ++r) {
      for (int64_t head = 0; head < h.num_heads; ++head) {
        float* row = heads.fp32 + r * q_width + head * h.head_dim;
        for (int64_t c = 0; c < h.head_dim; ++c) row[c] *= a.head_mask[head];
      }
    }
  }
  if (!path.bf16) {
    FloatOutput out(a.out, q_rows * s.d_model, &scratch.output);
    RETURN_IF_ERROR(Linear(heads.fp32, q_rows, q_width, q_width, w.w_o, s.d_model, w.b_o, s.d_model, out.data(),
                           s.d_model, path.stop));
    out.Finish();
    return absl::OkStatus();
  }
  // On the call's threads, with AVX512-BF16's conversion where the CPU has it (one thread converting stood out in
  // a large bf16 call's profile).
  constexpr int64_t kChunkRows = 64;
  if (!heads.bf16_only) {
#pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < q_rows; r0 += kChunkRows) {
      const int64_t n = std::min(kChunkRows, q_rows - r0) * q_width;
      if (path.to_bf16 != nullptr) {
        path.to_bf16(n, heads.fp32 + r0 * q_width, heads.bf16 + r0 * q_width);
      } else {
        EncodeFromFloat(v1::BF16, heads.fp32 + r0 * q_width, n, heads.bf16 + r0 * q_width);
      }
    }
  }
  const cpu::Bf16Weights w_o{w.w_o, s.d_model, w.resident_id};
  if (a.out.dtype == v1::BF16) {
    return cpu::MatmulBf16(heads.bf16, q_rows, q_width, q_width, w_o, w.b_o, s.d_model, a.out.data,
                           cpu::MatmulOut::kBF16, s.d_model, path.stop);
  }
  FloatOutput out(a.out, q_rows * s.d_model, &scratch.output);
  RETURN_IF_ERROR(cpu::MatmulBf16(heads.bf16, q_rows, q_width, q_width, w_o, w.b_o, s.d_model, out.data(),
                                  cpu::MatmulOut::kF32, s.d_model, path.stop));
  out.Finish();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(absl::string_view tile_kernels, bool bf16) {
  // A 1x1x1 product proves that oneDNN loads and runs here.
  const float one = 1.0f;
  float out = 0.0f;
  if (dnnl_sgemm('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &out, 1) != dnnl_success || out != 1.0f) {
    return absl::UnavailableError("oneDNN's sgemm does not run on this machine");
  }
  std::vector<const kernels::TileKernels*> tiles;
  // The bf16 attention core: amx's tiles where the CPU has them, else AVX512-BF16's dot products.
  const bool named_bf16 = tile_kernels == "amx" || tile_kernels == "avx512bf16";
  const kernels::TileKernels* bf16_tiles = nullptr;
  if (bf16 && named_bf16) {
    bf16_tiles = kernels::TileKernelsFor(std::string(tile_kernels).c_str());
  } else if (bf16) {
    bf16_tiles = kernels::TileKernelsFor("amx");
    if (bf16_tiles == nullptr) bf16_tiles = kernels::TileKernelsFor("avx512bf16");
  }
  if (named_bf16 && bf16_tiles == nullptr) {
    return absl::UnavailableError(bf16 ? absl::StrCat("this CPU does not run the ", tile_kernels, " tile kernels")
                                       : absl::StrCat("the ", tile_kernels,
                                                      " tile kernels are for bf16 requests, which this backend "
                                                      "computes in fp32"));
  }
  if (tile_kernels == "auto" || named_bf16) {
    for (const char* isa : {"avx512", "avx2", "portable"}) {
      if (const kernels::TileKernels* k = kernels::TileKernelsFor(isa); k != nullptr) tiles.push_back(k);
    }
  } else if (tile_kernels == "avx512" || tile_kernels == "avx2" || tile_kernels == "portable") {
    const kernels::TileKernels* k = kernels::TileKernelsFor(std::string(tile_kernels).c_str());
    if (k == nullptr) {
      return absl::UnavailableError(absl::StrCat("this CPU does not run the ", tile_kernels, " tile kernels"));
    }
    tiles.push_back(k);
    bf16_tiles = nullptr;  // an fp32 set named: every request's attention core on it
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown tile kernels \"", tile_kernels,
                                                   "\"; expected auto, amx, avx512bf16, avx512, avx2 or portable"));
  }
  const bool bf16_projections = bf16 && !cpu::NativeBf16Matmul().empty();
  // bf16 and FP8 caches decode on the bf16 set's dot products where its attention core serves bf16 requests (the
  // device string says "bf16 attention on ..." then).
  if (!bf16_projections) bf16_tiles = nullptr;
  const kernels::PagedKernels* bf16_cache_decode = bf16_tiles != nullptr ? bf16_tiles->paged : nullptr;
  return std::unique_ptr<CpuBackend>(
      new CpuBackend(std::move(tiles), bf16_tiles, bf16_projections, bf16_cache_decode));
}

std::string CpuBackend::device() const {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(cpu::CpuModelName(), " (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ",
                      tile_kernels_.front()->isa, " attention tiles, ",
                      bf16_ ? absl::StrCat("bf16 projections on ", cpu::NativeBf16Matmul())
                            : std::string("fp32 projections only"),
                      bf16_tiles_ != nullptr ? absl::StrCat(", bf16 attention on ", bf16_tiles_->isa, " tiles") : "",
                      ", ", omp_get_max_threads(), " OpenMP threads)");
}

const kernels::TileKernels& CpuBackend::KernelsFor(int64_t head_dim) const {
  for (const kernels::TileKernels* k : tile_kernels_) {
    if (head_dim % k->lanes == 0) return *k;
  }
  return *tile_kernels_.front();
}

const kernels::TileKernels& CpuBackend::KernelsFor(int64_t head_dim, bool bf16_operands) const {
  if (bf16_operands && bf16_tiles_ != nullptr && head_dim % bf16_tiles_->lanes == 0) return *bf16_tiles_;
  return KernelsFor(head_dim);
}

const kernels::PagedKernels& CpuBackend::DecodeKernelsFor(const kernels::TileKernels& tiles,
                                                          v1::DataType dtype) const {
  const bool on_bf16 = dtype == v1::BF16 || dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2;
  if (on_bf16 && bf16_cache_decode_ != nullptr) return bf16_cache_decode_[dtype - 1];
  return tiles.paged[dtype - 1];
}

v1::DataType CpuBackend::ComputeDtype(const AttentionProblem& problem) const {
  if (!bf16_ || problem.input_dtype != v1::BF16) return v1::FP32;
  if (problem.shape.has_projections()) return v1::BF16;
  // The attention core alone: in bf16 where the bf16 set takes this head_dim, else fp32.
  return &KernelsFor(problem.shape.heads.head_dim, /*bf16_operands=*/true) == bf16_tiles_ ? v1::BF16 : v1::FP32;
}

int64_t CpuBackend::WorkspaceBytes(const AttentionProblem& problem) const {
  const AttentionShape& s = problem.shape;
  const HeadSpec& h = s.heads;
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const int64_t weights = problem.return_weights ? s.batch * h.num_heads * s.q_len * s.kv_len : 0;
  int64_t floats = 0;
  if (s.has_projections()) {
    floats += q_rows * 2 * h.q_width() + 2 * kv_rows * h.kv_width();  // Q, K, V and the concatenated heads
    if (problem.input_dtype != v1::FP32) floats += q_rows * s.d_model + kv_rows * (s.d_kv_in + s.d_v_in);
    if (problem.output_dtype != v1::FP32) floats += q_rows * s.d_model + weights;
    if (ComputeDtype(problem) == v1::BF16) floats += q_rows * h.q_width() / 2;  // the heads in bf16
  } else {
    const int64_t q = q_rows * h.q_width(), kv = kv_rows * h.kv_width();
    if (problem.input_dtype != v1::FP32) floats += q + 2 * kv;
    if (problem.output_dtype != v1::FP32) floats += q + weights;
  }
  return floats * static_cast<int64_t>(sizeof(float)) +
         omp_get_num_procs() * std::max(cpu::AttendScratchBytesPerThread(KernelsFor(h.head_dim), s),
                                        cpu::AttendScratchBytesPerThread(
                                            KernelsFor(h.head_dim, ComputeDtype(problem) == v1::BF16), s));
}

absl::StatusOr<double> CpuBackend::WarmUp() {
  // The first call pays for oneDNN's start-up and code generation and for the OpenMP thread pool (tens of ms).
  return RunSyntheticLayer(*this, 256, 512, 8);
}

absl::Status CpuBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const double flops = AttentionFlops(s);
  ScopedOmpThreads threads(flops <= kSerialFlops ? 1 : omp_get_max_threads());
  const StopSignal* stop = flops > kStopCheckFlops ? a.stop : nullptr;
  const int64_t q_count = s.batch * s.q_len * h.q_width(), kv_count = s.batch * s.kv_len * h.kv_width();
  CallScratch& scratch = ThreadScratch();
  const ScratchTrim trim(scratch);
  // Q, K and V all bf16: they are exact in bf16, so the bf16 set multiplies them as sent (ComputeDtype), and reads
  // them in place where each is 2-byte aligned (no fp32 copy twice their size).
  AttentionProblem problem;
  problem.shape = s;
  problem.input_dtype = a.q.dtype;
  const bool bf16 = ComputeDtype(problem) == v1::BF16 && a.k.dtype == v1::BF16 && a.v.dtype == v1::BF16;
  const kernels::TileKernels& tiles = KernelsFor(h.head_dim, bf16);
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % alignof(uint16_t) == 0; };
  // RoPE rotates private fp32 copies of q and k.
  const bool in_place = bf16 && tiles.elements_per_float == 2 && aligned16(a.q.data) && aligned16(a.k.data) &&
                        aligned16(a.v.data) && !h.has_rope();
  const FloatInput q(in_place ? ConstTensor{} : a.q, q_count, &scratch.inputs[0]);
  const FloatInput k(in_place ? ConstTensor{} : a.k, kv_count, &scratch.inputs[1]);
  const FloatInput v(in_place ? ConstTensor{} : a.v, kv_count, &scratch.inputs[2]);
  // A bf16 output the same way.
  const bool out_in_place = in_place && a.out.dtype == v1::BF16 && aligned16(a.out.data);
  FloatOutput out(out_in_place ? MutableTensor{} : a.out, q_count, &scratch.output);
  FloatOutput weights(a.weights, s.batch * h.num_heads * s.q_len * s.kv_len, &scratch.weights);
  const auto packed = [&](const FloatInput& fp32, const ConstTensor& wire, int64_t stride) {
    return in_place ? cpu::Packed{nullptr, stride, static_cast<const uint16_t*>(wire.data)}
                    : cpu::Packed{fp32.data(), stride};
  };
  const cpu::PackedOut packed_out = out_in_place
                                        ? cpu::PackedOut{nullptr, h.q_width(), static_cast<uint16_t*>(a.out.data)}
                                        : cpu::PackedOut{out.data(), h.q_width()};
  cpu::Packed q_in = packed(q, a.q, h.q_width()), k_in = packed(k, a.k, h.kv_width());
  if (h.has_rope()) {
    float* rotated_q = cpu::Grown(scratch.rotated_q, q_count);
    float* rotated_k = cpu::Grown(scratch.rotated_k, kv_count);
    std::copy_n(q.data(), q_count, rotated_q);
    std::copy_n(k.data(), kv_count, rotated_k);
    q_in = {rotated_q, h.q_width()};
    k_in = {rotated_k, h.kv_width()};
    RotateStateless(s, q_in, k_in);
  }
  absl::Status status =
      cpu::Attend(tiles, s, a.mask, q_in, k_in, packed(v, a.v, h.kv_width()), packed_out, weights.data(), stop,
                  a.stats);
  if (!status.ok()) return status;
  out.Finish();
  weights.Finish();
  return absl::OkStatus();
}

absl::Status CpuBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const double flops = AttentionFlops(s);
  ScopedOmpThreads threads(flops <= kSerialFlops ? 1 : omp_get_max_threads());
  CallScratch& scratch = ThreadScratch();
  const ScratchTrim trim(scratch);

  // bf16 requests on a CPU with native bf16 arithmetic project on oneDNN's bf16 matmul straight from the wire
  // bytes; everything else decodes to fp32 and projects with sgemm.
  // Only when every activation the call reads is bf16 (a request may mix dtypes).
  AttentionProblem problem;
  problem.shape = s;
  problem.input_dtype = a.query.dtype;
  LayerPath path;
  path.stop = flops > kStopCheckFlops ? a.stop : nullptr;
  path.bf16 = ComputeDtype(problem) == v1::BF16 &&
              (a.kv_source == KvSource::kQuery || a.key.dtype == v1::BF16) &&
              (a.kv_source != KvSource::kKeyValue || a.value.dtype == v1::BF16);
  // Where a bf16 tile set takes this head_dim, the bf16 projections write Q, K and V in bf16 and the attention core
  // reads them so: its products round them to bf16 anyway, and half the bytes go to memory and back.
  const kernels::TileKernels& tiles = KernelsFor(h.head_dim, path.bf16);
  path.bf16_qkv = path.bf16 && tiles.elements_per_float == 2;
  path.to_bf16 = bf16_tiles_ != nullptr ? bf16_tiles_->to_bf16 : nullptr;

  cpu::Packed q, k, v;
  RETURN_IF_ERROR(ProjectQkv(a, path, scratch, &q, &k, &v));
  RotateStateless(s, q, k);

  FloatOutput weights(a.attention_weights, s.batch * h.num_heads * s.q_len * s.kv_len, &scratch.weights);
  // The heads in fp32, or straight in bf16 for the bf16 output product where the core runs on a bf16 set and no
  // head mask scales them first.
  HeadsOut heads;
  heads.bf16_only = path.bf16_qkv && a.head_mask.empty() && a.stats.contribution == nullptr;
  const int64_t q_rows = s.batch * s.q_len, q_width = h.q_width();
  heads.fp32 = heads.bf16_only ? nullptr : cpu::Grown(scratch.heads, q_rows * q_width);
  heads.bf16 = path.bf16 ? cpu::Grown(scratch.heads16, q_rows * q_width) : nullptr;
  const cpu::PackedOut heads_out =
      heads.bf16_only ? cpu::PackedOut{nullptr, q_width, heads.bf16} : cpu::PackedOut{heads.fp32, q_width};
  RETURN_IF_ERROR(cpu::Attend(tiles, s, a.mask, q, k, v, heads_out, weights.data(), path.stop, a.stats));
  weights.Finish();

  RETURN_IF_ERROR(ProjectOutput(a, path, heads, scratch));
  return Contributions(a, heads.fp32, path.stop);
}

absl::Status CpuBackend::Contributions(const MhaArgs& a, const float* heads, const StopSignal* stop) {
  if (a.stats.contribution == nullptr) return absl::OkStatus();
  // Against the output as returned (rounded to its dtype), so that the ratios describe what the client holds.
  const AttentionShape& s = a.shape;
  const FloatInput out(ConstTensor{a.out.data, a.out.dtype}, s.batch * s.q_len * s.d_model);
  return HeadContributions(s.heads, s.batch, s.q_len, s.d_model, heads, a.weights.w_o, out.data(),
                           a.stats.contribution, stop);
}

int64_t CpuBackend::PagedWorkspaceBytes(const PagedProblem& p) const {
  const HeadSpec& h = p.heads;
  // The new tokens' inputs in fp32, their q, k, v and heads, the layer's fp32 output; the attention's own.
  const int64_t floats = p.new_tokens * (p.d_model + 2 * h.q_width() + 2 * h.kv_width() + p.d_model);
  return floats * static_cast<int64_t>(sizeof(float)) +
         cpu::PagedAttendBytes(KernelsFor(h.head_dim), p, omp_get_num_procs());
}

absl::Status CpuBackend::PagedAttention(const PagedArgs& a) {
  RETURN_IF_ERROR(CheckPagedArgs(a));
  const PagedProblem& p = a.problem;
  const HeadSpec& h = p.heads;
  std::vector<int64_t> first_row;
  cpu::PagedRows rows;
  double flops = 0, cache_bytes = 0;
  for (const PagedSequence& seq : a.sequences) {
    first_row.push_back(rows.total);
    rows.total += seq.new_tokens;
    const double n = static_cast<double>(seq.new_tokens), visible = n * seq.length + n * (n + 1) / 2;
    flops += 4.0 * h.num_heads * h.head_dim * visible;
    cache_bytes += static_cast<double>(seq.length + seq.new_tokens) * p.cache.BlockBytes() / p.cache.block_tokens;
  }
  rows.first_row = first_row;
  if (p.d_model > 0) flops += 2.0 * rows.total * p.d_model * (2 * h.q_width() + 2 * h.kv_width());
  // A decode step reads its caches from memory: more than a few MiB of them deserve every core's share of the
  // bandwidth, whatever their FLOPs.
  const bool serial = flops <= kSerialFlops && cache_bytes <= (4 << 20);
  ScopedOmpThreads threads(serial ? 1 : omp_get_max_threads());
  const StopSignal* stop = flops > kStopCheckFlops || cache_bytes > (64 << 20) ? a.stop : nullptr;
  CallScratch& scratch = ThreadScratch();
  const ScratchTrim trim(scratch);

  ASSIGN_OR_RETURN(const cpu::PagedQkv qkv, ProjectPaged(a, rows, scratch, stop));
  RotatePaged(a, rows, qkv);
  cpu::WriteTokens(p.cache, a.sequences, rows, qkv.k, qkv.ldk, qkv.v, qkv.ldv);
  // One head session's fp32 output is the heads themselves: written in place, not copied after (a prefill's
  // output is megabytes).
  const bool in_place = p.d_model == 0 && a.sequences.size() == 1 && a.sequences[0].out.dtype == v1::FP32;
  float* heads = in_place ? static_cast<float*>(a.sequences[0].out.data)
                          : cpu::Grown(scratch.heads, rows.total * h.q_width());
  const kernels::TileKernels& tiles = KernelsFor(h.head_dim);
  if (absl::Status status = cpu::PagedAttend(tiles, DecodeKernelsFor(tiles, p.cache.dtype), p, a.sequences, rows, qkv,
                                             heads, h.q_width(), stop);
      !status.ok()) {
    return status;
  }
  const int64_t width = p.d_model > 0 ? p.d_model : h.q_width();
  const float* out = heads;
  if (p.d_model > 0) {
    float* projected = scratch.output.Room(rows.total * p.d_model);
    const LayerWeights& w = a.weights;
    if (absl::Status status = Linear(heads, rows.total, h.q_width(), h.q_width(), w.w_o, p.d_model, w.b_o,
                                     p.d_model, projected, p.d_model, stop);
        !status.ok()) {
      return status;
    }
    out = projected;
    for (size_t s = 0; s < a.sequences.size(); ++s) {
      const PagedSequence& seq = a.sequences[s];
      if (seq.stats.contribution == nullptr) continue;
      RETURN_IF_ERROR(HeadContributions(h, 1, seq.new_tokens, p.d_model, heads + first_row[s] * h.q_width(),
                                        w.w_o, projected + first_row[s] * p.d_model, seq.stats.contribution, stop));
    }
  }
  if (in_place) return absl::OkStatus();
  for (size_t s = 0; s < a.sequences.size(); ++s) {
    const PagedSequence& seq = a.sequences[s];
    EncodeFromFloat(seq.out.dtype, out + first_row[s] * width, seq.new_tokens * width, seq.out.data);
  }
  return absl::OkStatus();
}

}  // namespace mha
