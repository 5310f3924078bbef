// The service under load and against clients that give up: deadlines that stop work, admission by cost, bounded
// in-flight memory, a shutdown that ends within its grace period, and health that a load balancer can trust. All
// in process; every wait is bounded.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
#include "tests/service_fixture.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::ServiceTest;
using ::mha::testing::CallsJoiningABatch;
using ::mha::testing::SetTensor;
using ::mha::testing::SlowDemoRequest;
using ::testing::HasSubstr;

using Clock = std::chrono::steady_clock;

// A call on the CPU backend large enough to go through the queue (0.67 GFLOP), small enough to take milliseconds.
v1::MultiHeadAttentionRequest QueuedCpuRequest() {
  v1::MultiHeadAttentionRequest r = SlowDemoRequest(1);
  r.set_backend(v1::BACKEND_CPU);
  return r;
}

// The fixture's Start() and BackgroundCall, under this suite's name.
using ServingTest = ServiceTest;

TEST_F(ServingTest, CancelledCallStopsComputingAndFreesTheComputeThread) {
  // The next call arrives while the cancelled one may still count as queued work: a default deadline far enough
  // that admission never refuses it (under TSan on a slow host that work read 127 s against the default 120 s).
  ServerOptions options;
  options.default_deadline_s = 3600;
  StartServer(options);
  // About ten seconds of reference loops; the client cancels it once it computes.
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(16));
  slow->context.TryCancel();
  EXPECT_EQ(slow->status.get().error_code(), grpc::StatusCode::CANCELLED);

  // The next call waits only until the cancelled computation notices, not for its remaining seconds.
  v1::MultiHeadAttentionResponse next;
  ASSERT_TRUE(Call(QueuedCpuRequest(), &next).ok());
  EXPECT_LT(next.timing().queue_us(), 2'000'000);
  EXPECT_THAT(server_->metrics().Text(),
              HasSubstr("mha_requests_total{backend=\"reference\",code=\"CANCELLED\",rpc=\"MultiHeadAttention\"} 1"));
}

TEST_F(ServingTest, CallThatCannotMeetItsDeadlineIsRefusedAtArrival) {
  // About a second of the reference backend's loops against 300 ms; a 2 MB request, so that sending and checking it
  // stay far inside the deadline even under TSan.
  const v1::MultiHeadAttentionRequest request = SlowDemoRequest(4);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  v1::MultiHeadAttentionResponse response;
  const auto start = Clock::now();
  const grpc::Status status = stub_->MultiHeadAttention(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(), HasSubstr("refused at arrival"));
  EXPECT_THAT(status.error_message(), HasSubstr("GFLOP/s"));
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(300));
}

