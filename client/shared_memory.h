// A POSIX shared-memory object this process creates and maps, for tensors that go to a server on the same host
// without the socket's copies (RegisterSharedMemory, mha.v1.SharedMemoryRef). Not thread-safe to create or
// destroy; the bytes are the caller's to share as the proto's SharedMemoryRef describes.
#ifndef MHA_CLIENT_SHARED_MEMORY_H_
#define MHA_CLIENT_SHARED_MEMORY_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace mha {

class SharedMemoryObject {
 public:
  // Creates the object `key` ("/mha_" then [A-Za-z0-9._-], as RegisterSharedMemory wants) of `bytes` bytes (>= 1),
  // readable and writable by this user only, zero-filled and allocated (RESOURCE_EXHAUSTED when /dev/shm has no room),
  // and maps it. ALREADY_EXISTS when the name is taken.
  static absl::StatusOr<std::unique_ptr<SharedMemoryObject>> Create(const std::string& key, size_t bytes);
  // Unmaps and removes the object (a server that still maps it keeps its pages until it unmaps them).
  ~SharedMemoryObject();
  SharedMemoryObject(const SharedMemoryObject&) = delete;
  SharedMemoryObject& operator=(const SharedMemoryObject&) = delete;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  SharedMemoryObject(std::string key, char* data, size_t size) : key_(std::move(key)), data_(data), size_(size) {}
  const std::string key_;
  char* const data_;
  const size_t size_;
};

}  // namespace mha

#endif  // MHA_CLIENT_SHARED_MEMORY_H_
