#include "server/backends/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
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
#include "server/backends/cuda/cuda_status.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/synthetic.h"

#if defined(MHA_CUDA_EMULATION) && defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MHA_GUARD_PIECES 1
#endif

namespace mha {
namespace {

using cuda::CublasStatus;
using cuda::CudaStatus;

#define RETURN_IF_CUDA_ERROR(expr, what)                                            \
  do {                                                                              \
    if (absl::Status _status = CudaStatus((expr), (what)); !_status.ok()) return _status; \
  } while (0)
#define RETURN_IF_ERROR_STATUS(expr)                        \
  do {                                                      \
    if (absl::Status _status = (expr); !_status.ok()) return _status; \
  } while (0)

// Lane buffers above this size are freed when their call ends, so that one huge request does not pin its memory.
constexpr int64_t kKeptLaneBytes = int64_t{1} << 30;
constexpr int64_t kAlignment = 256;

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

cudaDataType_t CudaType(int dtype) {
  switch (dtype) {
    case cuda::kF16:
      return CUDA_R_16F;
    case cuda::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// Memory from `Allocate` (cudaMalloc: device; cudaMallocHost: page-locked host memory, so that copies run
// asynchronously on a stream), grown on demand; contents are not kept across growth.
template <cudaError_t (*Allocate)(void**, size_t), cudaError_t (*Free)(void*)>
class CudaBuffer {
 public:
  explicit CudaBuffer(const char* what) : what_(what) {}
  ~CudaBuffer() { Release(); }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  absl::Status Reserve(int64_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    Release();
    void* p = nullptr;
    const cudaError_t error = Allocate(&p, static_cast<size_t>(bytes));
    if (error != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: clear it
      return CudaStatus(error, absl::StrCat("allocating ", bytes, " bytes of ", what_));
    }
    data_ = static_cast<char*>(p);
    size_ = bytes;
    return absl::OkStatus();
  }
  void Release() {
    if (data_ != nullptr) Free(data_);
    data_ = nullptr;
    size_ = 0;
  }
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  const char* const what_;
  char* data_ = nullptr;
  int64_t size_ = 0;
};

cudaError_t DeviceAllocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
cudaError_t HostAllocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }

class DeviceBuffer : public CudaBuffer<DeviceAllocate, cudaFree> {
 public:
  DeviceBuffer() : CudaBuffer("device memory") {}
};
class PinnedBuffer : public CudaBuffer<HostAllocate, cudaFreeHost> {
 public:
  PinnedBuffer() : CudaBuffer("pinned host memory") {}
};

#ifdef MHA_GUARD_PIECES
// Only where device memory is host memory, under ASan (tests/emulated_cuda): each piece a Carver cuts is followed
// by poisoned bytes, so that a kernel or a copy that runs past its tensor into the next one is reported; the lane's
// buffers are made addressable again when its call ends.
constexpr int64_t kGuardBytes = kAlignment;
void Unpoison(char* p, int64_t bytes) { ASAN_UNPOISON_MEMORY_REGION(p, bytes); }
#else
constexpr int64_t kGuardBytes = 0;
void Unpoison(char*, int64_t) {}
#endif

// Cuts aligned pieces off a buffer. With a null base it only measures: the same sequence of Take calls first
// sizes a buffer, then carves it.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  char* Take(int64_t bytes) {
    if (bytes == 0) return nullptr;
    char* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += RoundUp(bytes, kAlignment) + kGuardBytes;
#ifdef MHA_GUARD_PIECES
    if (p != nullptr) ASAN_POISON_MEMORY_REGION(p + bytes, RoundUp(bytes, kAlignment) - bytes + kGuardBytes);
#endif
    return p;
  }
  int64_t used() const { return used_; }

