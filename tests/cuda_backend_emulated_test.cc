// The CUDA backend on the emulated runtime and cuBLAS (tests/emulated_cuda) where only the emulation can put it:
// device memory that runs out, memory left behind, and the emulation's own promise that work waits for the host.
// Its numbers against the reference are backend_conformance_emulated_cuda_test's.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/reference/reference_backend.h"
#include "server/backends/registry.h"
#include "server/sessions/block_pool.h"
#include "tests/emulated_cuda/runtime.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
using ::mha::testing::RandomVector;
using ::testing::HasSubstr;

// fp32 attention alone, B = 2, H = 4, Hkv = 2, d_k = 64, causal: inputs, and the call writing `out`.
class Sdpa {
 public:
  Sdpa(int64_t q_len, int64_t kv_len) {
    s_.batch = 2;
    s_.q_len = q_len;
    s_.kv_len = kv_len;
    s_.heads.num_heads = 4;
    s_.heads.num_kv_heads = 2;
    s_.heads.head_dim = 64;
    s_.heads.causal = true;
    s_.heads.scale = 0.125f;
    q_ = RandomVector(s_.batch * q_len * s_.heads.q_width(), 1);
    k_ = RandomVector(s_.batch * kv_len * s_.heads.kv_width(), 2);
    v_ = RandomVector(s_.batch * kv_len * s_.heads.kv_width(), 3);
  }
  // Bytes of device memory the inputs and the output take.
  int64_t tensor_bytes() const { return 4 * static_cast<int64_t>(2 * q_.size() + 2 * k_.size()); }

  absl::Status Run(Backend& backend, std::vector<float>& out) const {
    out.assign(q_.size(), std::nanf(""));
    SdpaArgs a;
    a.shape = s_;
    a.q = {q_.data(), v1::FP32};
    a.k = {k_.data(), v1::FP32};
    a.v = {v_.data(), v1::FP32};
    a.out = {out.data(), v1::FP32};
    return backend.ScaledDotProductAttention(a);
  }

 private:
  AttentionShape s_;
  std::vector<float> q_, k_, v_;
};

// An fp32 self-attention layer, B = 1, T = 16, d_model = 64, H = 4, d_k = 16: inputs, weights, and the call.
class SelfAttention {
 public:
  // resident_id 0: inline weights, copied per call; else a stored layer the backend keeps resident.
  explicit SelfAttention(uint64_t resident_id, uint32_t seed = 1) : resident_id_(resident_id) {
    s_.batch = 1;
    s_.q_len = s_.kv_len = 16;
    s_.d_model = s_.d_kv_in = s_.d_v_in = 64;
    s_.heads.num_heads = s_.heads.num_kv_heads = 4;
    s_.heads.head_dim = 16;
    s_.heads.scale = 0.25f;
    x_ = RandomVector(16 * 64, seed);
    for (int i = 0; i < 4; ++i) w_[i] = RandomVector(64 * 64, seed + 1 + i, 0.125f);
  }
  // Device bytes of the layer's resident copy: four fp32 matrices, and 4 bytes for its (absent) biases.
  static int64_t resident_bytes() { return 4 * 64 * 64 * 4 + 4; }

  absl::Status Run(Backend& backend, std::vector<float>& out) const {
    out.assign(x_.size(), std::nanf(""));
    MhaArgs a;
    a.shape = s_;
    a.weights.w_q = w_[0].data();
    a.weights.w_k = w_[1].data();
    a.weights.w_v = w_[2].data();
    a.weights.w_o = w_[3].data();
    a.weights.ld_q = a.weights.ld_k = a.weights.ld_v = 64;
    a.weights.resident_id = resident_id_;
    a.kv_source = KvSource::kQuery;
    a.query = a.key = a.value = {x_.data(), v1::FP32};
    a.out = {out.data(), v1::FP32};
    return backend.MultiHeadAttention(a);
  }

 private:
  AttentionShape s_;
  uint64_t resident_id_;
  std::vector<float> x_, w_[4];
};

// max |got - want| / (1 + |want|).
double LargestError(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i])));
  return worst;
}

constexpr int64_t kMiB = int64_t{1} << 20;

class EmulatedCudaBackendTest : public ::testing::Test {
 protected:
  void TearDown() override { emulation::SetDeviceMemory(int64_t{1} << 30); }

  std::unique_ptr<CudaBackend> Create(const CudaBackend::Options& options = CudaBackend::Options()) {
    absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(options);
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? *std::move(backend) : nullptr;
  }
};

