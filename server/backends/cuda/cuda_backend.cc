#include "server/backends/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <climits>
#include <initializer_list>
#include <cstring>
#include <list>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/cublas_api.h"
#include "server/backends/cuda/cuda_backend_impl.h"
#include "server/backends/cuda/cuda_status.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/rope_frequencies.h"
#include "server/backends/synthetic.h"

namespace mha {
namespace {

// RoPE on a stateless call's projected or wire q and k on the device, in place: keys at 0..Tk-1, queries bottom-right
// aligned at Tk-Tq..Tk-1 (the reference backend's RotateStateless), with the frequencies of a Tk-token sequence.
absl::Status RotateStateless(const AttentionShape& s, int dtype, char* q, int64_t q_row_stride, char* k,
                             int64_t kv_row_stride, cudaStream_t stream) {
  const HeadSpec& h = s.heads;
  if (!h.has_rope()) return absl::OkStatus();
  const cuda::RopeTable table = cuda_internal::RopeTableOf(h, s.kv_len);
  RETURN_IF_CUDA_ERROR(cuda::LaunchRope(q, dtype, s.batch, s.q_len, q_row_stride, h.num_heads, h.head_dim,
                                        s.kv_len - s.q_len, table, stream),
                       "rotating the queries (RoPE)");
  RETURN_IF_CUDA_ERROR(
      cuda::LaunchRope(k, dtype, s.batch, s.kv_len, kv_row_stride, h.num_kv_heads, h.head_dim, 0, table, stream),
      "rotating the keys (RoPE)");
  return absl::OkStatus();
}

// The softmax statistics a call asks for (RowStats but contribution), staged back from the device: `count` fp32
// values each.
struct DeviceRowStats {
  Staged lse, entropy, confidence, distance, sink;
  int64_t sink_tokens = 0;

  DeviceRowStats(const RowStats& stats, int64_t count) : sink_tokens(stats.sink_tokens) {
    const auto size = [count](float* host) { return Staged{host, nullptr, nullptr, host ? count * 4 : 0}; };
    lse = size(stats.lse);
    entropy = size(stats.entropy);
    confidence = size(stats.confidence);
    distance = size(stats.distance);
    sink = size(stats.sink);
  }
  std::vector<Staged*> all() { return {&lse, &entropy, &confidence, &distance, &sink}; }
  // The kernel's pointers to them.
  void Into(cuda::AttentionParams& p) const {
    p.lse = reinterpret_cast<float*>(lse.device);
    p.entropy = reinterpret_cast<float*>(entropy.device);
    p.confidence = reinterpret_cast<float*>(confidence.device);
    p.distance = reinterpret_cast<float*>(distance.device);
    p.sink = reinterpret_cast<float*>(sink.device);
    p.sink_tokens = sink_tokens;
  }
};

}  // namespace

absl::Status CudaBackend::Impl::Sdpa(const SdpaArgs& a) {
  RETURN_IF_ERROR_STATUS(OneDtype({&a.q, &a.k, &a.v}));
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const int t = a.q.dtype, out_dtype = a.out.dtype;
  absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(s, a.q.dtype);
  if (!plan.ok()) return plan.status();
  const int64_t in_size = DTypeSize(t), out_size = DTypeSize(out_dtype);
  const int64_t q_count = s.batch * s.q_len * h.q_width(), kv_count = s.batch * s.kv_len * h.kv_width();
  const int64_t weight_count = a.weights.requested() ? s.batch * h.num_heads * s.q_len * s.kv_len : 0;
  const bool direct = out_dtype == t || out_dtype == cuda::kF32;  // the kernel writes the requested dtype

  Staged q{a.q.data, nullptr, nullptr, q_count * in_size}, k{a.k.data, nullptr, nullptr, kv_count * in_size},
      v{a.v.data, nullptr, nullptr, kv_count * in_size};
  Staged out{a.out.data, nullptr, nullptr, q_count * out_size};
  Staged weights{a.weights.data, nullptr, nullptr, weight_count * out_size};
  DeviceMask mask;
  SizeMask(s, a.mask, {}, mask);
  char* out_f32 = nullptr;
  float* row_stats = nullptr;
  DeviceRowStats stats(a.stats, s.batch * h.num_heads * s.q_len);
  std::vector<Staged*> staged = {&q, &k, &v, &mask.key_lengths, &mask.additive, &out, &weights};
  for (Staged* x : stats.all()) staged.push_back(x);
  const auto carve = [&](char* device, char* host) {
    Carver d(device), p(host);
    for (Staged* x : staged) {
      x->device = d.Take(x->bytes);
      x->pinned = p.Take(x->bytes);
    }
    if (!direct) out_f32 = d.Take(q_count * 4);
    if (weight_count > 0) row_stats = reinterpret_cast<float*>(d.Take(s.batch * h.num_heads * s.q_len * 8));
    return std::pair<int64_t, int64_t>(d.used(), p.used());
  };
  Lease lane(*this);
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const auto [device_bytes, host_bytes] = carve(nullptr, nullptr);
  RETURN_IF_ERROR_STATUS(Reserve(*lane, device_bytes, host_bytes));
  carve(lane->device.data(), lane->host.data());
  for (Staged* x : {&q, &k, &v, &mask.key_lengths, &mask.additive}) RETURN_IF_ERROR_STATUS(CopyIn(*x, lane->stream));
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));
  RETURN_IF_ERROR_STATUS(RotateStateless(s, t, q.device, h.q_width(), k.device, h.kv_width(), lane->stream));

  cuda::AttentionParams p = ShapeParams(s, a.mask, mask);
  p.q = q.device;
  p.k = k.device;
  p.v = v.device;
  p.q_row_stride = h.q_width();
  p.kv_row_stride = h.kv_width();
  p.dtype = t;
  p.out = direct ? out.device : out_f32;
  p.out_dtype = direct ? out_dtype : cuda::kF32;
  p.row_stats = row_stats;
  stats.Into(p);
  RETURN_IF_CUDA_ERROR(cuda::LaunchAttention(p, *plan, lane->stream), "launching attention");
  if (!direct) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchConvert(out_f32, cuda::kF32, out.device, out_dtype, q_count, lane->stream),
                         "converting the output");
  }
  if (weight_count > 0) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchAttentionWeights(p, weights.device, out_dtype, lane->stream),
                         "launching the attention weights");
  }
  return ReturnOutputs({&out, &weights, &stats.lse, &stats.entropy, &stats.confidence, &stats.distance, &stats.sink},
                       lane->stream, "attention on the GPU");
}

