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
  int64_t in_use = 0;
  std::map<const char*, int64_t> device_blocks, pinned_blocks;  // start -> bytes
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
  return Inside(d.device_blocks, p, bytes);
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
  auto it = d.device_blocks.find(static_cast<const char*>(p));
  if (it == d.device_blocks.end()) return mha::emulation::Fail(cudaErrorInvalidValue);
  d.in_use -= it->second;
  d.device_blocks.erase(it);
  std::free(p);
  return cudaSuccess;
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
  if ((dst_device && !mha::emulation::Inside(d.device_blocks, dst, bytes)) ||
      (src_device && !mha::emulation::Inside(d.device_blocks, src, bytes))) {
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
