#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mha {

absl::StatusOr<std::unique_ptr<SharedMemoryObject>> SharedMemoryObject::Create(const std::string& key,
                                                                               size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared-memory object needs at least one byte");
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    const std::string why = absl::StrCat("creating shared-memory object '", key, "': ", std::strerror(error));
    return error == EEXIST ? absl::AlreadyExistsError(why) : absl::InvalidArgumentError(why);
  }
  // Every page allocated now (posix_fallocate, not a sparse ftruncate), so that a /dev/shm too small for the object
  // fails here, not with SIGBUS in whichever process touches the page first.
  void* data = MAP_FAILED;
  int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (error == 0) {
    data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) error = errno;
  }
  close(fd);  // the mapping keeps the object
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("allocating or mapping shared-memory object '", key, "' (", bytes,
                                                     " bytes): ", std::strerror(error)));
  }
  return std::unique_ptr<SharedMemoryObject>(new SharedMemoryObject(key, static_cast<char*>(data), bytes));
}

SharedMemoryObject::~SharedMemoryObject() {
  munmap(data_, size_);
  shm_unlink(key_.c_str());
}

}  // namespace mha
