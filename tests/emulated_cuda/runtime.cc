// The emulated CUDA runtime (runtime.h): the entry points the CUDA backend calls, with the runtime's signatures so
// that its code compiles unchanged. Everything else of libcudart is absent: a new call in the backend fails to link
// here until it is emulated.
#include "tests/emulated_cuda/runtime.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

// The runtime's opaque stream type, defined here: a queue of work not yet run.
struct CUstream_st {
  std::deque<std::function<cudaError_t()>> work;
};

namespace mha {
namespace emulation {
namespace {

constexpr int64_t kAlignment = 256;

struct Device {
  std::mutex mu;  // guards everything here; held while work runs
  int64_t capacity = int64_t{1} << 30;
  int64_t in_use = 0;          // cudaMalloc's bytes
  int64_t managed_in_use = 0;  // cudaMallocManaged's, not counted against capacity
  std::map<const char*, int64_t> device_blocks, managed_blocks, pinned_blocks;  // start -> bytes
  std::set<CUstream_st*> streams;
  CUstream_st default_stream;
  cudaError_t sticky = cudaSuccess;
};

Device& TheDevice() {
  static Device* device = new Device;  // never destroyed: backends may outlive static destruction order
  return *device;
}

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t Fail(cudaError_t error) {
  last_error = error;
  return error;
}

CUstream_st* Resolve(Device& d, cudaStream_t stream) {
  // 0, cudaStreamLegacy and cudaStreamPerThread all name the default stream here.
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return &d.default_stream;
  return stream;
}

bool Inside(const std::map<const char*, int64_t>& blocks, const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = blocks.upper_bound(c);
  if (it == blocks.begin()) return false;
  --it;
  return c >= it->first && bytes >= 0 && c + bytes <= it->first + it->second;
}

// Memory a kernel, a device-side copy or cuBLAS may touch: device and managed allocations.
bool DeviceAccessible(const Device& d, const void* p, int64_t bytes) {
  return Inside(d.device_blocks, p, bytes) || Inside(d.managed_blocks, p, bytes);
}

// Runs the stream's work in order, with d.mu held. Returns the sticky error.
cudaError_t Drain(Device& d, CUstream_st* s) {
  while (!s->work.empty()) {
    std::function<cudaError_t()> work = std::move(s->work.front());
    s->work.pop_front();
    if (d.sticky != cudaSuccess) continue;  // a faulted device runs nothing more
    if (const cudaError_t error = work(); error != cudaSuccess) d.sticky = error;
  }
  return d.sticky;
}

cudaError_t DrainAll(Device& d) {
  Drain(d, &d.default_stream);
  for (CUstream_st* s : d.streams) Drain(d, s);
  return d.sticky;
}

// `bytes` exactly (no rounding up: under ASan, an access one byte past the end is reported), 256-byte aligned as
// cudaMalloc's are.
void* Allocate(int64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlignment, static_cast<size_t>(std::max<int64_t>(bytes, 1))) != 0) return nullptr;
  std::memset(p, 0xff, static_cast<size_t>(bytes));  // NaN in fp32, fp16 and bf16
  return p;
}

}  // namespace

void SetDeviceMemory(int64_t bytes) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  d.capacity = bytes;
}

int64_t DeviceMemoryInUse() {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.in_use;
}

void EnqueueWork(cudaStream_t stream, std::function<cudaError_t()> work) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  Resolve(d, stream)->work.push_back(std::move(work));
}

bool IsDeviceRange(const void* p, int64_t bytes) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  return DeviceAccessible(d, p, bytes);
}

int64_t ManagedMemoryInUse() {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.managed_in_use;
}

}  // namespace emulation
}  // namespace mha

