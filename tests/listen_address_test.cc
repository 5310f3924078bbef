// The server's listen addresses: what parses, what is refused and how, and the ":PORT" shorthand.
#include "server/transport/listen_address.h"

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

struct Valid {
  const char* text;
  const char* host;
  int port;
};

class ValidListenAddress : public ::testing::TestWithParam<Valid> {};

TEST_P(ValidListenAddress, ParsesToHostAndPort) {
  absl::StatusOr<ListenAddress> address = ParseListenAddress("--listen", GetParam().text);
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(address->host, GetParam().host);
  EXPECT_EQ(address->port, GetParam().port);
  EXPECT_TRUE(address->unix_path.empty());
}

INSTANTIATE_TEST_SUITE_P(Addresses, ValidListenAddress,
                         ::testing::Values(Valid{"127.0.0.1:50051", "127.0.0.1", 50051},
                                           Valid{"0.0.0.0:0", "0.0.0.0", 0},
                                           Valid{"localhost:65535", "localhost", 65535},
                                           Valid{"[::]:50051", "::", 50051},
                                           Valid{"[::1]:8081", "::1", 8081},
                                           Valid{"mha-server.ns.svc:50051", "mha-server.ns.svc", 50051}));

TEST(ListenAddress, UnixSocketsKeepTheirPath) {
  absl::StatusOr<ListenAddress> address = ParseListenAddress("--listen", "unix:/tmp/mha.sock");
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(address->unix_path, "unix:/tmp/mha.sock");
  EXPECT_TRUE(CheckCanBind("--listen", *address).ok());
}

struct Invalid {
  const char* text;
  const char* message;
};

class InvalidListenAddress : public ::testing::TestWithParam<Invalid> {};

TEST_P(InvalidListenAddress, IsRefusedNamingTheFlagAndWhatIsWrong) {
  absl::StatusOr<ListenAddress> address = ParseListenAddress("--health_listen", GetParam().text);
  EXPECT_EQ(address.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(address.status().message(),
              HasSubstr(std::string("--health_listen \"") + GetParam().text + "\": " + GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Addresses, InvalidListenAddress,
    ::testing::Values(Invalid{"127.0.0.1:99999", "port \"99999\" is not a number in [0, 65535]"},
                      Invalid{"127.0.0.1:65536", "port \"65536\" is not a number in [0, 65535]"},
                      Invalid{"127.0.0.1:-1", "port \"-1\" is not a number in [0, 65535]"},
                      Invalid{"127.0.0.1:", "port \"\" is not a number in [0, 65535]"},
                      Invalid{"127.0.0.1:http", "port \"http\" is not a number in [0, 65535]"},
                      Invalid{"nonsense", "no port"}, Invalid{":50051", "no host"},
                      Invalid{"::1:50051", "an IPv6 address needs brackets"},
                      Invalid{"[::1:50051", "no ']' after the IPv6 address"},
                      Invalid{"[::1]50051", "no ':PORT' after the IPv6 address"},
                      Invalid{"a b:1", "not a host"}, Invalid{"unix:", "no socket path"}));

TEST(ListenAddress, APortInUseIsNamed) {
  sockaddr_in any{};
  const int holder = testing::ListenOnLoopback(0, &any);
  ASSERT_GE(holder, 0);
  const int port = ntohs(any.sin_port);
  const absl::Status status = CheckCanBind("--listen", ListenAddress{"", "127.0.0.1", port});
  close(holder);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(status.message(), "--listen 127.0.0.1:" + std::to_string(port) + ": port " + std::to_string(port) +
                                  " is in use by another process");
}

TEST(ListenAddress, AnAddressOfAnotherMachineIsNamed) {
  // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of a real machine.
  const absl::Status status = CheckCanBind("--listen", ListenAddress{"", "192.0.2.1", 50051});
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(status.message(), "--listen 192.0.2.1:50051: 192.0.2.1 is not an address of this machine");
}

TEST(ListenAddress, AFreeLoopbackPortCanBeBound) {
  EXPECT_TRUE(CheckCanBind("--listen", ListenAddress{"", "127.0.0.1", 0}).ok());
}

TEST(ListenAddress, MetricsOnTheListenHostWithColonPort) {
  EXPECT_EQ(OnListenHost(":9464", "127.0.0.1:50051"), "127.0.0.1:9464");
  EXPECT_EQ(OnListenHost(":9464", "[::1]:50051"), "[::1]:9464");
  EXPECT_EQ(OnListenHost(":9464", "unix:/tmp/mha.sock"), "127.0.0.1:9464");
  EXPECT_EQ(OnListenHost("0.0.0.0:9464", "127.0.0.1:50051"), "0.0.0.0:9464");
  EXPECT_EQ(OnListenHost("", "127.0.0.1:50051"), "");
}

}  // namespace
}  // namespace mha
