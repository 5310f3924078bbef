#include "server/transport/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

// The SIGBUS guard's table: one slot per mapped region. A slot is live while begin != 0; writers set end and fd
// before begin (release) and clear begin first, so the handler (which only reads, then sets shrunk) never sees a
// half-written slot of a live region. A slot is freed only after its region's last user let go, so a fault inside
// a live slot's range always comes from a holder of that region.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int> fd{-1};
  std::atomic<bool> shrunk{false};
};
GuardSlot g_slots[kMaxMappedRegions];
std::atomic<bool> g_slot_taken[kMaxMappedRegions];
uintptr_t g_page_size = 4096;
struct sigaction g_previous;

// Async-signal-safe: atomics, fstat (on POSIX's list) and mmap as a raw system call (every argument passed as a
// long, as the kernel reads them). Maps anonymous memory over the region's pages past the object's current end, or
// from the faulting page when that lies inside it (a tmpfs that had no room for the page), so that the faulting
// access and any later one complete, and marks the region shrunk.
void OnSigbus(int signal, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : g_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= slot.end.load(std::memory_order_relaxed)) continue;
    const uintptr_t end = slot.end.load(std::memory_order_relaxed);
    uintptr_t from = address & ~(g_page_size - 1);
    struct stat st;
    if (fstat(slot.fd.load(std::memory_order_relaxed), &st) == 0 && st.st_size >= 0) {
      const uintptr_t kept = begin + ((static_cast<uintptr_t>(st.st_size) + g_page_size - 1) & ~(g_page_size - 1));
      if (kept < from) from = kept;
    }
    if (from < begin) from = begin;
    const long mapped = syscall(SYS_mmap, static_cast<long>(from), static_cast<long>(end - from),
                                static_cast<long>(PROT_READ | PROT_WRITE),
                                static_cast<long>(MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS), -1L, 0L);
    if (mapped == static_cast<long>(from)) {
      slot.shrunk.store(true, std::memory_order_release);
      return;
    }
    break;  // could not map: fall through to what would have happened without the guard
  }
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) return g_previous.sa_sigaction(signal, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(signal);
  }
  // Default action: restore it and return, so that the access faults again and the process ends as it would have.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigaction(SIGBUS, &dfl, nullptr);
}

absl::Status InstallGuardOnce() {
  static std::once_flag once;
  static int error = 0;
  std::call_once(once, [] {
    g_page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = &OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous) != 0) error = errno;
  });
  if (error != 0) return absl::InternalError(absl::StrCat("installing the SIGBUS guard: ", std::strerror(error)));
  return absl::OkStatus();
}

// The calling thread's alternate signal stack, when this file gave it one: unhooked and unmapped as the thread ends.
class SignalStack {
 public:
  SignalStack() {
    stack_t current;
    if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return;  // keep the thread's own
    // The handler's frame plus the kernel's (the register state: a few KiB with AVX-512, 11 KiB with AMX tiles).
    const long minimum = sysconf(_SC_MINSIGSTKSZ);
    bytes_ = std::max<size_t>(64 << 10, 4 * static_cast<size_t>(minimum > 0 ? minimum : 0));
    void* memory = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (memory == MAP_FAILED) return;  // the handler then runs on the thread's stack, as without this
    stack_t stack;
    stack.ss_sp = memory;
    stack.ss_size = bytes_;
    stack.ss_flags = 0;
    if (sigaltstack(&stack, nullptr) != 0) {
      munmap(memory, bytes_);
      return;
    }
    memory_ = memory;
  }
  ~SignalStack() {
    if (memory_ == nullptr) return;
    stack_t off;
    std::memset(&off, 0, sizeof(off));
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
    munmap(memory_, bytes_);
  }
  SignalStack(const SignalStack&) = delete;
  SignalStack& operator=(const SignalStack&) = delete;

 private:
  void* memory_ = nullptr;
  size_t bytes_ = 0;
};

int TakeSlot() {
  for (int i = 0; i < kMaxMappedRegions; ++i) {
    bool expected = false;
    if (g_slot_taken[i].compare_exchange_strong(expected, true)) return i;
  }
  return -1;
}

absl::Status CheckKey(const std::string& key) {
  if (!absl::StartsWith(key, kSharedMemoryKeyPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat("key must be a shm_open name that begins with '",
                                                   kSharedMemoryKeyPrefix,
                                                   "' (objects of other programs are out of reach)"));
  }
  return CheckName(absl::string_view(key).substr(1), "key after its '/'");
}