 private:
  char* const base_;
  int64_t used_ = 0;
};

// Where a layer's matrices (in the compute dtype) and biases (fp32) sit on the device, in elements from the start
// of their regions. Matrices keep the host layout: fused Q|K|V is one [d_model, ld_q] matrix.
struct LayerOffsets {
  int64_t q = 0, k = 0, v = 0, o = 0, ld_q = 0, ld_k = 0, ld_v = 0;
  int64_t weights = 0;                     // matrix elements in all
  int64_t bq = -1, bk = -1, bv = -1, bo = -1;
  int64_t biases = 0;                      // bias elements in all
};

LayerOffsets OffsetsFor(const AttentionShape& s, const LayerWeights& w) {
  const HeadSpec& h = s.heads;
  LayerOffsets o;
  o.ld_q = w.ld_q;
  o.ld_k = w.ld_k;
  o.ld_v = w.ld_v;
  if (w.fused_qkv) {
    o.k = h.q_width();
    o.v = h.q_width() + h.kv_width();
    o.o = s.d_model * w.ld_q;
  } else {
    o.k = s.d_model * w.ld_q;
    o.v = o.k + s.d_kv_in * w.ld_k;
    o.o = o.v + s.d_v_in * w.ld_v;
  }
  o.weights = o.o + h.q_width() * s.d_model;
  if (w.b_q != nullptr) {
    o.bq = 0;
    o.bk = h.q_width();
    o.bv = h.q_width() + h.kv_width();
    o.biases = h.q_width() + 2 * h.kv_width();
  }
  if (w.b_o != nullptr) {
    o.bo = o.biases;
    o.biases += s.d_model;
  }
  return o;
}

// Copies a layer's fp32 host weights to the device: matrices into `matrices` in `dtype` (through `staging`, fp32
// room for o.weights elements, when dtype is 16-bit), biases into `biases` in fp32. Enqueued on `stream`.
absl::Status UploadLayer(const AttentionShape& s, const LayerWeights& w, const LayerOffsets& o, int dtype,
                         char* matrices, float* biases, float* staging, cudaStream_t stream) {
  float* f32 = dtype == cuda::kF32 ? reinterpret_cast<float*>(matrices) : staging;
  const auto copy = [stream](void* dst, const void* src, int64_t floats) {
    return CudaStatus(cudaMemcpyAsync(dst, src, floats * sizeof(float), cudaMemcpyHostToDevice, stream),
                      "copying layer weights to the device");
  };
  if (w.fused_qkv) {
    RETURN_IF_ERROR_STATUS(copy(f32, w.w_q, s.d_model * w.ld_q));
  } else {
    RETURN_IF_ERROR_STATUS(copy(f32 + o.q, w.w_q, s.d_model * w.ld_q));
    RETURN_IF_ERROR_STATUS(copy(f32 + o.k, w.w_k, s.d_kv_in * w.ld_k));
    RETURN_IF_ERROR_STATUS(copy(f32 + o.v, w.w_v, s.d_v_in * w.ld_v));
  }
  RETURN_IF_ERROR_STATUS(copy(f32 + o.o, w.w_o, s.heads.q_width() * s.d_model));
  if (o.bq >= 0) {
    RETURN_IF_ERROR_STATUS(copy(biases + o.bq, w.b_q, s.heads.q_width()));
    RETURN_IF_ERROR_STATUS(copy(biases + o.bk, w.b_k, s.heads.kv_width()));
    RETURN_IF_ERROR_STATUS(copy(biases + o.bv, w.b_v, s.heads.kv_width()));
  }
  if (o.bo >= 0) RETURN_IF_ERROR_STATUS(copy(biases + o.bo, w.b_o, s.d_model));
  if (dtype != cuda::kF32) {
    RETURN_IF_CUDA_ERROR(cuda::LaunchConvert(staging, cuda::kF32, matrices, dtype, o.weights, stream),
                         "converting layer weights");
  }
  return absl::OkStatus();
}

// A stored layer resident on the device in one compute dtype.
struct DeviceLayer {
  LayerOffsets offsets;
  DeviceBuffer matrices;  // o.weights elements of the compute dtype
  DeviceBuffer biases;    // o.biases fp32
  int64_t bytes() const { return matrices.size() + biases.size(); }
};

// One concurrent call's resources.
struct Lane {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  DeviceBuffer device;
  PinnedBuffer host;
};

}  // namespace

class CudaBackend::Impl {
 public:
  Impl(const Options& options, const cuda::CublasApi* blas, const cudaDeviceProp& props)
      : options_(options), blas_(blas), props_(props) {}
  ~Impl() {
    cudaSetDevice(options_.device);
    for (auto& lane : lanes_) {
      if (lane->blas != nullptr) blas_->destroy(lane->blas);
      if (lane->stream != nullptr) cudaStreamDestroy(lane->stream);
    }
  }

