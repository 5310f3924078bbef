#include "server/backends/cpu/cpu_backend.h"

#include <omp.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.h"
#include "server/backends/cpu/attention_core.h"
#include "server/backends/cpu/cpu_info.h"
#include "server/backends/float_io.h"

namespace mha {
namespace {

// Sets the calling thread's OpenMP thread count for a scope.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) { omp_set_num_threads(threads); }
  ~ScopedOmpThreads() { omp_set_num_threads(saved_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  const int saved_;
};

// Buffers a MultiHeadAttention call reuses from the previous call on the same thread (grown on demand, kept at the
// largest size seen): per thread, so that concurrent calls never share them.
struct CallScratch {
  std::vector<float> projected;  // Q|K|V projections
  std::vector<float> heads;      // concatenated head outputs [B Tq, H d_k]
};

CallScratch& ThreadScratch() {
  thread_local CallScratch scratch;
  return scratch;
}

float* Grown(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// y[m, n] (row stride ldy) = x[m, k] (row stride ldx) w[k, n] (row stride ldw) + bias[n] (bias may be null), on
// oneDNN's sgemm (measured faster than the matmul primitive on every projection shape we serve: docs/PERFORMANCE.md).
// The bias is broadcast into y first and accumulated with beta = 1.
absl::Status Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                    int64_t n, float* y, int64_t ldy) {
  if (bias != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * ldy, bias, n * sizeof(float));
  }
  const dnnl_status_t status =
      dnnl_sgemm('N', 'N', m, n, k, 1.0f, x, ldx, w, ldw, bias != nullptr ? 1.0f : 0.0f, y, ldy);
  if (status != dnnl_success) {
    return absl::InternalError(absl::StrCat("oneDNN's sgemm failed in a ", m, "x", k, "x", n,
                                            " projection (dnnl_status_t ", static_cast<int>(status), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(absl::string_view tile_kernels) {
  // A 1x1x1 product proves that oneDNN loads and runs here.
  const float one = 1.0f;
  float out = 0.0f;
  if (dnnl_sgemm('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &out, 1) != dnnl_success || out != 1.0f) {
    return absl::UnavailableError("oneDNN's sgemm does not run on this machine");
  }
  std::vector<const kernels::TileKernels*> tiles;
  if (tile_kernels == "auto") {
    for (const char* isa : {"avx512", "avx2", "portable"}) {
      if (const kernels::TileKernels* k = kernels::TileKernelsFor(isa); k != nullptr) tiles.push_back(k);
    }
  } else if (tile_kernels == "avx512" || tile_kernels == "avx2" || tile_kernels == "portable") {
    const kernels::TileKernels* k = kernels::TileKernelsFor(std::string(tile_kernels).c_str());
    if (k == nullptr) {
      return absl::UnavailableError(absl::StrCat("this CPU does not run the ", tile_kernels, " tile kernels"));
    }
    tiles.push_back(k);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown tile kernels \"", tile_kernels, "\"; expected auto, avx512, avx2 or portable"));
  }
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(tiles)));
}

std::string CpuBackend::device() const {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(cpu::CpuModelName(), " (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ",
                      tile_kernels_.front()->isa, " attention tiles, ", omp_get_max_threads(), " OpenMP threads)");
}

const kernels::TileKernels& CpuBackend::KernelsFor(int64_t head_dim) const {
  for (const kernels::TileKernels* k : tile_kernels_) {
    if (head_dim % k->lanes == 0) return *k;
  }
  return *tile_kernels_.front();
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
  } else {
    const int64_t q = q_rows * h.q_width(), kv = kv_rows * h.kv_width();
    if (problem.input_dtype != v1::FP32) floats += q + 2 * kv;
    if (problem.output_dtype != v1::FP32) floats += q + weights;
  }
  return floats * static_cast<int64_t>(sizeof(float)) +
         omp_get_num_procs() * cpu::AttendScratchBytesPerThread(KernelsFor(h.head_dim), s);
}

absl::Status CpuBackend::WarmUp() {
  // The first call pays for oneDNN's start-up and code generation and for the OpenMP thread pool (tens of ms): a
  // self-attention call just above kSerialFlops, so that it runs on every thread.
  constexpr int64_t kTokens = 32, kDModel = 256, kHeads = 4;
  AttentionShape s;
  s.batch = 1;
  s.q_len = s.kv_len = kTokens;
  s.d_model = s.d_kv_in = s.d_v_in = kDModel;
  s.heads = {kHeads, kHeads, kDModel / kHeads, /*causal=*/false, 0.125f};
  const std::vector<float> x(kTokens * kDModel, 0.5f), w_qkv(kDModel * 3 * kDModel, 0.01f),
      w_o(kDModel * kDModel, 0.01f);
  std::vector<float> out(x.size());
  MhaArgs args;
  args.shape = s;
  args.weights.w_q = w_qkv.data();
  args.weights.w_k = w_qkv.data() + kDModel;
  args.weights.w_v = w_qkv.data() + 2 * kDModel;
  args.weights.ld_q = args.weights.ld_k = args.weights.ld_v = 3 * kDModel;
  args.weights.w_o = w_o.data();
  args.weights.fused_qkv = true;
  args.kv_source = KvSource::kQuery;
  args.query = args.key = args.value = {x.data(), v1::FP32};
  args.out = {out.data(), v1::FP32};
  return MultiHeadAttention(args);
}

absl::Status CpuBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  ScopedOmpThreads threads(AttentionFlops(s) <= kSerialFlops ? 1 : omp_get_max_threads());
  const int64_t q_count = s.batch * s.q_len * h.q_width(), kv_count = s.batch * s.kv_len * h.kv_width();
  const FloatInput q(a.q, q_count), k(a.k, kv_count), v(a.v, kv_count);
  FloatOutput out(a.out, q_count), weights(a.weights, s.batch * h.num_heads * s.q_len * s.kv_len);
  cpu::Attend(KernelsFor(h.head_dim), s, a.mask, {q.data(), h.q_width()}, {k.data(), h.kv_width()},
              {v.data(), h.kv_width()}, out.data(), h.q_width(), weights.data());
  out.Finish();
  weights.Finish();
  return absl::OkStatus();
}

absl::Status CpuBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const LayerWeights& w = a.weights;
  const int64_t q_width = h.q_width(), kv_width = h.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  ScopedOmpThreads threads(AttentionFlops(s) <= kSerialFlops ? 1 : omp_get_max_threads());
  CallScratch& scratch = ThreadScratch();