TEST_F(EmulatedCudaBackendTest, ReportsTheEmulatedDevice) {
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  EXPECT_THAT(backend->device(), HasSubstr("emulated sm_90 on the host (sm_90, 1024 MiB"));
  EXPECT_EQ(backend->concurrent_calls(), 2);
}

// Layer inputs of two dtypes in one Extend are refused when the call is chosen a backend (BACKEND_AUTO then takes
// it to the CPU), not at compute with INTERNAL for every call batched with it.
TEST_F(EmulatedCudaBackendTest, PagedCallsMixingInputDtypesAreUnimplemented) {
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  PagedProblem problem;
  problem.heads.num_heads = problem.heads.num_kv_heads = 2;
  problem.heads.head_dim = 64;
  problem.d_model = 128;
  problem.cache = {2, 64, 32, v1::FP16};
  problem.input_dtype = v1::FP16;
  EXPECT_TRUE(backend->SupportsPaged(problem).ok());
  problem.mixed_inputs = true;
  const absl::Status status = backend->SupportsPaged(problem);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(status.message(), HasSubstr("this call's items mix them"));
}

TEST_F(EmulatedCudaBackendTest, ACallLargerThanTheDeviceIsRefusedUpFront) {
  emulation::SetDeviceMemory(1 * kMiB);
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  const Sdpa large(1024, 1024);  // 6 MiB of tensors
  ASSERT_GT(large.tensor_bytes(), 1 * kMiB);
  std::vector<float> out;
  const absl::Status status = large.Run(*backend, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("bytes of device memory"));
}

TEST_F(EmulatedCudaBackendTest, AFailedAllocationIsResourceExhaustedAndTheNextCallSucceeds) {
  emulation::SetDeviceMemory(2 * kMiB);
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  const Sdpa call(128, 128);  // 0.75 MiB of tensors: fits the device, not what another user leaves of it
  ASSERT_LT(call.tensor_bytes(), 1 * kMiB);
  void* other_user = nullptr;
  ASSERT_EQ(cudaMalloc(&other_user, 3 * kMiB / 2), cudaSuccess);
  std::vector<float> out;
  const absl::Status refused = call.Run(*backend, out);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("cudaErrorMemoryAllocation"));
  ASSERT_EQ(cudaFree(other_user), cudaSuccess);

  ASSERT_TRUE(call.Run(*backend, out).ok());
  ReferenceBackend reference;
  std::vector<float> want;
  ASSERT_TRUE(call.Run(reference, want).ok());
  EXPECT_TRUE(AllClose(out, want, 2e-5, 1e-4));
}

TEST_F(EmulatedCudaBackendTest, ReleasesAllDeviceMemoryWhenDestroyed) {
  const int64_t before = emulation::DeviceMemoryInUse();
  {
    std::unique_ptr<CudaBackend> backend = Create();
    ASSERT_NE(backend, nullptr);
    std::vector<float> out;
    ASSERT_TRUE(Sdpa(40, 50).Run(*backend, out).ok());
    EXPECT_GT(emulation::DeviceMemoryInUse(), before);
  }
  EXPECT_EQ(emulation::DeviceMemoryInUse(), before);
}

TEST_F(EmulatedCudaBackendTest, TheRegistryConfiguresTheCudaBackendFromItsOptions) {
  BackendOptions options;
  options.cuda_streams = 3;
  options.cuda_allow_tf32 = true;
  const std::unique_ptr<BackendRegistry> registry = BackendRegistry::Create(options);
  absl::StatusOr<Backend*> cuda = registry->Find(kCudaBackend, "backend");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ((*cuda)->concurrent_calls(), 3);
  EXPECT_THAT((*cuda)->device(), HasSubstr("3 streams, TF32 allowed"));
}

// fp32 keeps fp32 tolerances unless TF32 is allowed: the emulated cuBLAS rounds the products' inputs to TF32's 10
// mantissa bits when the backend asks for CUBLAS_COMPUTE_32F_FAST_TF32.
TEST_F(EmulatedCudaBackendTest, Fp32ProjectionsUseTf32OnlyWhenAllowed) {
  const SelfAttention layer(0);
  ReferenceBackend reference;
  std::vector<float> want, fp32, tf32;
  ASSERT_TRUE(layer.Run(reference, want).ok());
  std::unique_ptr<CudaBackend> strict = Create();
  ASSERT_NE(strict, nullptr);
  ASSERT_TRUE(layer.Run(*strict, fp32).ok());
  CudaBackend::Options options;
  options.allow_tf32 = true;
  std::unique_ptr<CudaBackend> fast = Create(options);
  ASSERT_NE(fast, nullptr);
  ASSERT_TRUE(layer.Run(*fast, tf32).ok());
  // fp32 errors measured: 5e-8 without TF32, 9e-5 with it (relative to 1 + |want|).
  EXPECT_LT(LargestError(fp32, want), 1e-6);
  EXPECT_GT(LargestError(tf32, want), 2e-5);
  EXPECT_LT(LargestError(tf32, want), 1e-3);
}

