// Connections refused before the process runs out of file descriptors, so that no listener ever sees EMFILE.
//
// gRPC 1.51's TCP listener stops accepting on its port for good after one accept4 fails with anything but EAGAIN
// or ECONNABORTED: opening idle connections up to the open-file limit took the main port down while the health port
// kept answering. gRPC 1.51 has no connection limit of its own, so the gate sits under it: connection_gate.cc defines
// accept4 and accept for the mha_server executable, whose definitions come before libc's for every library in the
// process, and calls the next definition (libc's, or a sanitizer's interceptor). A connection whose descriptor number
// is at or above the gate is closed at once (the client sees its connection end, and may retry): Linux hands out
// the lowest free number, so descriptor N means that N are in use. A listener's queue is drained of such
// connections, and an accept that does fail for lack of descriptors says ECONNABORTED, which gRPC retries.
#ifndef MHA_SERVER_TRANSPORT_CONNECTION_GATE_H_
#define MHA_SERVER_TRANSPORT_CONNECTION_GATE_H_

#include <sys/resource.h>

namespace mha {

// The gate for an open-file limit: the limit less a reserve kept for what is not a connection (layer files, TLS
// reloads, the metrics and health ports' own work) of max(64, limit / 16), but at least half the limit. 0 (no gate)
// for an unlimited limit.
int ConnectionGateFor(rlim_t open_file_limit);

// From now on connections get descriptors below `gate` only; 0 turns the gate off (the default). Refusals are
// counted and logged, a line a second at most. Thread-safe.
void SetConnectionGate(int gate);

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_CONNECTION_GATE_H_
