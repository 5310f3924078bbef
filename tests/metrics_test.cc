// Prometheus metrics: calls are counted by rpc, status code and backend, and /metrics serves them over HTTP.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
#include "spdlog/spdlog.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

// GET http://127.0.0.1:<port><path>; returns the whole response (headers and body), or "" on failure or after 5 s
// without data.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // A server that does not answer fails the test in seconds rather than hanging it.
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n;
      while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
}

TEST(ServerMetrics, CountsCallsByRpcCodeAndBackend) {
  ServerMetrics metrics;
  metrics.RecordCall("MultiHeadAttention", absl::StatusCode::kOk, "cpu", 0.002, 0.001, 3e6);
  metrics.RecordCall("MultiHeadAttention", absl::StatusCode::kOk, "cpu", 0.004, 0.003, 3e6);
  metrics.RecordCall("MultiHeadAttention", absl::StatusCode::kInvalidArgument, "", 0.0001, 0, 0);
  metrics.SetQueueDepth(3);
  const std::string text = metrics.Text();
  EXPECT_THAT(text, HasSubstr("mha_requests_total{backend=\"cpu\",code=\"OK\",rpc=\"MultiHeadAttention\"} 2"));
  EXPECT_THAT(text,
              HasSubstr("mha_requests_total{backend=\"\",code=\"INVALID_ARGUMENT\",rpc=\"MultiHeadAttention\"} 1"));
  EXPECT_THAT(text, HasSubstr("mha_flops_total{backend=\"cpu\"} 6000000"));
  EXPECT_THAT(text, HasSubstr("mha_compute_seconds_count{backend=\"cpu\"} 2"));
  EXPECT_THAT(text, HasSubstr("mha_request_duration_seconds_count{rpc=\"MultiHeadAttention\"} 3"));
  EXPECT_THAT(text, HasSubstr("mha_queue_depth 3"));
}

TEST(ServerMetrics, ServesTheServersCallsOverHttp) {
  spdlog::set_level(spdlog::level::warn);
  ServerOptions options;
  options.listen = "";
  options.threads = 2;
  options.metrics_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->metrics_port(), 0);
  auto stub = v1::Attention::NewStub((*server)->InProcessChannel());

  v1::MultiHeadAttentionRequest request;
  FloatsToTensor(testing::RandomVector(4 * 512, 1), {1, 4, 512}, v1::FP32, request.mutable_query());
  request.set_layer("demo");
  v1::MultiHeadAttentionResponse response;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->MultiHeadAttention(&context, request, &response).ok());
  }
  request.set_layer("missing");
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub->MultiHeadAttention(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  const std::string page = HttpGet((*server)->metrics_port(), "/metrics");
  EXPECT_THAT(page, HasSubstr("200 OK"));
  EXPECT_THAT(page, HasSubstr("mha_requests_total{backend=\"cpu\",code=\"OK\",rpc=\"MultiHeadAttention\"} 1"));
  EXPECT_THAT(page, HasSubstr("mha_requests_total{backend=\"\",code=\"NOT_FOUND\",rpc=\"MultiHeadAttention\"} 1"));
  EXPECT_THAT(page, HasSubstr("mha_queue_depth 0"));
}

TEST(ServerMetrics, IdleConnectionsDoNotBlockScrapes) {
  ServerMetrics metrics;
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  // Two clients connect and send nothing (the endpoint keeps such a connection for its whole timeout).
  std::vector<int> idle;
  for (int i = 0; i < 2; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(metrics.port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    idle.push_back(fd);
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(HttpGet(metrics.port(), "/metrics"), HasSubstr("200 OK"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  for (int fd : idle) close(fd);
}

TEST(ServerMetrics, UnbindableAddressIsUnavailable) {
  ServerMetrics metrics;
  EXPECT_EQ(metrics.Serve("256.0.0.1:0").code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace mha