TEST_F(ServingTest, CallWithoutADeadlineGetsTheServersDefault) {
  ServerOptions options;
  options.default_deadline_s = 0.2;
  StartServer(options);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(SlowDemoRequest(16), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
}

TEST_F(ServingTest, DeadlinePassingDuringComputeEndsTheCallAsDeadlineExceeded) {
  // Keep the compute thread busy, so that the second call's deadline passes while it waits or computes; whatever
  // the admission estimate, the call must end as DEADLINE_EXCEEDED, never OK.
  std::unique_ptr<BackgroundCall> busy = Start(SlowDemoRequest(8));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  v1::MultiHeadAttentionResponse response;
  EXPECT_EQ(stub_->MultiHeadAttention(&context, QueuedCpuRequest(), &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  busy->context.TryCancel();
  busy->status.get();
  ASSERT_TRUE(Call(QueuedCpuRequest(), &response).ok());  // the server counted both before this one ran
  const std::string metrics = server_->metrics().Text();
  EXPECT_THAT(metrics, HasSubstr("backend=\"cpu\",code=\"DEADLINE_EXCEEDED\",rpc=\"MultiHeadAttention\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("backend=\"cpu\",code=\"OK\",rpc=\"MultiHeadAttention\"} 1"));
}

TEST_F(ServingTest, ReferenceBackendHasItsOwnWorkLimit) {
  v1::MultiHeadAttentionRequest request;
  SetTensor(request.mutable_query(), {1, 4096, 512}, 3);  // about 43 GFLOP: over 20 on the reference backend
  request.set_layer("demo");
  request.set_backend(v1::BACKEND_REFERENCE);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_reference_gflop"));
}

TEST_F(ServingTest, InFlightMemoryIsBounded) {
  ServerOptions options;
  options.max_inflight_mb = 1;  // the slow call alone holds more; it runs because nothing else is in flight
  StartServer(options);
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(4));
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(QueuedCpuRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_inflight_mb"));
  CancelAndWait(slow.get());
}

TEST_F(ServingTest, ShutdownStopsALongCallAtTheEndOfItsGracePeriod) {
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(16));
  const auto start = Clock::now();
  server_->Shutdown(absl::Milliseconds(300));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  const grpc::Status status = slow->status.get();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.error_code(), ::testing::AnyOf(grpc::StatusCode::CANCELLED, grpc::StatusCode::UNAVAILABLE));
  stub_.reset();  // nothing serves any more
}

TEST(ServingShutdown, HealthStopsAnsweringServingAndNewCallsAreUnavailableWhileDraining) {
  // Over loopback TCP, as a load balancer sees it (an in-process channel cannot outlive its server's shutdown).
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.threads = 2;
  absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::Attention::Stub> stub = v1::Attention::NewStub(channel);
  std::unique_ptr<grpc::health::v1::Health::Stub> health = grpc::health::v1::Health::NewStub(channel);
  auto health_status = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    return status.ok() ? response.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  };
  ASSERT_EQ(health_status(), grpc::health::v1::HealthCheckResponse::SERVING);

  // A long call computes; shutdown starts with 3 s of grace.
  const v1::MultiHeadAttentionRequest slow = SlowDemoRequest(16);
  grpc::ClientContext slow_context;
  slow_context.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));  // as in ServingTest::Start
  v1::MultiHeadAttentionResponse slow_response;
  std::future<grpc::Status> pending = std::async(std::launch::async, [&] {
    return stub->MultiHeadAttention(&slow_context, slow, &slow_response);
  });
  ASSERT_TRUE((*server)->scheduler().AwaitRunning(absl::Seconds(30)));
  std::thread stopper([&] { (*server)->Shutdown(absl::Seconds(3)); });

  // Health flips to NOT_SERVING just before gRPC stops taking calls, after which the check itself is refused
  // (UNKNOWN here): a load balancer sees either, never SERVING again. Poll briefly (bounded) for the change.
  grpc::health::v1::HealthCheckResponse::ServingStatus seen = grpc::health::v1::HealthCheckResponse::SERVING;
  for (int i = 0; i < 100 && seen == grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    seen = health_status();
    if (seen == grpc::health::v1::HealthCheckResponse::SERVING) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  EXPECT_NE(seen, grpc::health::v1::HealthCheckResponse::SERVING);
  // A new call is refused: UNAVAILABLE, from the scheduler before gRPC's shutdown starts or from gRPC after it; a
  // call that reaches gRPC in the instant its shutdown starts is CANCELLED by gRPC before any handler sees it (seen
  // once in CI on a loaded machine). Either way it does not compute.
  grpc::ClientContext context;
  v1::MultiHeadAttentionResponse response;
  EXPECT_THAT(stub->MultiHeadAttention(&context, QueuedCpuRequest(), &response).error_code(),
              ::testing::AnyOf(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::CANCELLED));
  EXPECT_FALSE(response.has_output());
  stopper.join();
  EXPECT_FALSE(pending.get().ok());  // stopped at the end of the grace period
}