namespace {

// Contributions from LaunchHeadContributions' [rows, H] into the call's [B, H, Tq].
void UnpackContributions(const std::vector<float>& rows, const AttentionShape& s, float* contribution) {
  const int64_t heads = s.heads.num_heads;
  for (int64_t r = 0; r < s.batch * s.q_len; ++r) {
    const int64_t b = r / s.q_len, i = r % s.q_len;
    for (int64_t head = 0; head < heads; ++head) contribution[(b * heads + head) * s.q_len + i] = rows[r * heads + head];
  }
}

}  // namespace

absl::Status CudaBackend::Impl::LayerOnDevice(Lane& lane, const AttentionShape& s, const LayerWeights& w, int dtype,
                                              const LayerOffsets& o, char** matrices, float** biases, float* staging,
                                              std::shared_ptr<const DeviceLayer>* resident) {
  if (w.resident_id == 0) return UploadLayer(s, w, o, dtype, *matrices, *biases, staging, lane.stream);
  absl::StatusOr<std::shared_ptr<const DeviceLayer>> layer = Resident(lane, s, w, dtype);
  if (!layer.ok()) return layer.status();
  *resident = *std::move(layer);
  *matrices = (*resident)->matrices.data();
  *biases = reinterpret_cast<float*>((*resident)->biases.data());
  return absl::OkStatus();
}

