// Shared-memory regions for tensors (RegisterSharedMemory, mha.v1.SharedMemoryRef): POSIX shared-memory objects of
// this host that clients create and the server maps, so that a tensor's bytes reach the backend, and an output
// reaches the client, without the socket's copies.
//
// A client owns the object and could shrink it while the server reads or writes the mapping (or leave pages unbacked
// in a /dev/shm too full to back them), which would raise SIGBUS and end the process. The regions are guarded: a SIGBUS inside a registered mapping maps anonymous memory
// over the lost tail of the region (so the access completes, reading zeros or writing nowhere) and marks the region
// shrunk; every call that touched it then fails with FAILED_PRECONDITION (Intact), and the region takes no more calls.
// A SIGBUS anywhere else goes to the handler that was installed before, or kills the process as it would have.
//
// The handler runs on an alternate signal stack (SA_ONSTACK): every thread that touches a region must have one
// (EnsureSignalStack, PrepareThreadsForRegions). On the faulting thread's own stack, the kernel's signal frame lands
// below the stack pointer of the code that faulted; oneDNN's JIT kernels keep state there, and an AVX-512 host's
// frame (several KiB of register state) overwrote it: the process died of a corrupted heap.
#ifndef MHA_SERVER_TRANSPORT_SHARED_MEMORY_H_
#define MHA_SERVER_TRANSPORT_SHARED_MEMORY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mha {

// One mapped object. Thread-safe; the mapping lives until the last holder of the shared_ptr lets go.
class SharedMemoryRegion {
 public:
  // Maps `byte_size` bytes of the object named `key` (shm_open's name) read-write. NOT_FOUND when no such object
  // exists, INVALID_ARGUMENT when it is not a regular object or is smaller than byte_size, RESOURCE_EXHAUSTED when
  // every guard slot is taken, INTERNAL for any other system error.
  static absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Map(const std::string& name, const std::string& key,
                                                                 uint64_t byte_size);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  uint64_t size() const { return size_; }
  // The object's identity (device, inode): two regions with the same one map the same bytes, whatever their names.
  std::pair<uint64_t, uint64_t> object() const { return object_; }

  // OK until an access found the object shrunk below size(); FAILED_PRECONDITION naming the region from then on.
  absl::Status Intact() const;

 private:
  SharedMemoryRegion(std::string name, std::string key, char* data, uint64_t size,
                     std::pair<uint64_t, uint64_t> object, int fd, int slot)
      : name_(std::move(name)), key_(std::move(key)), data_(data), size_(size), object_(object), fd_(fd),
        slot_(slot) {}

  const std::string name_;
  const std::string key_;
  char* const data_;
  const uint64_t size_;
  const std::pair<uint64_t, uint64_t> object_;
  const int fd_;    // kept open so that the SIGBUS handler can read the object's size (fstat)
  const int slot_;  // in the SIGBUS guard's table
};

// The registered regions by name. Thread-safe.
class SharedMemoryRegistry {
 public:
  // At most `max_regions` regions (0: registration is refused, shared memory is off) of `max_bytes` together.
  SharedMemoryRegistry(int max_regions, int64_t max_bytes) : max_regions_(max_regions), max_bytes_(max_bytes) {}

  // FAILED_PRECONDITION when shared memory is off; INVALID_ARGUMENT for a malformed name, key or size, or a size
  // over the limit; ALREADY_EXISTS for a registered name; RESOURCE_EXHAUSTED when max_regions are registered; then
  // SharedMemoryRegion::Map's errors.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t byte_size);
  // Drops `name` (empty: every region); NOT_FOUND for an unknown name. Calls holding a region keep it mapped.
  absl::Status Unregister(const std::string& name);
  // The region registered as `name`; the error names `field` (e.g. "query.shared_memory.region"): NOT_FOUND when
  // none is, FAILED_PRECONDITION when shared memory is off.
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Find(const std::string& name,
                                                                 absl::string_view field) const;
  // The region `name`, or every region ordered by name when `name` is empty: FAILED_PRECONDITION when shared
  // memory is off, NOT_FOUND for a name not registered.
  absl::StatusOr<std::vector<std::shared_ptr<const SharedMemoryRegion>>> List(const std::string& name) const;

  int max_regions() const { return max_regions_; }
  int64_t max_bytes() const { return max_bytes_; }
  size_t size() const;

 private:
  const int max_regions_;
  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>> regions_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Gives the calling thread an alternate signal stack for the SIGBUS guard, once per thread (freed when the thread
// ends); keeps one the thread already has (a sanitizer's). Cheap after the first call.
void EnsureSignalStack();
// EnsureSignalStack on the calling thread and on every thread of the OpenMP team it would start now (the team
// oneDNN's and the CPU backend's parallel loops use): call it before a backend touches a region.
void PrepareThreadsForRegions();

// Every key begins with this, so that a caller cannot make the server map another program's shared memory (the
// server may run with more rights than its callers).
inline constexpr char kSharedMemoryKeyPrefix[] = "/mha_";

// The guard's capacity: regions mapped at once, across registries (unregistered ones still held by calls count).
inline constexpr int kMaxMappedRegions = 256;

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_SHARED_MEMORY_H_