  absl::Status Init() {
    cache_limit_ = options_.layer_cache_bytes > 0 ? options_.layer_cache_bytes
                                                  : static_cast<int64_t>(props_.totalGlobalMem / 4);
    for (int i = 0; i < std::max(1, options_.lanes); ++i) {
      auto lane = std::make_unique<Lane>();
      RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking), "creating a stream");
      RETURN_IF_ERROR_STATUS(CublasStatus(blas_->create(&lane->blas), "creating a cuBLAS handle"));
      RETURN_IF_ERROR_STATUS(CublasStatus(blas_->set_stream(lane->blas, lane->stream), "cublasSetStream"));
      RETURN_IF_ERROR_STATUS(CublasStatus(
          blas_->set_math_mode(lane->blas, options_.allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
          "cublasSetMathMode"));
      free_.push_back(lane.get());
      lanes_.push_back(std::move(lane));
    }
    return absl::OkStatus();
  }

  std::string Device() const {
    int blas_version = 0, runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    return absl::StrCat(props_.name, " (sm_", props_.major, props_.minor, ", ", props_.totalGlobalMem >> 20,
                        " MiB, CUDA runtime ", runtime / 1000, ".", runtime % 1000 / 10, ", driver ", driver / 1000,
                        ".", driver % 1000 / 10, ", cuBLAS ",
                        blas_->get_version(lanes_.front()->blas, &blas_version) == CUBLAS_STATUS_SUCCESS
                            ? absl::StrCat(blas_version)
                            : std::string("?"),
                        ", ", lanes_.size(), " streams", options_.allow_tf32 ? ", TF32 allowed" : "", ")");
  }

  int lanes() const { return static_cast<int>(lanes_.size()); }
  absl::Status Sdpa(const SdpaArgs& a);
  absl::Status Mha(const MhaArgs& a);

 private:
  // A lane for the duration of one call.
  class Lease {
   public:
    explicit Lease(Impl& impl) : impl_(impl) {
      absl::MutexLock lock(&impl_.mu_);
      impl_.mu_.Await(absl::Condition(
          +[](std::vector<Lane*>* free) { return !free->empty(); }, &impl_.free_));
      lane_ = impl_.free_.back();
      impl_.free_.pop_back();
    }
    ~Lease() {
      // A call that returned early (an error, a cancellation) may have left copies and kernels in flight on the
      // lane's buffers: they finish before the lane serves another call, whose host-side copies into the pinned
      // buffer would race them. A completed call has synchronized already. An error here is the stream's sticky
      // error, which the next call on the lane reports.
      cudaStreamSynchronize(lane_->stream);
      Unpoison(lane_->device.data(), lane_->device.size());
      Unpoison(lane_->host.data(), lane_->host.size());
      if (lane_->device.size() > kKeptLaneBytes) lane_->device.Release();
      if (lane_->host.size() > kKeptLaneBytes) lane_->host.Release();
      absl::MutexLock lock(&impl_.mu_);
      impl_.free_.push_back(lane_);
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lane& operator*() const { return *lane_; }
    Lane* operator->() const { return lane_; }

   private:
    Impl& impl_;
    Lane* lane_ = nullptr;
  };

  // Makes sure `device_bytes` fit on the device and reserves the lane's buffers.
  absl::Status Reserve(Lane& lane, int64_t device_bytes, int64_t host_bytes) const {
    if (device_bytes > static_cast<int64_t>(props_.totalGlobalMem)) {
      return absl::ResourceExhaustedError(absl::StrCat("the call needs ", device_bytes, " bytes of device memory; ",
                                                       props_.name, " has ", props_.totalGlobalMem));
    }
    RETURN_IF_ERROR_STATUS(lane.device.Reserve(device_bytes));
    return lane.host.Reserve(host_bytes);
  }

  // y[rows, n] (ldy) = x[rows, k] (ldx, dtype ab) w[k, n] (ldw, dtype ab) (+ bias, fp32 on the device) in dtype c.
  absl::Status Linear(Lane& lane, int ab, int c, const void* x, int64_t rows, int64_t k, int64_t ldx, const void* w,
                      int64_t ldw, const float* bias, int64_t n, void* y, int64_t ldy) const {
    if (rows == 0 || n == 0) return absl::OkStatus();
    if (bias != nullptr) {
      RETURN_IF_CUDA_ERROR(cuda::LaunchBroadcastRows(bias, n, rows, y, ldy, c, lane.stream), "broadcasting a bias");
    }
    const cuda::ColumnMajorGemm g = cuda::RowMajorGemm(rows, n, k, x, ldx, w, ldw, y, ldy);
    const float alpha = 1.0f, beta = bias != nullptr ? 1.0f : 0.0f;
    const cublasComputeType_t compute =
        ab == cuda::kF32 && options_.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return CublasStatus(
        blas_->gemm_ex(lane.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(g.m), static_cast<int>(g.n),
                       static_cast<int>(g.k), &alpha, g.a, CudaType(ab), static_cast<int>(g.lda), g.b, CudaType(ab),
                       static_cast<int>(g.ldb), &beta, g.c, CudaType(c), static_cast<int>(g.ldc), compute,
                       CUBLAS_GEMM_DEFAULT),
        absl::StrCat("cublasGemmEx ", rows, "x", k, "x", n));
  }

  // The resident copy of a stored layer in `dtype`, uploaded on first use (on `lane`, waited for before it is
  // shared). Least recently used layers beyond the cache limit are dropped; calls still using one keep it alive.
  absl::StatusOr<std::shared_ptr<const DeviceLayer>> Resident(Lane& lane, const AttentionShape& s,
                                                              const LayerWeights& w, int dtype) {
    const std::pair<uint64_t, int> key(w.resident_id, dtype);
    {
      absl::MutexLock lock(&cache_mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second.second);
        return it->second.first;
      }
    }
    auto layer = std::make_shared<DeviceLayer>();
    layer->offsets = OffsetsFor(s, w);
    const LayerOffsets& o = layer->offsets;
    RETURN_IF_ERROR_STATUS(layer->matrices.Reserve(o.weights * static_cast<int64_t>(DTypeSize(dtype))));
    RETURN_IF_ERROR_STATUS(layer->biases.Reserve(std::max<int64_t>(1, o.biases) * 4));
    DeviceBuffer staging;
    if (dtype != cuda::kF32) RETURN_IF_ERROR_STATUS(staging.Reserve(o.weights * 4));
    RETURN_IF_ERROR_STATUS(UploadLayer(s, w, o, dtype, layer->matrices.data(),
                                       reinterpret_cast<float*>(layer->biases.data()),
                                       reinterpret_cast<float*>(staging.data()), lane.stream));
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(lane.stream), "uploading a layer");
    absl::MutexLock lock(&cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second.first;  // another call uploaded it meanwhile
    lru_.push_front(key);
    cache_[key] = {layer, lru_.begin()};
    cached_bytes_ += layer->bytes();
    while (cached_bytes_ > cache_limit_ && lru_.size() > 1) {
      auto victim = cache_.find(lru_.back());
      cached_bytes_ -= victim->second.first->bytes();
      cache_.erase(victim);
      lru_.pop_back();
    }
    return std::shared_ptr<const DeviceLayer>(layer);
  }

  const Options options_;
  const cuda::CublasApi* const blas_;
  const cudaDeviceProp props_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  absl::Mutex mu_;
  std::vector<Lane*> free_ ABSL_GUARDED_BY(mu_);

  using CacheKey = std::pair<uint64_t, int>;
  absl::Mutex cache_mu_;
  std::list<CacheKey> lru_ ABSL_GUARDED_BY(cache_mu_);  // most recently used first
  std::map<CacheKey, std::pair<std::shared_ptr<DeviceLayer>, std::list<CacheKey>::iterator>> cache_
      ABSL_GUARDED_BY(cache_mu_);
  int64_t cached_bytes_ ABSL_GUARDED_BY(cache_mu_) = 0;
  int64_t cache_limit_ = 0;
};