// Q, K, V of a layer call (inputs query, key, value on the device) in the compute dtype into `projected`: one
// product when Q|K|V is fused, else three. Sets where p finds them; *q and *k: the rows RoPE rotates.
absl::Status CudaBackend::Impl::ProjectMha(Lane& lane, const MhaArgs& a, const LayerOffsets& o, const char* matrices,
                                           const float* biases, std::array<const char*, 3> inputs, char* projected,
                                           cuda::AttentionParams& p, char** q, char** k) const {
  const AttentionShape& s = a.shape;
  const int t = a.query.dtype;
  const int64_t in_size = DTypeSize(t), q_width = s.heads.q_width(), kv_width = s.heads.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const auto matrix = [&](int64_t offset) { return matrices + offset * in_size; };
  const auto bias = [&](int64_t offset) { return offset < 0 ? nullptr : biases + offset; };
  if (a.kv_source == KvSource::kQuery && a.weights.fused_qkv) {
    const int64_t width = q_width + 2 * kv_width;
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, inputs[0], q_rows, s.d_model, s.d_model, matrix(o.q), o.ld_q,
                                  bias(o.bq), width, projected, width));
    *q = projected;
    *k = projected + q_width * in_size;
    p.v = projected + (q_width + kv_width) * in_size;
    p.q_row_stride = p.kv_row_stride = width;
  } else {
    *q = projected;
    *k = *q + q_rows * q_width * in_size;
    char* v = *k + kv_rows * kv_width * in_size;
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, inputs[0], q_rows, s.d_model, s.d_model, matrix(o.q), o.ld_q,
                                  bias(o.bq), q_width, *q, q_width));
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, inputs[1], kv_rows, s.d_kv_in, s.d_kv_in, matrix(o.k), o.ld_k,
                                  bias(o.bk), kv_width, *k, kv_width));
    RETURN_IF_ERROR_STATUS(Linear(lane, t, t, inputs[2], kv_rows, s.d_v_in, s.d_v_in, matrix(o.v), o.ld_v,
                                  bias(o.bv), kv_width, v, kv_width));
    p.v = v;
    p.q_row_stride = q_width;
    p.kv_row_stride = kv_width;
  }
  p.q = *q;
  p.k = *k;
  return absl::OkStatus();
}

