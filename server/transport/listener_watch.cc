#include "server/transport/listener_watch.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"

namespace mha {
namespace {

// A slot is taken once (fd from -1 to the listener) and never given back: listeners live as long as the server.
struct Slot {
  std::atomic<int> fd{-1};
  std::atomic<int64_t> last_accept_ns{0};  // absl::Now() of the last accept that returned a connection
};
Slot g_slots[kMaxWatchedListeners];

// Connections in `listener`'s accept queue; 0 when it cannot tell (not TCP, or closed).
int Waiting(int listener) {
  tcp_info info{};
  socklen_t length = sizeof(info);
  if (getsockopt(listener, IPPROTO_TCP, TCP_INFO, &info, &length) != 0) return 0;
  if (info.tcpi_state != TCP_LISTEN) return 0;
  return static_cast<int>(info.tcpi_unacked);  // a listener's tcpi_unacked is its accept queue's length
}

}  // namespace

void NoteAccept(int listener, bool accepted) {
  for (Slot& slot : g_slots) {
    int fd = slot.fd.load(std::memory_order_acquire);
    if (fd == -1 && slot.fd.compare_exchange_strong(fd, listener, std::memory_order_acq_rel)) fd = listener;
    if (fd != listener) continue;
    if (accepted) slot.last_accept_ns.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed);
    return;
  }
}

int ListenerWatch::Stalled(absl::Time now, absl::Duration stall) {
  for (int i = 0; i < kMaxWatchedListeners; ++i) {
    const int fd = g_slots[i].fd.load(std::memory_order_acquire);
    if (fd < 0) break;
    absl::Time& since = waiting_since_[i];
    const absl::Time accepted = absl::FromUnixNanos(g_slots[i].last_accept_ns.load(std::memory_order_relaxed));
    if (Waiting(fd) == 0) {
      since = absl::InfinitePast();
      continue;
    }
    if (since == absl::InfinitePast() || accepted > since) since = now;  // waiting from now, or it moved on
    if (now - since >= stall) return fd;
  }
  return -1;
}

}  // namespace mha