// Stored layers stay resident up to the cache's size; beyond it the least recently used is dropped.
TEST_F(EmulatedCudaBackendTest, StoredLayersBeyondTheCacheAreDropped) {
  for (const bool small_cache : {false, true}) {
    CudaBackend::Options options;
    options.layer_cache_bytes = small_cache ? SelfAttention::resident_bytes() : 0;
    std::unique_ptr<CudaBackend> backend = Create(options);
    ASSERT_NE(backend, nullptr);
    std::vector<float> out;
    ASSERT_TRUE(SelfAttention(/*resident_id=*/1).Run(*backend, out).ok());
    const int64_t one_layer = emulation::DeviceMemoryInUse();
    ASSERT_TRUE(SelfAttention(/*resident_id=*/2, /*seed=*/7).Run(*backend, out).ok());
    const int64_t grown = emulation::DeviceMemoryInUse() - one_layer;
    if (small_cache) {
      EXPECT_EQ(grown, 0) << "the first layer was not dropped";
    } else {
      EXPECT_EQ(grown, SelfAttention::resident_bytes()) << "the second layer was not kept";
    }
  }
}

// The emulation's promise that gives the backend's tests their teeth: what is enqueued happens when the host waits,
// not before, so a result read without cudaStreamSynchronize is missing, as it may be on a GPU.
TEST(EmulatedCudaRuntimeTest, AnAsynchronousCopyLandsWhenTheStreamIsWaitedFor) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void *device = nullptr, *pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 4), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, 4), cudaSuccess);
  const float value = 1.5f;
  std::memcpy(pinned, &value, 4);
  ASSERT_EQ(cudaMemcpyAsync(device, pinned, 4, cudaMemcpyHostToDevice, stream), cudaSuccess);
  std::memset(pinned, 0, 4);  // overwritten before the copy ran: the copy takes the new bytes, as a GPU's might
  ASSERT_EQ(cudaMemcpyAsync(pinned, device, 4, cudaMemcpyDeviceToHost, stream), cudaSuccess);
  float got;
  std::memcpy(&got, pinned, 4);
  EXPECT_EQ(got, 0.0f);  // nothing ran yet
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::memcpy(&got, pinned, 4);
  EXPECT_EQ(got, 0.0f);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(EmulatedCudaRuntimeTest, ACopyBeyondItsAllocationIsRefused) {
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  std::vector<char> host(128);
  EXPECT_EQ(cudaMemcpyAsync(device, host.data(), 65, cudaMemcpyHostToDevice, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpyAsync(static_cast<char*>(device) + 1, host.data(), 64, cudaMemcpyHostToDevice, nullptr),
            cudaErrorInvalidValue);
  cudaGetLastError();
  EXPECT_EQ(cudaMemcpyAsync(device, host.data(), 64, cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

// The memory kind cudaPointerGetAttributes reports for `p` (what the paged kernels ask before reading a block in
// place), or -1 when the call fails.
int MemoryTypeOf(const void* p) {
  cudaPointerAttributes attributes;
  return cudaPointerGetAttributes(&attributes, p) == cudaSuccess ? static_cast<int>(attributes.type) : -1;
}

TEST(EmulatedCudaRuntimeTest, PointerAttributesTellEachKindOfMemoryApart) {
  void *device = nullptr, *managed = nullptr, *pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1024), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&managed, 1024, cudaMemAttachGlobal), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, 1024), cudaSuccess);
  std::vector<char> pageable(1024);
  EXPECT_EQ(MemoryTypeOf(device), cudaMemoryTypeDevice);
  EXPECT_EQ(MemoryTypeOf(static_cast<char*>(device) + 1023), cudaMemoryTypeDevice);
  EXPECT_EQ(MemoryTypeOf(managed), cudaMemoryTypeManaged);
  EXPECT_EQ(MemoryTypeOf(static_cast<char*>(managed) + 1023), cudaMemoryTypeManaged);
  EXPECT_EQ(MemoryTypeOf(pinned), cudaMemoryTypeHost);
  EXPECT_EQ(MemoryTypeOf(pageable.data()), cudaMemoryTypeUnregistered);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFree(managed), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(MemoryTypeOf(managed), cudaMemoryTypeUnregistered);  // freed: no longer the runtime's
}