// y = heads W_O (+ b_O) in the requested dtype (through `out_f32` when that is neither the compute dtype nor fp32),
// and the heads' contributions [rows, H] when `contribution` has room.
absl::Status CudaBackend::Impl::OutputMha(Lane& lane, const MhaArgs& a, const char* heads, const char* w_o,
                                          const float* b_o, const Staged& out, char* out_f32,
                                          const Staged& contribution) const {
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const int t = a.query.dtype, out_dtype = a.out.dtype;
  const int64_t q_rows = s.batch * s.q_len, q_width = h.q_width();
  const bool direct = out_f32 == nullptr;
  const int c = direct ? out_dtype : cuda::kF32;
  char* y = direct ? out.device : out_f32;
  RETURN_IF_ERROR_STATUS(
      Linear(lane, t, c, heads, q_rows, q_width, q_width, w_o, s.d_model, b_o, s.d_model, y, s.d_model));
  if (contribution.bytes > 0) {
    // The heads as the output product read them (after the head mask), against the output before any conversion.
    RETURN_IF_CUDA_ERROR(cuda::LaunchHeadContributions(heads, t, q_rows, h.num_heads, h.head_dim, w_o, t, y, c,
                                                       s.d_model, reinterpret_cast<float*>(contribution.device),
                                                       lane.stream),
                         "launching the head contributions");
  }
  if (!direct) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchConvert(out_f32, cuda::kF32, out.device, out_dtype, q_rows * s.d_model, lane.stream),
                         "converting the output");
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::Mha(const MhaArgs& a) {
  RETURN_IF_ERROR_STATUS(OneDtype({&a.query, &a.key, &a.value}));
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const LayerWeights& w = a.weights;
  const int t = a.query.dtype, out_dtype = a.out.dtype;
  absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(s, a.query.dtype);
  if (!plan.ok()) return plan.status();
  const int64_t in_size = DTypeSize(t), out_size = DTypeSize(out_dtype);
  const int64_t q_width = h.q_width(), kv_width = h.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const int64_t weight_count = a.attention_weights.requested() ? s.batch * h.num_heads * s.q_len * s.kv_len : 0;
  const bool direct = out_dtype == t || out_dtype == cuda::kF32;  // the output product writes the requested dtype
  const LayerOffsets offsets = OffsetsFor(s, w);
  const bool inline_layer = w.resident_id == 0;

  Staged query{a.query.data, nullptr, nullptr, q_rows * s.d_model * in_size};
  Staged key{a.key.data, nullptr, nullptr, a.kv_source == KvSource::kQuery ? 0 : kv_rows * s.d_kv_in * in_size};
  Staged value{a.value.data, nullptr, nullptr, a.kv_source == KvSource::kKeyValue ? kv_rows * s.d_v_in * in_size : 0};
  Staged out{a.out.data, nullptr, nullptr, q_rows * s.d_model * out_size};
  Staged weights{a.attention_weights.data, nullptr, nullptr, weight_count * out_size};
  DeviceMask mask;
  SizeMask(s, a.mask, a.head_mask, mask);
  char *projected = nullptr, *heads = nullptr, *out_f32 = nullptr, *layer_matrices = nullptr;
  float *layer_biases = nullptr, *layer_staging = nullptr, *row_stats = nullptr;
  DeviceRowStats stats(a.stats, s.batch * h.num_heads * s.q_len);
  // contribution comes back [rows, H] (LaunchHeadContributions) and is rearranged into the caller's [B, H, Tq].
  std::vector<float> contribution_rows(a.stats.contribution != nullptr ? q_rows * h.num_heads : 0);
  Staged contribution{contribution_rows.data(), nullptr, nullptr, static_cast<int64_t>(contribution_rows.size()) * 4};
  std::vector<Staged*> staged = {&query, &key, &value, &mask.key_lengths, &mask.additive, &mask.head_mask,
                                 &out, &weights, &contribution};
  for (Staged* x : stats.all()) staged.push_back(x);
  const auto carve = [&](char* device, char* host) {
    Carver d(device), p(host);
    for (Staged* x : staged) {
      x->device = d.Take(x->bytes);
      x->pinned = p.Take(x->bytes);
    }
    projected = d.Take((q_rows * q_width + 2 * kv_rows * kv_width) * in_size);
    heads = d.Take(q_rows * q_width * in_size);
    if (!direct) out_f32 = d.Take(q_rows * s.d_model * 4);
    if (weight_count > 0) row_stats = reinterpret_cast<float*>(d.Take(s.batch * h.num_heads * s.q_len * 8));
    if (inline_layer) {
      layer_matrices = d.Take(offsets.weights * in_size);
      layer_biases = reinterpret_cast<float*>(d.Take(offsets.biases * 4));
      if (t != cuda::kF32) layer_staging = reinterpret_cast<float*>(d.Take(offsets.weights * 4));
    }
    return std::pair<int64_t, int64_t>(d.used(), p.used());
  };

  Lease lane(*this);
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options_.device), "cudaSetDevice");
  const auto [device_bytes, host_bytes] = carve(nullptr, nullptr);
  RETURN_IF_ERROR_STATUS(Reserve(*lane, device_bytes, host_bytes));
  carve(lane->device.data(), lane->host.data());
  for (Staged* x : {&query, &key, &value, &mask.key_lengths, &mask.additive, &mask.head_mask}) {
    RETURN_IF_ERROR_STATUS(CopyIn(*x, lane->stream));
  }
  std::shared_ptr<const DeviceLayer> resident;
  RETURN_IF_ERROR_STATUS(LayerOnDevice(*lane, s, w, t, offsets, &layer_matrices, &layer_biases, layer_staging,
                                       &resident));
  const auto matrix = [&](int64_t offset) { return layer_matrices + offset * in_size; };
  const auto bias = [&](int64_t offset) { return offset < 0 ? nullptr : layer_biases + offset; };
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));

  // Q, K, V in the compute dtype.
  const char* key_in = a.kv_source == KvSource::kQuery ? query.device : key.device;
  const char* value_in = a.kv_source == KvSource::kKeyValue ? value.device : key_in;
  cuda::AttentionParams p = ShapeParams(s, a.mask, mask);
  char *q_projected = nullptr, *k_projected = nullptr;  // for RoPE
  RETURN_IF_ERROR_STATUS(ProjectMha(*lane, a, offsets, layer_matrices, layer_biases,
                                    {query.device, key_in, value_in}, projected, p, &q_projected, &k_projected));
  RETURN_IF_ERROR_STATUS(
      RotateStateless(s, t, q_projected, p.q_row_stride, k_projected, p.kv_row_stride, lane->stream));
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));

  p.dtype = t;
  p.out = heads;
  p.out_dtype = t;
  p.row_stats = row_stats;
  stats.Into(p);
  RETURN_IF_CUDA_ERROR(cuda::LaunchAttention(p, *plan, lane->stream), "launching attention");
  if (weight_count > 0) {
    // The weights are softmax alone: the head mask scales the heads' outputs, not their weights.
    cuda::AttentionParams wp = p;
    wp.head_mask = nullptr;
    RETURN_IF_CUDA_ERROR(cuda::LaunchAttentionWeights(wp, weights.device, out_dtype, lane->stream),
                         "launching the attention weights");
  }
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));

  RETURN_IF_ERROR_STATUS(OutputMha(*lane, a, heads, matrix(offsets.o), bias(offsets.bo), out, out_f32, contribution));
  RETURN_IF_ERROR_STATUS(ReturnOutputs({&out, &weights, &contribution, &stats.lse, &stats.entropy,
                                        &stats.confidence, &stats.distance, &stats.sink},
                                       lane->stream, "the layer on the GPU"));
  if (a.stats.contribution != nullptr) UnpackContributions(contribution_rows, s, a.stats.contribution);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  int count = 0;
  // Any error here means unavailable, with the reason: no driver, or the driver's words.
  if (const cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", cuda::NoDeviceReason(error)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::UnavailableError(absl::StrCat("no CUDA device ", options.device, " (", count, " present)"));
  }
  RETURN_IF_CUDA_ERROR(cudaSetDevice(options.device), "cudaSetDevice");
  cudaDeviceProp props;
  RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, options.device), "cudaGetDeviceProperties");
  {
    // One tiny kernel proves that this build carries code the GPU runs (sm_90 + PTX by default).
    DeviceBuffer probe;
    absl::Status status = probe.Reserve(8);
    if (status.ok()) status = CudaStatus(cuda::LaunchConvert(probe.data(), cuda::kF32, probe.data() + 4, cuda::kF16,
                                                             1, nullptr),
                                         "running a probe kernel");
    if (status.ok()) status = CudaStatus(cudaDeviceSynchronize(), "running a probe kernel");
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat(props.name, " (sm_", props.major, props.minor,
                                                 ") cannot run this build's kernels: ", status.message()));
    }
  }
  absl::StatusOr<const cuda::CublasApi*> blas = cuda::CublasApi::Load();
  if (!blas.ok()) return blas.status();
  auto impl = std::make_unique<Impl>(options, *blas, props);
  RETURN_IF_ERROR_STATUS(impl->Init());
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

