#include "server/transport/listen_address.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view flag, absl::string_view text, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " \"", text, "\": ", what,
                                                 " (expected HOST:PORT, [IPV6]:PORT or unix:PATH, e.g. "
                                                 "127.0.0.1:50051)"));
}

// Letters, digits, '-', '.' and, for IPv6 literals, ':' and hex digits: what a host name or an address literal
// may contain.
bool IsHostText(absl::string_view host, bool ipv6) {
  if (host.empty()) return false;
  for (const char c : host) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' ||
                    (ipv6 && (c == ':' || c == '%'));
    if (!ok) return false;
  }
  return true;
}

std::string BindError(absl::string_view flag, const ListenAddress& address, int error) {
  const std::string where = absl::StrCat(address.host, ":", address.port);
  switch (error) {
    case EADDRINUSE:
      return absl::StrCat(flag, " ", where, ": port ", address.port, " is in use by another process");
    case EADDRNOTAVAIL:
      return absl::StrCat(flag, " ", where, ": ", address.host, " is not an address of this machine");
    case EACCES:
      return absl::StrCat(flag, " ", where, ": port ", address.port,
                          " needs privileges (ports below 1024 need root or CAP_NET_BIND_SERVICE)");
    default:
      return absl::StrCat(flag, " ", where, ": cannot bind: ", std::strerror(error));
  }
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(absl::string_view flag, absl::string_view text) {
  ListenAddress address;
  for (absl::string_view scheme : {"unix:", "unix-abstract:"}) {
    if (absl::StartsWith(text, scheme)) {
      if (text.size() == scheme.size()) return Invalid(flag, text, "no socket path after the scheme");
      address.unix_path = std::string(text);
      return address;
    }
  }
  absl::string_view host = text;
  absl::string_view port;
  bool ipv6 = false;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return Invalid(flag, text, "no ']' after the IPv6 address");
    port = host.substr(close + 1);
    host = host.substr(0, close);
    if (!absl::ConsumePrefix(&port, ":")) return Invalid(flag, text, "no ':PORT' after the IPv6 address");
    ipv6 = true;
  } else {
    const size_t colon = host.rfind(':');
    if (colon == absl::string_view::npos) return Invalid(flag, text, "no port");
    if (host.find(':') != colon) return Invalid(flag, text, "an IPv6 address needs brackets, as in [::1]:50051");
    port = host.substr(colon + 1);
    host = host.substr(0, colon);
  }
  if (!IsHostText(host, ipv6)) {
    return Invalid(flag, text, host.empty() ? "no host (0.0.0.0 or [::] serve on every address)" : "not a host");
  }
  uint32_t number = 0;
  if (port.empty() || !absl::c_all_of(port, [](char c) { return absl::ascii_isdigit(c); }) ||
      !absl::SimpleAtoi(port, &number) || number > 65535) {
    return Invalid(flag, text, absl::StrCat("port \"", port, "\" is not a number in [0, 65535]"));
  }
  address.host = std::string(host);
  address.port = static_cast<int>(number);
  return address;
}

std::string OnListenHost(const std::string& address, const std::string& listen) {
  if (!absl::StartsWith(address, ":")) return address;
  if (absl::StartsWith(listen, "unix")) return "127.0.0.1" + address;
  const size_t colon = listen.rfind(':');
  return (colon == std::string::npos ? listen : listen.substr(0, colon)) + address;
}

absl::Status CheckCanBind(absl::string_view flag, const ListenAddress& address) {
  if (!address.unix_path.empty()) return absl::OkStatus();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(address.port);
  if (const int error = getaddrinfo(address.host.c_str(), port.c_str(), &hints, &found); error != 0) {
    return absl::UnavailableError(absl::StrCat(flag, " ", address.host, ":", address.port, ": cannot resolve ",
                                               address.host, ": ", gai_strerror(error)));
  }
  // gRPC serves if it can bind any of the addresses the host resolves to; so does this check.
  int first_error = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      if (first_error == 0) first_error = errno;
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC: a port in TIME_WAIT is free
    const int result = bind(fd, a->ai_addr, a->ai_addrlen);
    const int error = errno;
    close(fd);
    if (result == 0) {
      freeaddrinfo(found);
      return absl::OkStatus();
    }
    if (first_error == 0) first_error = error;
  }
  freeaddrinfo(found);
  return absl::UnavailableError(BindError(flag, address, first_error));
}

}  // namespace mha
