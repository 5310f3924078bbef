// Whether the process's gRPC listeners still accept connections: the liveness check's view of the main port.
//
// gRPC 1.51's listener stops for good after an accept fails for any reason but EAGAIN (connection_gate.h keeps
// EMFILE from reaching it); the port then still completes TCP handshakes into its queue, so a probe that only
// connects would pass. The connection gate reports every listener it accepts on (NoteAccept); ListenerWatch reads
// each one's queue of connections waiting to be accepted (TCP_INFO) and calls a listener stalled when connections
// have waited there for a while and none was accepted meanwhile. Without the gate (tests), nothing is reported and
// nothing stalls.
#ifndef MHA_SERVER_TRANSPORT_LISTENER_WATCH_H_
#define MHA_SERVER_TRANSPORT_LISTENER_WATCH_H_

#include <array>

#include "absl/time/time.h"

namespace mha {

// Records that an accept ran on `listener` (a non-blocking listening socket) and whether it returned a connection.
// Lock-free; at most kMaxWatchedListeners listeners are watched (more are ignored).
void NoteAccept(int listener, bool accepted);
inline constexpr int kMaxWatchedListeners = 16;

// Not thread-safe: one watcher (MhaServer's watchdog) calls Stalled.
class ListenerWatch {
 public:
  ListenerWatch() { waiting_since_.fill(absl::InfinitePast()); }
  // A listener whose queue has held connections for `stall` or more, with no accept on it in that time; -1 if none.
  int Stalled(absl::Time now, absl::Duration stall);

 private:
  std::array<absl::Time, kMaxWatchedListeners> waiting_since_;  // InfinitePast(): nothing waits
};

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_LISTENER_WATCH_H_