namespace {

// Host tensors staged through the lane's pinned buffer.
struct Staged {
  const void* host = nullptr;  // input source, or output destination
  char* pinned = nullptr;
  char* device = nullptr;
  int64_t bytes = 0;
};

absl::Status CopyIn(const Staged& t, cudaStream_t stream) {
  if (t.bytes == 0) return absl::OkStatus();
  std::memcpy(t.pinned, t.host, t.bytes);
  return CudaStatus(cudaMemcpyAsync(t.device, t.pinned, t.bytes, cudaMemcpyHostToDevice, stream),
                    "copying an input to the device");
}

absl::Status StartCopyOut(const Staged& t, cudaStream_t stream) {
  if (t.bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(t.pinned, t.device, t.bytes, cudaMemcpyDeviceToHost, stream),
                    "copying an output from the device");
}

void FinishCopyOut(const Staged& t) {
  if (t.bytes > 0) std::memcpy(const_cast<void*>(t.host), t.pinned, t.bytes);
}

// Copies the outputs back through the pinned buffer once everything enqueued on `stream` has run.
absl::Status ReturnOutputs(std::initializer_list<const Staged*> outputs, cudaStream_t stream, const char* what) {
  for (const Staged* t : outputs) RETURN_IF_ERROR_STATUS(StartCopyOut(*t, stream));
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), what);
  for (const Staged* t : outputs) FinishCopyOut(*t);
  return absl::OkStatus();
}