using mha::emulation::Device;
using mha::emulation::TheDevice;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : mha::emulation::Fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return mha::emulation::Fail(cudaErrorInvalidDevice);
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "emulated sm_90 on the host", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = static_cast<size_t>(d.capacity);
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlock = 48 << 10;
  prop->sharedMemPerBlockOptin = 227 << 10;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  *p = nullptr;
  if (static_cast<int64_t>(bytes) > d.capacity - d.in_use) return mha::emulation::Fail(cudaErrorMemoryAllocation);
  void* block = mha::emulation::Allocate(static_cast<int64_t>(bytes));
  if (block == nullptr) return mha::emulation::Fail(cudaErrorMemoryAllocation);
  d.device_blocks[static_cast<const char*>(block)] = static_cast<int64_t>(bytes);
  d.in_use += static_cast<int64_t>(bytes);
  *p = block;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  mha::emulation::DrainAll(d);  // cudaFree waits for the device
  if (auto it = d.device_blocks.find(static_cast<const char*>(p)); it != d.device_blocks.end()) {
    d.in_use -= it->second;
    d.device_blocks.erase(it);
  } else if (auto managed = d.managed_blocks.find(static_cast<const char*>(p)); managed != d.managed_blocks.end()) {
    d.managed_in_use -= managed->second;
    d.managed_blocks.erase(managed);
  } else {
    return mha::emulation::Fail(cudaErrorInvalidValue);
  }
  std::free(p);
  return cudaSuccess;
}

// Managed memory: host memory (filled like cudaMalloc's), tracked but not counted against the device's capacity,
// which managed memory may exceed on a GPU. The runtime refuses 0 bytes and flags other than Global or Host.
cudaError_t cudaMallocManaged(void** p, size_t bytes, unsigned int flags) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  *p = nullptr;
  if (bytes == 0 || (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost)) {
    return mha::emulation::Fail(cudaErrorInvalidValue);
  }
  void* block = mha::emulation::Allocate(static_cast<int64_t>(bytes));
  if (block == nullptr) return mha::emulation::Fail(cudaErrorMemoryAllocation);
  d.managed_blocks[static_cast<const char*>(block)] = static_cast<int64_t>(bytes);
  d.managed_in_use += static_cast<int64_t>(bytes);
  *p = block;
  return cudaSuccess;
}

// Advice changes no result: checked (a range inside one managed allocation, a known advice, a location it accepts:
// the device or, where the runtime allows it, the host) and otherwise ignored.
cudaError_t cudaMemAdvise(const void* p, size_t count, enum cudaMemoryAdvise advice, struct cudaMemLocation location) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  if (count == 0 || !mha::emulation::Inside(d.managed_blocks, p, static_cast<int64_t>(count))) {
    return mha::emulation::Fail(cudaErrorInvalidValue);
  }
  switch (advice) {
    case cudaMemAdviseSetReadMostly:
    case cudaMemAdviseUnsetReadMostly:
    case cudaMemAdviseUnsetPreferredLocation:
      return cudaSuccess;  // the location is ignored
    case cudaMemAdviseSetPreferredLocation:
    case cudaMemAdviseSetAccessedBy:
    case cudaMemAdviseUnsetAccessedBy:
      if (location.type == cudaMemLocationTypeHost) return cudaSuccess;
      if (location.type != cudaMemLocationTypeDevice) return mha::emulation::Fail(cudaErrorInvalidValue);
      return location.id == 0 ? cudaSuccess : mha::emulation::Fail(cudaErrorInvalidDevice);
    default:
      return mha::emulation::Fail(cudaErrorInvalidValue);
  }
}