TEST(EmulatedCudaRuntimeTest, MemAdviseChecksItsRangeAndLocation) {
  void* managed = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, 4096, cudaMemAttachGlobal), cudaSuccess);
  cudaMemLocation device0 = {};
  device0.type = cudaMemLocationTypeDevice;
  device0.id = 0;
  EXPECT_EQ(cudaMemAdvise(managed, 4096, cudaMemAdviseSetPreferredLocation, device0), cudaSuccess);
  EXPECT_EQ(cudaMemAdvise(managed, 4097, cudaMemAdviseSetPreferredLocation, device0), cudaErrorInvalidValue);
  cudaMemLocation device1 = device0;
  device1.id = 1;
  EXPECT_EQ(cudaMemAdvise(managed, 4096, cudaMemAdviseSetPreferredLocation, device1), cudaErrorInvalidDevice);
  std::vector<char> pageable(4096);
  EXPECT_EQ(cudaMemAdvise(pageable.data(), 4096, cudaMemAdviseSetPreferredLocation, device0), cudaErrorInvalidValue);
  cudaGetLastError();
  EXPECT_EQ(cudaFree(managed), cudaSuccess);
}

TEST_F(EmulatedCudaBackendTest, TheCacheArenaIsManagedMemoryNotCountedAgainstTheDevice) {
  emulation::SetDeviceMemory(4 * kMiB);  // managed memory may exceed the device's, as on a GPU
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  const int64_t device_before = emulation::DeviceMemoryInUse();
  const int64_t managed_before = emulation::ManagedMemoryInUse();
  {
    absl::StatusOr<std::unique_ptr<CacheArena>> arena = backend->AllocateCacheArena(8 * kMiB);
    ASSERT_TRUE(arena.ok()) << arena.status();
    EXPECT_EQ((*arena)->bytes(), 8 * kMiB);
    EXPECT_EQ((*arena)->describe(), "CUDA managed memory on emulated sm_90 on the host (device 0)");
    EXPECT_EQ(MemoryTypeOf((*arena)->base()), cudaMemoryTypeManaged);
    EXPECT_EQ(MemoryTypeOf((*arena)->base() + 8 * kMiB - 1), cudaMemoryTypeManaged);
    EXPECT_EQ(emulation::ManagedMemoryInUse(), managed_before + 8 * kMiB);
    EXPECT_EQ(emulation::DeviceMemoryInUse(), device_before);
  }
  EXPECT_EQ(emulation::ManagedMemoryInUse(), managed_before);  // cudaFree'd with the arena
}

TEST_F(EmulatedCudaBackendTest, ABlockPoolOnTheCacheArenaHandsOutManagedBlocks) {
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<std::unique_ptr<CacheArena>> arena = backend->AllocateCacheArena(2 * BlockPool::kChunkBytes);
  ASSERT_TRUE(arena.ok()) << arena.status();
  {
    BlockPool pool((*arena)->base(), (*arena)->bytes());
    EXPECT_EQ(pool.capacity_bytes(), 2 * BlockPool::kChunkBytes);
    std::vector<char*> blocks;
    for (int i = 0; i < 4; ++i) {
      char* block = pool.Allocate(BlockPool::kChunkBytes / 2);
      ASSERT_NE(block, nullptr) << i;
      EXPECT_EQ(MemoryTypeOf(block), cudaMemoryTypeManaged) << i;
      EXPECT_TRUE(emulation::IsDeviceRange(block, BlockPool::kChunkBytes / 2)) << i;  // kernels may read it
      std::memset(block, i, BlockPool::kChunkBytes / 2);                               // and the host write it
      blocks.push_back(block);
    }
    EXPECT_EQ(pool.Allocate(64), nullptr);
    for (char* block : blocks) pool.Unref(block);
  }  // the pool first, then the arena
}

TEST_F(EmulatedCudaBackendTest, TheCacheArenaRefusesNoBytes) {
  std::unique_ptr<CudaBackend> backend = Create();
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->AllocateCacheArena(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mha