TEST_F(ServingTest, HealthIsNotServingWhileTheComputeThreadIsStuck) {
  ServerOptions options;
  options.stuck_after_s = 0.2;
  StartServer(options);
  std::unique_ptr<grpc::health::v1::Health::Stub> health =
      grpc::health::v1::Health::NewStub(server_->InProcessChannel());
  auto status_of_server = [&] {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  };
  EXPECT_EQ(status_of_server(), grpc::health::v1::HealthCheckResponse::SERVING);

  // One long call computes while another waits.
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(16));
  std::unique_ptr<BackgroundCall> queued = Start(QueuedCpuRequest(), /*computing=*/false);

  // The watchdog looks once a second.
  bool not_serving = false;
  for (int i = 0; i < 50 && !not_serving; ++i) {
    not_serving = status_of_server() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
    if (!not_serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(not_serving);

  slow->context.TryCancel();
  slow->status.get();
  EXPECT_TRUE(queued->status.get().ok());
  bool serving = false;
  for (int i = 0; i < 50 && !serving; ++i) {
    serving = status_of_server() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(serving);
}

TEST_F(ServingTest, ReadinessFailsWhileCallsPileUpAndLivenessHolds) {
  ServerOptions options;
  options.stuck_after_s = 0;  // never wedged: liveness must stay SERVING throughout
  options.ready_max_queue = 2;
  StartServer(options);
  std::unique_ptr<grpc::health::v1::Health::Stub> health =
      grpc::health::v1::Health::NewStub(server_->InProcessChannel());
  auto status_of = [&](const std::string& service) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  };
  auto await = [&](const std::string& service, grpc::health::v1::HealthCheckResponse::ServingStatus want) {
    for (int i = 0; i < 50; ++i) {
      if (status_of(service) == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  const std::string readiness = "mha.v1.Attention";
  EXPECT_EQ(status_of(readiness), grpc::health::v1::HealthCheckResponse::SERVING);

  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(16));
  std::unique_ptr<BackgroundCall> first = Start(QueuedCpuRequest(), /*computing=*/false);
  std::unique_ptr<BackgroundCall> second = Start(QueuedCpuRequest(), /*computing=*/false);
  ASSERT_TRUE(server_->scheduler().AwaitQueued(2, absl::Seconds(10)));
  EXPECT_TRUE(await(readiness, grpc::health::v1::HealthCheckResponse::NOT_SERVING));
  EXPECT_EQ(status_of(""), grpc::health::v1::HealthCheckResponse::SERVING);

  slow->context.TryCancel();
  slow->status.get();
  EXPECT_TRUE(first->status.get().ok());
  EXPECT_TRUE(second->status.get().ok());
  EXPECT_TRUE(await(readiness, grpc::health::v1::HealthCheckResponse::SERVING));
}

// Self-attention on the demo layer: `batch` x `tokens` tokens, with key_lengths when `lengths`.
v1::MultiHeadAttentionRequest DemoRequest(int64_t batch, int64_t tokens, uint32_t seed, v1::Backend backend,
                                          bool lengths = false) {
  v1::MultiHeadAttentionRequest r;
  SetTensor(r.mutable_query(), {batch, tokens, 512}, seed);
  r.set_layer("demo");
  r.set_backend(backend);
  if (lengths) {
    for (int64_t b = 0; b < batch; ++b) r.add_key_lengths(static_cast<int32_t>((b * 5 + seed) % (tokens + 1)));
  }
  return r;
}

class BatchingTest : public ServingTest, public ::testing::WithParamInterface<v1::Backend> {
 protected:
  // Queues `requests` behind a long call, then lets them run: they wait together, so the compute thread takes
  // compatible ones as one batch. Returns their responses.
  std::vector<v1::MultiHeadAttentionResponse> RunTogether(const std::vector<v1::MultiHeadAttentionRequest>& requests) {
    std::unique_ptr<BackgroundCall> blocker = Start(SlowDemoRequest(16));
    std::vector<std::unique_ptr<BackgroundCall>> calls;
    for (const auto& request : requests) calls.push_back(Start(request, /*computing=*/false));
    EXPECT_TRUE(server_->scheduler().AwaitQueued(static_cast<int>(requests.size()), absl::Seconds(30)));
    blocker->context.TryCancel();
    blocker->status.get();
    std::vector<v1::MultiHeadAttentionResponse> responses;
    for (auto& call : calls) {
      const grpc::Status status = call->status.get();
      EXPECT_TRUE(status.ok()) << status.error_message();
      responses.push_back(call->response);
    }
    return responses;
  }
};

TEST_P(BatchingTest, BatchedCallsAnswerAsTheyWouldAlone) {
  const std::vector<v1::MultiHeadAttentionRequest> requests = {
      DemoRequest(1, 12, 1, GetParam()), DemoRequest(2, 12, 2, GetParam(), /*lengths=*/true),
      DemoRequest(1, 12, 3, GetParam()), DemoRequest(3, 12, 4, GetParam(), /*lengths=*/true)};
  const std::vector<v1::MultiHeadAttentionResponse> batched = RunTogether(requests);
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()), 3);  // one batch of 4
  for (size_t i = 0; i < requests.size(); ++i) {
    v1::MultiHeadAttentionResponse alone;
    ASSERT_TRUE(Call(requests[i], &alone).ok());
    EXPECT_THAT(batched[i].output().shape(), ::testing::ElementsAreArray(alone.output().shape()));
    const std::vector<float> got = TensorToFloats(batched[i].output()), want = TensorToFloats(alone.output());
    if (GetParam() == v1::BACKEND_REFERENCE) {
      EXPECT_EQ(got, want) << "call " << i;  // plain loops: each batch item is computed the same way
    } else {
      EXPECT_TRUE(testing::AllClose(got, want, 1e-6, 1e-5)) << "call " << i;
    }
  }
}

TEST_P(BatchingTest, IncompatibleCallsAreNotBatched) {
  v1::MultiHeadAttentionRequest other_length = DemoRequest(1, 10, 2, GetParam());
  v1::MultiHeadAttentionRequest with_weights = DemoRequest(1, 12, 3, GetParam());
  with_weights.set_return_attention_weights(true);
  const std::vector<v1::MultiHeadAttentionResponse> responses =
      RunTogether({DemoRequest(1, 12, 1, GetParam()), other_length, with_weights});
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()), 0);
  EXPECT_EQ(responses[2].attention_weights().shape_size(), 4);
}