absl::Status Stopped(const StopSignal* stop) { return stop == nullptr ? absl::OkStatus() : stop->Check(); }

// The mask inputs of a call on the device.
struct DeviceMask {
  Staged key_lengths, additive, head_mask;
};

void SizeMask(const AttentionShape& s, const AttentionMask& mask, absl::Span<const float> head_mask, DeviceMask& m) {
  m.key_lengths = {mask.key_lengths.data(), nullptr, nullptr, static_cast<int64_t>(mask.key_lengths.size()) * 4};
  const int64_t additive = mask.additive == nullptr ? 0 : (mask.additive_per_batch ? s.batch : 1) * s.q_len * s.kv_len;
  m.additive = {mask.additive, nullptr, nullptr, additive * 4};
  m.head_mask = {head_mask.data(), nullptr, nullptr, static_cast<int64_t>(head_mask.size()) * 4};
}

// The attention kernel's parameters that come from the call's shape and masks (mask tensors already on the device).
cuda::AttentionParams ShapeParams(const AttentionShape& s, const AttentionMask& mask, const DeviceMask& device) {
  cuda::AttentionParams p;
  p.key_lengths = reinterpret_cast<const int32_t*>(device.key_lengths.device);
  p.additive = reinterpret_cast<const float*>(device.additive.device);
  p.additive_per_batch = mask.additive_per_batch;
  p.head_mask = reinterpret_cast<const float*>(device.head_mask.device);
  p.batch = s.batch;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.heads = s.heads.num_heads;
  p.kv_heads = s.heads.num_kv_heads;
  p.head_dim = s.heads.head_dim;
  p.causal = s.heads.causal;
  p.scale = s.heads.scale;
  return p;
}

}  // namespace

// The CUDA backend computes in one dtype, the query's: a request whose tensors mix dtypes is refused (the CPU
// backend serves it).
absl::Status OneDtype(std::initializer_list<const ConstTensor*> tensors) {
  for (const ConstTensor* t : tensors) {
    if (t->dtype != (*tensors.begin())->dtype) {
      return absl::UnimplementedError(
          "the CUDA backend computes query, key and value of one dtype; this request mixes them");
    }
  }
  return absl::OkStatus();
}

