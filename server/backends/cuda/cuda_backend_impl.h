// The CUDA backend's internals, shared by its stateless calls (cuda_backend.cc) and its paged calls
// (cuda_paged.cc): device and pinned buffers, the carving of a call's pieces, resident layers, the lanes (a stream,
// a cuBLAS handle and buffers each) and the Impl that owns them. Not part of the backend's interface.
#ifndef MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_IMPL_H_
#define MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_IMPL_H_

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
#include "server/backends/cuda/cuda_status.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/synthetic.h"

#if defined(MHA_CUDA_EMULATION) && defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MHA_GUARD_PIECES 1
#endif

namespace mha {
namespace cuda_internal {

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

// The kernels' RoPE frequencies for a sequence of seq_len tokens (rope_frequencies.h, every rope_type). h.has_rope()
// must hold; rope_dim <= head_dim <= kMaxHeadDim, which PlanFlash and SupportsPaged check, fits the table.
cuda::RopeTable RopeTableOf(const HeadSpec& h, int64_t seq_len);

// Lane buffers above this size are freed when their call ends, so that one huge request does not pin its memory.
inline constexpr int64_t kKeptLaneBytes = int64_t{1} << 30;
inline constexpr int64_t kAlignment = 256;

inline int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

inline cudaDataType_t CudaType(int dtype) {
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

inline cudaError_t DeviceAllocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t HostAllocate(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }

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
inline constexpr int64_t kGuardBytes = kAlignment;
inline void Unpoison(char* p, int64_t bytes) { ASAN_UNPOISON_MEMORY_REGION(p, bytes); }
#else
inline constexpr int64_t kGuardBytes = 0;
inline void Unpoison(char*, int64_t) {}
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

inline LayerOffsets OffsetsFor(const AttentionShape& s, const LayerWeights& w) {
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
inline absl::Status UploadLayer(const AttentionShape& s, const LayerWeights& w, const LayerOffsets& o, int dtype,
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

struct Staged;  // below

}  // namespace cuda_internal

using namespace cuda_internal;  // NOLINT: the backend's own helpers

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
  int device() const { return options_.device; }  // the CUDA device ordinal
  const cudaDeviceProp& props() const { return props_; }
  absl::Status Sdpa(const SdpaArgs& a);
  absl::Status Mha(const MhaArgs& a);
  absl::Status Paged(const PagedArgs& a);  // cuda_paged.cc
  struct PagedCall;                          // one paged call's pieces (cuda_paged.cc)

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

  // The layer's matrices and biases on the device: its resident copy (kept alive by *resident), or inline weights
  // (resident_id 0) uploaded into this call's pieces *matrices, *biases and `staging` (fp32, for 16-bit dtypes).
  absl::Status LayerOnDevice(Lane& lane, const AttentionShape& s, const LayerWeights& w, int dtype,
                             const LayerOffsets& o, char** matrices, float** biases, float* staging,
                             std::shared_ptr<const DeviceLayer>* resident);
  absl::Status OutputMha(Lane& lane, const MhaArgs& a, const char* heads, const char* w_o, const float* b_o,
                         const Staged& out, char* out_f32, const Staged& contribution) const;
  absl::Status ProjectMha(Lane& lane, const MhaArgs& a, const LayerOffsets& o, const char* matrices,
                          const float* biases, std::array<const char*, 3> inputs, char* projected,
                          cuda::AttentionParams& p, char** q, char** k) const;
  // Paged calls' steps (cuda_paged.cc).
  absl::Status ProjectPaged(Lane& lane, const PagedProblem& pr, bool fused, const LayerOffsets& o, PagedCall& c,
                            int64_t rows) const;
  absl::Status OutputPaged(Lane& lane, const PagedProblem& pr, const LayerOffsets& o, PagedCall& c, int64_t rows,
                           bool contribution) const;
  absl::Status FinishPaged(const PagedArgs& a, PagedCall& c, cudaStream_t stream) const;

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

namespace cuda_internal {

// Host tensors staged through the lane's pinned buffer.
struct Staged {
  const void* host = nullptr;  // input source, or output destination
  char* pinned = nullptr;
  char* device = nullptr;
  int64_t bytes = 0;
};

inline absl::Status CopyIn(const Staged& t, cudaStream_t stream) {
  if (t.bytes == 0) return absl::OkStatus();
  std::memcpy(t.pinned, t.host, t.bytes);
  return CudaStatus(cudaMemcpyAsync(t.device, t.pinned, t.bytes, cudaMemcpyHostToDevice, stream),
                    "copying an input to the device");
}

inline absl::Status StartCopyOut(const Staged& t, cudaStream_t stream) {
  if (t.bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(t.pinned, t.device, t.bytes, cudaMemcpyDeviceToHost, stream),
                    "copying an output from the device");
}

inline void FinishCopyOut(const Staged& t) {
  if (t.bytes > 0) std::memcpy(const_cast<void*>(t.host), t.pinned, t.bytes);
}

// Copies the outputs back through the pinned buffer once everything enqueued on `stream` has run.
inline absl::Status ReturnOutputs(std::initializer_list<const Staged*> outputs, cudaStream_t stream, const char* what) {
  for (const Staged* t : outputs) RETURN_IF_ERROR_STATUS(StartCopyOut(*t, stream));
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), what);
  for (const Staged* t : outputs) FinishCopyOut(*t);
  return absl::OkStatus();
}

inline absl::Status Stopped(const StopSignal* stop) { return stop == nullptr ? absl::OkStatus() : stop->Check(); }

// The mask inputs of a call on the device.
struct DeviceMask {
  Staged key_lengths, additive, head_mask;
};

inline void SizeMask(const AttentionShape& s, const AttentionMask& mask, absl::Span<const float> head_mask, DeviceMask& m) {
  m.key_lengths = {mask.key_lengths.data(), nullptr, nullptr, static_cast<int64_t>(mask.key_lengths.size()) * 4};
  const int64_t additive = mask.additive == nullptr ? 0 : (mask.additive_per_batch ? s.batch : 1) * s.q_len * s.kv_len;
  m.additive = {mask.additive, nullptr, nullptr, additive * 4};
  m.head_mask = {head_mask.data(), nullptr, nullptr, static_cast<int64_t>(head_mask.size()) * 4};
}

// The attention kernel's parameters that come from the call's shape and masks (mask tensors already on the device).
inline cuda::AttentionParams ShapeParams(const AttentionShape& s, const AttentionMask& mask, const DeviceMask& device) {
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

// The CUDA backend computes in one dtype, the query's: a request whose tensors mix dtypes is refused (the CPU
// backend serves it).
inline absl::Status OneDtype(std::initializer_list<const ConstTensor*> tensors) {
  for (const ConstTensor* t : tensors) {
    if (t->dtype != (*tensors.begin())->dtype) {
      return absl::UnimplementedError(
          "the CUDA backend computes query, key and value of one dtype; this request mixes them");
    }
  }
  return absl::OkStatus();
}

}  // namespace cuda_internal
}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_CUDA_CUDA_BACKEND_IMPL_H_