// The demo layer fixes no RoPE, so a call may set its own (ResolveHeads): calls that rotate differently compute
// apart, each with its own, and calls that rotate alike still share a batch.
TEST_P(BatchingTest, CallsRotatingDifferentlyAreNotBatchedTogether) {
  std::vector<v1::MultiHeadAttentionRequest> requests;
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    requests.push_back(DemoRequest(1, 12, seed, GetParam()));
    if (seed % 2 == 0) requests.back().mutable_heads()->set_rope_theta(10000.0);
  }
  const std::vector<v1::MultiHeadAttentionResponse> batched = RunTogether(requests);
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()), 2);  // two batches of 2
  for (size_t i = 0; i < requests.size(); ++i) {
    v1::MultiHeadAttentionResponse alone;
    ASSERT_TRUE(Call(requests[i], &alone).ok());
    EXPECT_TRUE(testing::AllClose(TensorToFloats(batched[i].output()), TensorToFloats(alone.output()), 1e-6, 1e-5))
        << "call " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BatchingTest, ::testing::Values(v1::BACKEND_CPU, v1::BACKEND_REFERENCE),
                         [](const auto& info) { return info.param == v1::BACKEND_CPU ? "Cpu" : "Reference"; });

TEST_F(ServingTest, BatchingOffComputesEachCallAlone) {
  ServerOptions options;
  options.max_batch_rows = 0;
  StartServer(options);
  std::unique_ptr<BackgroundCall> blocker = Start(SlowDemoRequest(16));
  std::vector<std::unique_ptr<BackgroundCall>> calls;
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    calls.push_back(Start(DemoRequest(1, 12, seed, v1::BACKEND_CPU), /*computing=*/false));
  }
  ASSERT_TRUE(server_->scheduler().AwaitQueued(3, absl::Seconds(30)));
  blocker->context.TryCancel();
  blocker->status.get();
  for (auto& call : calls) EXPECT_TRUE(call->status.get().ok());
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()), 0);
}

// Resident memory of this process, in bytes.
int64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

// A cross-attention call on the demo layer with `keys` keys (fp16 on the wire).
v1::MultiHeadAttentionRequest LongKeysRequest(int64_t keys) {
  v1::MultiHeadAttentionRequest r;
  SetTensor(r.mutable_query(), {1, 16, 512}, 5);
  SetTensor(r.mutable_key(), {1, keys, 512}, 6, v1::FP16);
  r.set_layer("demo");
  r.set_backend(v1::BACKEND_CPU);
  return r;
}

TEST_F(ServingTest, MemoryReturnsNearItsWarmLevelAfterALargeCall) {
  v1::MultiHeadAttentionResponse response;
  ASSERT_TRUE(Call(LongKeysRequest(1000), &response).ok());
  const int64_t warm = ResidentBytes();
  {
    // Projected keys and values alone: 2 x 120000 x 512 fp32 = 491 MB; packed K and V 61 MB per thread.
    ASSERT_TRUE(Call(LongKeysRequest(120000), &response).ok());
  }
  ASSERT_TRUE(Call(LongKeysRequest(1000), &response).ok());
  EXPECT_LT(ResidentBytes() - warm, int64_t{64} << 20) << "warm " << (warm >> 20) << " MiB";
}

}  // namespace
}  // namespace mha
