#include "server/transport/connection_gate.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "absl/time/clock.h"
#include "server/base/log_budget.h"
#include "server/transport/listener_watch.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

std::atomic<int> g_gate{0};
std::atomic<int64_t> g_refused{0};
LogBudget g_log_budget(1);  // a line a second at most, however many connections are refused

using Accept4 = int (*)(int, sockaddr*, socklen_t*, int);

// The next accept4 after this executable's: libc's, or a sanitizer's interceptor in front of it.
Accept4 NextAccept4() {
  static const Accept4 next = reinterpret_cast<Accept4>(dlsym(RTLD_NEXT, "accept4"));
  return next;
}

bool NonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && (flags & O_NONBLOCK) != 0;
}

// Failures of accept that concern one connection or a passing shortage, not the listener: gRPC 1.51 would stop
// the listener on any of them.
bool Transient(int error) {
  return error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM || error == EPROTO ||
         error == EPERM || error == ENETDOWN || error == ENONET || error == EHOSTUNREACH || error == ENETUNREACH ||
         error == EHOSTDOWN || error == EOPNOTSUPP;
}

// Counts a refused connection and says so in the log, at most once a second.
void Refused(int gate) {
  const int64_t refused = g_refused.fetch_add(1, std::memory_order_relaxed) + 1;
  int64_t left_out = 0;
  if (g_log_budget.Take(absl::Now(), &left_out)) {
    spdlog::warn("connections refused: {} since the start; {} file descriptors are in use, the most connections may "
                 "take (the open-file limit less a reserve)",
                 refused, gate);
  }
}

// accept4 through the gate. A connection at or above it is closed; on a non-blocking listener (gRPC's) the loop
// goes on to the next queued one, so that the queue is drained and the listener's next wait sees new connections
// only; a blocking listener's caller (the metrics exposer's) gets ECONNABORTED, which it skips.
int GatedAccept(int fd, sockaddr* address, socklen_t* length, int flags) {
  const Accept4 next = NextAccept4();
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const socklen_t given = length != nullptr ? *length : 0;
  const bool non_blocking = NonBlocking(fd);
  for (;;) {
    if (length != nullptr) *length = given;
    const int connection = next(fd, address, length, flags);
    const int gate = g_gate.load(std::memory_order_relaxed);
    if (gate <= 0) return connection;
    const int error = errno;
    if (non_blocking) NoteAccept(fd, connection >= 0 && connection < gate);
    if (connection < 0) {
      errno = error;
      if (!Transient(error)) return connection;
      if (error == EMFILE || error == ENFILE) Refused(gate);
      errno = ECONNABORTED;  // what gRPC and civetweb retry; EMFILE and the like would end gRPC's listener
      return -1;
    }
    if (connection < gate) return connection;
    close(connection);
    Refused(gate);
    if (!non_blocking) {
      errno = ECONNABORTED;
      return -1;
    }
  }
}

}  // namespace

int ConnectionGateFor(rlim_t open_file_limit) {
  if (open_file_limit == RLIM_INFINITY || open_file_limit > (1u << 30)) return 0;
  const int limit = static_cast<int>(open_file_limit);
  return std::max(limit - std::max(64, limit / 16), limit / 2);
}

void SetConnectionGate(int gate) { g_gate.store(std::max(gate, 0), std::memory_order_relaxed); }

}  // namespace mha

// The process's accept4 and accept (see the header).
extern "C" int accept4(int fd, sockaddr* address, socklen_t* length, int flags) {
  return mha::GatedAccept(fd, address, length, flags);
}

extern "C" int accept(int fd, sockaddr* address, socklen_t* length) {
  return mha::GatedAccept(fd, address, length, 0);
}