std::string CudaBackend::device() const { return impl_->Device(); }

namespace cuda_internal {
cuda::RopeTable RopeTableOf(const HeadSpec& h, int64_t seq_len) {
  cuda::RopeTable table;
  const RopeFrequencies f = ComputeRopeFrequencies(h, seq_len);
  std::copy(f.inv_freq.begin(), f.inv_freq.end(), table.inv_freq);
  table.attention_factor = f.attention_factor;
  table.rope_dim = h.rope_dim;
  table.interleaved = h.rope_interleaved;
  return table;
}
}  // namespace cuda_internal

absl::Status CudaBackend::Supports(const AttentionProblem& problem) const {
  RETURN_IF_ERROR_STATUS(cuda::CudaSupports(problem));
  const AttentionShape& s = problem.shape;
  // cuBLAS takes 32-bit dimensions: rows of the projections and their widths.
  for (int64_t n : {s.batch * s.q_len, s.batch * s.kv_len, s.heads.q_width() + 2 * s.heads.kv_width(), s.d_model,
                    s.d_kv_in, s.d_v_in}) {
    if (n > INT_MAX) {
      return absl::UnimplementedError(absl::StrCat("a dimension of ", n, " exceeds cuBLAS's 32-bit sizes"));
    }
  }
  return absl::OkStatus();
}

int64_t CudaBackend::WorkspaceBytes(const AttentionProblem& problem) const {
  return cuda::CudaWorkspaceBytes(problem);
}

int CudaBackend::concurrent_calls() const { return impl_->lanes(); }

absl::StatusOr<double> CudaBackend::WarmUp() { return RunSyntheticLayer(*this, 256, 512, 8); }

absl::Status CudaBackend::ScaledDotProductAttention(const SdpaArgs& args) { return impl_->Sdpa(args); }

absl::Status CudaBackend::MultiHeadAttention(const MhaArgs& args) { return impl_->Mha(args); }

}  // namespace mha