// What every registry call answers while shared memory is off; `prefix` names the field, when there is one.
absl::Status SharedMemoryOff(absl::string_view prefix = "") {
  return absl::FailedPreconditionError(absl::StrCat(
      prefix, "this server does not accept shared memory (start it with --max_shared_memory_regions > 0)"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryRegion::Map(const std::string& name,
                                                                             const std::string& key,
                                                                             uint64_t byte_size) {
  RETURN_IF_ERROR(InstallGuardOnce());
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no shared-memory object '", key, "' on the server's host"));
    }
    return absl::InvalidArgumentError(absl::StrCat("cannot open shared-memory object '", key, "': ",
                                                   std::strerror(error)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("'", key, "' is not a shared-memory object"));
  }
  const std::pair<uint64_t, uint64_t> object{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  if (static_cast<uint64_t>(st.st_size) < byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("byte_size is ", byte_size, " but the object '", key, "' has ",
                                                   st.st_size, " bytes"));
  }
  const int slot = TakeSlot();
  if (slot < 0) {
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("the server has ", kMaxMappedRegions, " shared-memory regions mapped; unregister some"));
  }
  void* data = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    close(fd);
    g_slot_taken[slot].store(false);
    return absl::InternalError(absl::StrCat("mapping '", key, "': ", std::strerror(error)));
  }
  GuardSlot& guard = g_slots[slot];
  guard.shrunk.store(false, std::memory_order_relaxed);
  guard.fd.store(fd, std::memory_order_relaxed);
  guard.end.store(reinterpret_cast<uintptr_t>(data) + byte_size, std::memory_order_relaxed);
  guard.begin.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
  return std::shared_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, key, static_cast<char*>(data), byte_size, object, fd, slot));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  GuardSlot& guard = g_slots[slot_];
  guard.begin.store(0, std::memory_order_release);
  munmap(data_, size_);
  close(fd_);
  guard.fd.store(-1, std::memory_order_relaxed);
  g_slot_taken[slot_].store(false, std::memory_order_release);
}

absl::Status SharedMemoryRegion::Intact() const {
  if (!g_slots[slot_].shrunk.load(std::memory_order_acquire)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shared-memory region '", name_, "' lost pages while the server used it (its object shrank below the "
      "registered ", size_, " bytes, or /dev/shm had no room for a page); register it again"));
}

void EnsureSignalStack() { thread_local SignalStack stack; }

void PrepareThreadsForRegions() {
  EnsureSignalStack();
  // The team size of the backend's next parallel region (the CPU backend runs small calls on this thread alone,
  // which the line above covers). libgomp keeps a team's threads between regions, so this costs a few microseconds.
#pragma omp parallel
  EnsureSignalStack();
}

absl::Status SharedMemoryRegistry::Register(const std::string& name, const std::string& key, uint64_t byte_size) {
  if (max_regions_ <= 0) return SharedMemoryOff();
  RETURN_IF_ERROR(CheckName(name, "name"));
  RETURN_IF_ERROR(CheckKey(key));
  if (byte_size == 0 || byte_size > static_cast<uint64_t>(max_bytes_)) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size must be 1..", max_bytes_,
                                                   " (--max_shared_memory_mb), got ", byte_size));
  }
  // Mapped under the lock (a few system calls; registrations are rare), so that the limits hold without a recheck.
  absl::MutexLock lock(&mu_);
  if (regions_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("shared-memory region '", name, "' is already registered"));
  }
  if (static_cast<int>(regions_.size()) >= max_regions_) {
    return absl::ResourceExhaustedError(absl::StrCat("the server holds ", max_regions_,
                                                     " shared-memory regions (--max_shared_memory_regions)"));
  }
  if (bytes_ + static_cast<int64_t>(byte_size) > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("registering ", byte_size, " bytes more would pass the ",
                                                     max_bytes_, "-byte limit (--max_shared_memory_mb)"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<SharedMemoryRegion> region, SharedMemoryRegion::Map(name, key, byte_size));
  bytes_ += static_cast<int64_t>(byte_size);
  regions_.emplace(name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& name) {
  std::map<std::string, std::shared_ptr<const SharedMemoryRegion>> dropped;  // unmapped outside the lock
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    dropped.swap(regions_);
    bytes_ = 0;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckName(name, "name"));
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no shared-memory region '", name, "' is registered"));
  }
  bytes_ -= static_cast<int64_t>(it->second->size());
  dropped.emplace(it->first, std::move(it->second));
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> SharedMemoryRegistry::Find(const std::string& name,
                                                                                     absl::string_view field) const {
  if (max_regions_ <= 0) return SharedMemoryOff(absl::StrCat(field, ": "));
  RETURN_IF_ERROR(CheckName(name, field));
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat(field, ": no shared-memory region '", name, "' is registered"));
  }
  return it->second;
}

absl::StatusOr<std::vector<std::shared_ptr<const SharedMemoryRegion>>> SharedMemoryRegistry::List(
    const std::string& name) const {
  std::vector<std::shared_ptr<const SharedMemoryRegion>> listed;
  if (!name.empty()) {
    ASSIGN_OR_RETURN(std::shared_ptr<const SharedMemoryRegion> region, Find(name, "name"));
    listed.push_back(std::move(region));
    return listed;
  }
  if (max_regions_ <= 0) return SharedMemoryOff();
  absl::MutexLock lock(&mu_);
  listed.reserve(regions_.size());
  for (const auto& entry : regions_) listed.push_back(entry.second);
  return listed;
}

size_t SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}

}  // namespace mha
