// The Attention service through an in-process channel: a fixture that starts a server with given options, small
// valid requests, and a slow one. Shared by service_test.cc and serving_test.cc.
#ifndef MHA_TESTS_SERVICE_FIXTURE_H_
#define MHA_TESTS_SERVICE_FIXTURE_H_

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
#include "spdlog/spdlog.h"
#include "tests/test_util.h"

namespace mha::testing {

inline constexpr int64_t kBatch = 2, kLen = 3, kDModel = 8, kHeads = 2;

inline void SetTensor(v1::Tensor* t, std::vector<int64_t> shape, uint32_t seed, v1::DataType dtype = v1::FP32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  FloatsToTensor(RandomVector(n, seed, 0.5f), shape, dtype, t);
}

// A valid self-attention request with inline weights: B=2, T=3, d_model=8, H=2 (d_k 4).
inline v1::MultiHeadAttentionRequest ValidRequest() {
  v1::MultiHeadAttentionRequest r;
  SetTensor(r.mutable_query(), {kBatch, kLen, kDModel}, 1);
  v1::AttentionWeights* w = r.mutable_inline_weights();
  SetTensor(w->mutable_w_q(), {kDModel, kDModel}, 2);
  SetTensor(w->mutable_w_k(), {kDModel, kDModel}, 3);
  SetTensor(w->mutable_w_v(), {kDModel, kDModel}, 4);
  SetTensor(w->mutable_w_o(), {kDModel, kDModel}, 5);
  r.mutable_heads()->set_num_heads(kHeads);
  r.set_backend(v1::BACKEND_CPU);
  return r;
}

// The demo layer on [batch, 256, 512] through the reference backend: about a quarter second per batch item of
// scalar loops on the compute thread, long enough to observe queueing.
inline v1::MultiHeadAttentionRequest SlowDemoRequest(int64_t batch) {
  v1::MultiHeadAttentionRequest r;
  SetTensor(r.mutable_query(), {batch, 256, 512}, 3);
  r.set_layer("demo");
  r.set_backend(v1::BACKEND_REFERENCE);
  return r;
}

// The value of the unlabelled series `name` in the Prometheus text `metrics`; -1 when absent.
inline int64_t MetricValue(const std::string& metrics, const std::string& name) {
  const size_t at = metrics.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stoll(metrics.substr(at + name.size() + 2));
}

// From the mha_batch_size histogram in `metrics`: calls that ran in a batch beside another, i.e. the sum of batch
// sizes minus the number of backend calls (0 when nothing was batched; 3 for one batch of 4 and any singles).
inline int64_t CallsJoiningABatch(const std::string& metrics) {
  return MetricValue(metrics, "mha_batch_size_sum") - MetricValue(metrics, "mha_batch_size_count");
}

// A server on a free loopback port (127.0.0.1:0) with two compute threads; null, and the test failed, if it cannot
// start.
inline std::unique_ptr<MhaServer> StartLoopbackServer() {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 2;
  absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);  // per-call info logs would drown the test output
    StartServer(ServerOptions());
  }

  void StartServer(ServerOptions options) {
    stub_.reset();
    server_.reset();
    options.listen = "";  // in-process only
    options.threads = 2;
    absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = v1::Attention::NewStub(server_->InProcessChannel());
  }

  grpc::Status Call(const v1::MultiHeadAttentionRequest& request, v1::MultiHeadAttentionResponse* response) {
    grpc::ClientContext context;
    return stub_->MultiHeadAttention(&context, request, response);
  }
  grpc::Status Call(const v1::ScaledDotProductAttentionRequest& request,
                    v1::ScaledDotProductAttentionResponse* response) {
    grpc::ClientContext context;
    return stub_->ScaledDotProductAttention(&context, request, response);
  }

  // A call made on another thread; `status` holds how it ended.
  struct BackgroundCall {
    v1::MultiHeadAttentionRequest request;
    grpc::ClientContext context;
    v1::MultiHeadAttentionResponse response;
    std::future<grpc::Status> status;
  };

  // Starts `request` on another thread; with `computing`, returns once the compute thread runs a call. Tests that
  // only need a long call to be running cancel it (context.TryCancel()) once they have seen what they look for,
  // rather than wait out its reference loops (tens of seconds in a sanitizer build).
  std::unique_ptr<BackgroundCall> Start(v1::MultiHeadAttentionRequest request, bool computing = true) {
    auto call = std::make_unique<BackgroundCall>();
    call->request = std::move(request);
    // Far enough that the admission estimate never refuses a blocking call, even in a sanitizer build whose
    // reference loops run tens of times slower (they would pass the server's default).
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
    call->status = std::async(std::launch::async, [this, c = call.get()] {
      return stub_->MultiHeadAttention(&c->context, c->request, &c->response);
    });
    if (computing) {
      EXPECT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
    }
    return call;
  }

  // Cancels `call` and waits for it; it ends CANCELLED, or OK when it finished first.
  static void CancelAndWait(BackgroundCall* call) {
    call->context.TryCancel();
    const grpc::Status status = call->status.get();
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::CANCELLED) << status.error_message();
  }

  // After every test: a valid call still succeeds, so nothing above broke the server.
  void TearDown() override {
    if (stub_ == nullptr) return;
    v1::MultiHeadAttentionResponse response;
    const grpc::Status status = Call(ValidRequest(), &response);
    EXPECT_TRUE(status.ok()) << "server stopped serving: " << status.error_message();
  }

  std::unique_ptr<MhaServer> server_;
  std::unique_ptr<v1::Attention::Stub> stub_;
};

}  // namespace mha::testing

#endif  // MHA_TESTS_SERVICE_FIXTURE_H_