  const FloatInput query(a.query, q_rows * s.d_model);
  const FloatInput key(a.kv_source == KvSource::kQuery ? ConstTensor{} : a.key, kv_rows * s.d_kv_in);
  const FloatInput value(a.kv_source == KvSource::kKeyValue ? a.value : ConstTensor{}, kv_rows * s.d_v_in);
  const float* key_data = a.kv_source == KvSource::kQuery ? query.data() : key.data();
  const float* value_data = a.kv_source == KvSource::kKeyValue ? value.data() : key_data;

  cpu::Packed q, k, v;
  if (a.kv_source == KvSource::kQuery && w.fused_qkv) {
    // One product projects Q|K|V; each is then read in place through the row stride of the fused output.
    const int64_t width = q_width + 2 * kv_width;
    float* projected = Grown(scratch.projected, q_rows * width);
    absl::Status status = Linear(query.data(), q_rows, s.d_model, s.d_model, w.w_q, w.ld_q, w.b_q, width, projected,
                                 width);
    if (!status.ok()) return status;
    q = {projected, width};
    k = {projected + q_width, width};
    v = {projected + q_width + kv_width, width};
  } else {
    float* qp = Grown(scratch.projected, q_rows * q_width + 2 * kv_rows * kv_width);
    float* kp = qp + q_rows * q_width;
    float* vp = kp + kv_rows * kv_width;
    for (absl::Status status :
         {Linear(query.data(), q_rows, s.d_model, s.d_model, w.w_q, w.ld_q, w.b_q, q_width, qp, q_width),
          Linear(key_data, kv_rows, s.d_kv_in, s.d_kv_in, w.w_k, w.ld_k, w.b_k, kv_width, kp, kv_width),
          Linear(value_data, kv_rows, s.d_v_in, s.d_v_in, w.w_v, w.ld_v, w.b_v, kv_width, vp, kv_width)}) {
      if (!status.ok()) return status;
    }
    q = {qp, q_width};
    k = {kp, kv_width};
    v = {vp, kv_width};
  }

  FloatOutput weights(a.attention_weights, s.batch * h.num_heads * s.q_len * s.kv_len);
  float* heads = Grown(scratch.heads, q_rows * q_width);
  cpu::Attend(KernelsFor(h.head_dim), s, a.mask, q, k, v, heads, q_width, weights.data());
  weights.Finish();

  if (!a.head_mask.empty()) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q_rows; ++r) {
      for (int64_t head = 0; head < h.num_heads; ++head) {
        float* row = heads + r * q_width + head * h.head_dim;
        for (int64_t c = 0; c < h.head_dim; ++c) row[c] *= a.head_mask[head];
      }
    }
  }
  FloatOutput out(a.out, q_rows * s.d_model);
  absl::Status status = Linear(heads, q_rows, q_width, q_width, w.w_o, s.d_model, w.b_o, s.d_model, out.data(),
                               s.d_model);
  if (!status.ok()) return status;
  out.Finish();
  return absl::OkStatus();
}

}  // namespace mha