namespace {

// RoPE on a stateless call's projected or wire q and k on the device, in place: keys at 0..Tk-1, queries bottom-right
// aligned at Tk-Tq..Tk-1 (the reference backend's RotateStateless).
absl::Status RotateStateless(const AttentionShape& s, int dtype, char* q, int64_t q_row_stride, char* k,
                             int64_t kv_row_stride, cudaStream_t stream) {
  const HeadSpec& h = s.heads;
  if (!h.has_rope()) return absl::OkStatus();
  RETURN_IF_CUDA_ERROR(cuda::LaunchRope(q, dtype, s.batch, s.q_len, q_row_stride, h.num_heads, h.head_dim,
                                        s.kv_len - s.q_len, h.rope_theta, h.rope_dim, h.rope_interleaved, stream),
                       "rotating the queries (RoPE)");
  RETURN_IF_CUDA_ERROR(cuda::LaunchRope(k, dtype, s.batch, s.kv_len, kv_row_stride, h.num_kv_heads, h.head_dim, 0,
                                        h.rope_theta, h.rope_dim, h.rope_interleaved, stream),
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
  absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(s, a.q.dtype, a.stats.softmax());
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

absl::Status CudaBackend::Impl::Mha(const MhaArgs& a) {
  RETURN_IF_ERROR_STATUS(OneDtype({&a.query, &a.key, &a.value}));
  const AttentionShape& s = a.shape;
  const HeadSpec& h = s.heads;
  const LayerWeights& w = a.weights;
  const int t = a.query.dtype, out_dtype = a.out.dtype;
  absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(s, a.query.dtype, a.stats.softmax());
  if (!plan.ok()) return plan.status();
  const int64_t in_size = DTypeSize(t), out_size = DTypeSize(out_dtype);
  const int64_t q_width = h.q_width(), kv_width = h.kv_width();
  const int64_t q_rows = s.batch * s.q_len, kv_rows = s.batch * s.kv_len;
  const int64_t weight_count = a.attention_weights.requested() ? s.batch * h.num_heads * s.q_len * s.kv_len : 0;
  const bool fused = a.kv_source == KvSource::kQuery && w.fused_qkv;
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
  if (inline_layer) {
    RETURN_IF_ERROR_STATUS(
        UploadLayer(s, w, offsets, t, layer_matrices, layer_biases, layer_staging, lane->stream));
  } else {
    absl::StatusOr<std::shared_ptr<const DeviceLayer>> layer = Resident(*lane, s, w, t);
    if (!layer.ok()) return layer.status();
    resident = *std::move(layer);
    layer_matrices = resident->matrices.data();
    layer_biases = reinterpret_cast<float*>(resident->biases.data());
  }
  const auto matrix = [&](int64_t offset) { return layer_matrices + offset * in_size; };
  const auto bias = [&](int64_t offset) { return offset < 0 ? nullptr : layer_biases + offset; };
  RETURN_IF_ERROR_STATUS(Stopped(a.stop));

  // Q, K, V in the compute dtype.
  const char* key_in = a.kv_source == KvSource::kQuery ? query.device : key.device;
  const char* value_in = a.kv_source == KvSource::kKeyValue ? value.device : key_in;
  cuda::AttentionParams p = ShapeParams(s, a.mask, mask);
  char *q_projected = nullptr, *k_projected = nullptr;  // for RoPE
  if (fused) {
    const int64_t width = q_width + 2 * kv_width;
    RETURN_IF_ERROR_STATUS(Linear(*lane, t, t, query.device, q_rows, s.d_model, s.d_model, matrix(offsets.q),
                                  offsets.ld_q, bias(offsets.bq), width, projected, width));
    q_projected = projected;
    k_projected = projected + q_width * in_size;
    p.q = q_projected;
    p.k = k_projected;
    p.v = projected + (q_width + kv_width) * in_size;
    p.q_row_stride = p.kv_row_stride = width;
  } else {
    char* qp = projected;
    char* kp = qp + q_rows * q_width * in_size;
    char* vp = kp + kv_rows * kv_width * in_size;
    RETURN_IF_ERROR_STATUS(Linear(*lane, t, t, query.device, q_rows, s.d_model, s.d_model, matrix(offsets.q),
                                  offsets.ld_q, bias(offsets.bq), q_width, qp, q_width));
    RETURN_IF_ERROR_STATUS(Linear(*lane, t, t, key_in, kv_rows, s.d_kv_in, s.d_kv_in, matrix(offsets.k),
                                  offsets.ld_k, bias(offsets.bk), kv_width, kp, kv_width));
    RETURN_IF_ERROR_STATUS(Linear(*lane, t, t, value_in, kv_rows, s.d_v_in, s.d_v_in, matrix(offsets.v),
                                  offsets.ld_v, bias(offsets.bv), kv_width, vp, kv_width));
    q_projected = qp;
    k_projected = kp;
    p.q = qp;
    p.k = kp;
    p.v = vp;
    p.q_row_stride = q_width;
    p.kv_row_stride = kv_width;
  }
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

  const int c = direct ? out_dtype : cuda::kF32;
  char* y = direct ? out.device : out_f32;
  RETURN_IF_ERROR_STATUS(Linear(*lane, t, c, heads, q_rows, q_width, q_width, matrix(offsets.o), s.d_model,
                                bias(offsets.bo), s.d_model, y, s.d_model));
  if (contribution.bytes > 0) {
    // The heads as the output product read them (after the head mask), against the output before any conversion.
    RETURN_IF_CUDA_ERROR(cuda::LaunchHeadContributions(heads, t, q_rows, h.num_heads, h.head_dim, matrix(offsets.o), t,
                                                       y, c, s.d_model, reinterpret_cast<float*>(contribution.device),
                                                       lane->stream),
                         "launching the head contributions");
  }
  if (!direct) {
    RETURN_IF_CUDA_ERROR(
        cuda::LaunchConvert(out_f32, cuda::kF32, out.device, out_dtype, q_rows * s.d_model, lane->stream),
        "converting the output");
  }
  RETURN_IF_ERROR_STATUS(ReturnOutputs({&out, &weights, &contribution, &stats.lse, &stats.entropy,
                                        &stats.confidence, &stats.distance, &stats.sink},
                                       lane->stream, "the layer on the GPU"));
  for (int64_t r = 0; a.stats.contribution != nullptr && r < q_rows; ++r) {
    const int64_t b = r / s.q_len, i = r % s.q_len;
    for (int64_t head = 0; head < h.num_heads; ++head) {
      a.stats.contribution[(b * h.num_heads + head) * s.q_len + i] = contribution_rows[r * h.num_heads + head];
    }
  }
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