// As the runtime answers since CUDA 11: any pointer inside an allocation gets its type, and host memory the runtime
// does not know is Unregistered (cudaSuccess, no device or host alias).
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* p) {
  if (attributes == nullptr) return mha::emulation::Fail(cudaErrorInvalidValue);
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  std::memset(attributes, 0, sizeof(*attributes));
  void* const alias = const_cast<void*>(p);
  if (mha::emulation::Inside(d.device_blocks, p, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->devicePointer = alias;
  } else if (mha::emulation::Inside(d.managed_blocks, p, 1)) {
    attributes->type = cudaMemoryTypeManaged;
    attributes->devicePointer = alias;
    attributes->hostPointer = alias;
  } else if (mha::emulation::Inside(d.pinned_blocks, p, 1)) {
    attributes->type = cudaMemoryTypeHost;
    attributes->devicePointer = alias;  // mapped: unified addressing
    attributes->hostPointer = alias;
  } else {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;  // no device holds it
  }
  return cudaSuccess;
}

// The attributes the backend asks for; others are not emulated (cudaErrorInvalidValue).
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attribute, int device) {
  if (device != 0) return mha::emulation::Fail(cudaErrorInvalidDevice);
  switch (attribute) {
    case cudaDevAttrManagedMemory:
    case cudaDevAttrConcurrentManagedAccess:
      *value = 1;
      return cudaSuccess;
    default:
      return mha::emulation::Fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  *p = mha::emulation::Allocate(static_cast<int64_t>(bytes));
  if (*p == nullptr) return mha::emulation::Fail(cudaErrorMemoryAllocation);
  d.pinned_blocks[static_cast<const char*>(*p)] = static_cast<int64_t>(bytes);
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  mha::emulation::DrainAll(d);
  if (d.pinned_blocks.erase(static_cast<const char*>(p)) == 0) return mha::emulation::Fail(cudaErrorInvalidValue);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  *stream = new CUstream_st;
  d.streams.insert(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.streams.erase(stream) == 0) return mha::emulation::Fail(cudaErrorInvalidResourceHandle);
  mha::emulation::Drain(d, stream);  // its work still completes
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  CUstream_st* s = mha::emulation::Resolve(d, stream);
  if (s != &d.default_stream && d.streams.count(s) == 0) return mha::emulation::Fail(cudaErrorInvalidResourceHandle);
  return mha::emulation::Drain(d, s);
}

cudaError_t cudaDeviceSynchronize() {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  return mha::emulation::DrainAll(d);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  const int64_t bytes = static_cast<int64_t>(count);
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault) return mha::emulation::Fail(cudaErrorInvalidValue);
  if ((dst_device && !mha::emulation::DeviceAccessible(d, dst, bytes)) ||
      (src_device && !mha::emulation::DeviceAccessible(d, src, bytes))) {
    return mha::emulation::Fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = mha::emulation::Resolve(d, stream);
  if (kind == cudaMemcpyHostToDevice && !mha::emulation::Inside(d.pinned_blocks, src, bytes)) {
    // From pageable memory the runtime stages the source before returning: the caller may reuse it at once.
    auto copy = std::make_shared<std::string>(static_cast<const char*>(src), count);
    s->work.push_back([dst, copy] {
      std::memcpy(dst, copy->data(), copy->size());
      return cudaSuccess;
    });
    return cudaSuccess;
  }
  if (kind == cudaMemcpyDeviceToHost && !mha::emulation::Inside(d.pinned_blocks, dst, bytes)) {
    // Into pageable memory the copy is synchronous.
    mha::emulation::Drain(d, s);
    if (d.sticky == cudaSuccess) std::memcpy(dst, src, count);
    return d.sticky;
  }
  s->work.push_back([dst, src, count] {
    std::memcpy(dst, src, count);
    return cudaSuccess;
  });
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t error = mha::emulation::last_error;
  mha::emulation::last_error = cudaSuccess;
  if (error != cudaSuccess) return error;
  Device& d = TheDevice();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.sticky;
}

namespace mha {
namespace emulation {
namespace {

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};

// The runtime's names and texts of the errors this emulation returns.
const ErrorText& TextOf(cudaError_t error) {
  static constexpr ErrorText kTexts[] = {
      {cudaSuccess, "cudaSuccess", "no error"},
      {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
      {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
      {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
      {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
      {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
      {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
  };
  static constexpr ErrorText kUnknown = {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"};
  for (const ErrorText& t : kTexts) {
    if (t.error == error) return t;
  }
  return kUnknown;
}

}  // namespace
}  // namespace emulation
}  // namespace mha

const char* cudaGetErrorName(cudaError_t error) { return mha::emulation::TextOf(error).name; }

const char* cudaGetErrorString(cudaError_t error) { return mha::emulation::TextOf(error).text; }
