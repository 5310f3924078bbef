// The server's listen addresses (--listen, --health_listen, --metrics_listen): their syntax, and whether this machine
// lets us bind them, checked before gRPC or the metrics server try, so that a mistake is reported in one line that
// names the flag and says what is wrong (gRPC 1.51 wraps a port above 65535 around, and logs a several-hundred-
// character error of its own for a port in use).
#ifndef MHA_SERVER_TRANSPORT_LISTEN_ADDRESS_H_
#define MHA_SERVER_TRANSPORT_LISTEN_ADDRESS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha {

// A parsed listen address: a Unix socket path, or a host and a TCP port.
struct ListenAddress {
  std::string unix_path;  // set for "unix:PATH" and "unix-abstract:NAME" (then host and port are unused)
  std::string host;       // an IPv4 or IPv6 literal (brackets removed) or a host name
  int port = 0;           // 0-65535; 0 = the system picks one
};

// Parses "HOST:PORT", "[IPV6]:PORT", "unix:PATH" or "unix-abstract:NAME". INVALID_ARGUMENT naming `flag` and what is
// wrong: no port, a port that is not a number in [0, 65535], an empty or malformed host.
absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view flag, absl::string_view text);

// `address` as given, or for ":PORT" that port on the host of `listen` (127.0.0.1 for a Unix socket), so that
// --metrics_listen :9464 stays on the address the operator chose for the service.
std::string OnListenHost(const std::string& address, const std::string& listen);

// Tries to bind `address` as the server will (SO_REUSEADDR, no SO_REUSEPORT), then lets go. UNAVAILABLE naming `flag`
// when no address the host resolves to can be bound: the port is in use, the host is not an address of this
// machine, the name does not resolve, or the port needs privileges. OK for Unix sockets and port 0, which gRPC
// reports itself.
absl::Status CheckCanBind(absl::string_view flag, const ListenAddress& address);

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_LISTEN_ADDRESS_H_
