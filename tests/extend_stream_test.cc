// ExtendStream: each request message is one Extend, answered in order on the same stream, exactly as the unary
// Extend answers it; a failed step ends the stream with its status and nothing after it runs; steps of many
// streams batch like unary Extends; the stream's deadline and cancellation reach the step under way.
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "tests/session_fixture.h"

namespace mha::testing {
namespace {

using Stream = grpc::ClientReaderWriter<v1::ExtendRequest, v1::ExtendResponse>;

class ExtendStreamTest : public SessionTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.inline_max_mflop = 0;  // every step through the queue, where batching happens
    // The blockers' estimated work at a sanitizer's pace (the backend's measured rate fell to 10 GFLOP/s under TSan)
    // passed the default 120 s, and the steps queued behind them were refused at arrival.
    options.default_deadline_s = 3600;
    StartServer(options);
  }

  // One stream and its context; `deadline` from now, none when zero.
  struct OpenStream {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream;
  };
  std::unique_ptr<OpenStream> Open(std::chrono::milliseconds deadline = std::chrono::milliseconds(0)) {
    auto open = std::make_unique<OpenStream>();
    if (deadline.count() > 0) open->context.set_deadline(std::chrono::system_clock::now() + deadline);
    open->stream = stub_->ExtendStream(&open->context);
    return open;
  }
  // Writes `requests` on another thread, then half-closes, while the caller reads: a client that pipelines must
  // read as it writes (here the in-process transport completes a write only once the other side has read it).
  static std::thread WriteAll(Stream* stream, std::vector<v1::ExtendRequest> requests) {
    return std::thread([stream, requests = std::move(requests)] {
      for (const v1::ExtendRequest& request : requests) {
        if (!stream->Write(request)) break;  // the stream ended
      }
      stream->WritesDone();
    });
  }
  // One step: written, then its answer read. False when the stream ended instead.
  static bool Step(Stream& stream, const v1::ExtendRequest& request, v1::ExtendResponse* response) {
    return stream.Write(request) && stream.Read(response);
  }
};

TEST_F(ExtendStreamTest, StepsAnswerInOrderAsUnaryExtendsDo) {
  const std::string streamed = Created(HeadSession()), unary = Created(HeadSession());
  std::unique_ptr<OpenStream> open = Open();
  const std::vector<int64_t> tokens = {7, 1, 1, 3, 1};
  int64_t length = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    v1::ExtendResponse step, alone;
    ASSERT_TRUE(Step(*open->stream, ExtendOf({QkvItem(streamed, tokens[i], 10 * i)}), &step)) << "step " << i;
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(unary, tokens[i], 10 * i)}), &alone).ok());
    length += tokens[i];
    EXPECT_EQ(step.results(0).length(), length);
    EXPECT_EQ(TensorToFloats(step.results(0).output()), TensorToFloats(alone.results(0).output())) << "step " << i;
  }
  open->stream->WritesDone();
  const grpc::Status status = open->stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(ExtendStreamTest, PipelinedStepsAreAnsweredInOrderAndHalfClosingEndsWithOk) {
  const std::string a = Created(HeadSession()), b = Created(HeadSession());
  std::unique_ptr<OpenStream> open = Open();
  std::vector<v1::ExtendRequest> steps;
  for (int i = 0; i < 4; ++i) steps.push_back(ExtendOf({QkvItem(i % 2 == 0 ? a : b, 1 + i, i)}));
  std::thread writer = WriteAll(open->stream.get(), std::move(steps));
  std::vector<int64_t> lengths;
  v1::ExtendResponse response;
  while (open->stream->Read(&response)) lengths.push_back(response.results(0).length());
  writer.join();
  EXPECT_THAT(lengths, ::testing::ElementsAre(1, 2, 4, 6));  // a: 1, b: 2, a: 1 + 3, b: 2 + 4
  EXPECT_TRUE(open->stream->Finish().ok());
}

TEST_F(ExtendStreamTest, AFailedStepEndsTheStreamWithItsStatusAndLaterStepsDoNotRun) {
  const std::string id = Created(HeadSession());
  std::unique_ptr<OpenStream> open = Open();
  std::thread writer = WriteAll(open->stream.get(), {ExtendOf({QkvItem(id, 2)}), ExtendOf({QkvItem("gone", 1)}),
                                                     ExtendOf({QkvItem(id, 1)})});
  v1::ExtendResponse first, more;
  ASSERT_TRUE(open->stream->Read(&first));
  EXPECT_EQ(first.results(0).length(), 2);
  EXPECT_FALSE(open->stream->Read(&more));
  writer.join();
  ExpectError(open->stream->Finish(), grpc::StatusCode::NOT_FOUND, "gone");
  EXPECT_EQ(Length(id), 2);
}

TEST_F(ExtendStreamTest, AnInvalidStepIsRefusedNamingTheFieldAndTheServerGoesOn) {
  const std::string id = Created(HeadSession());
  std::unique_ptr<OpenStream> open = Open();
  v1::ExtendResponse unused;
  EXPECT_FALSE(Step(*open->stream, v1::ExtendRequest(), &unused));
  ExpectError(open->stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "items");
  std::unique_ptr<OpenStream> next = Open();
  v1::ExtendResponse response;
  ASSERT_TRUE(Step(*next->stream, ExtendOf({QkvItem(id, 1)}), &response));
  EXPECT_EQ(response.results(0).length(), 1);
}

TEST_F(ExtendStreamTest, StepsOfManyStreamsComputeAsOneBatch) {
  constexpr int kStreams = 4;
  std::vector<std::string> ids;
  for (int i = 0; i < kStreams; ++i) {
    ids.push_back(Created(HeadSession()));
    ASSERT_TRUE(Extend(ExtendOf({QkvItem(ids[i], 3 + i, i)})).ok());
  }
  std::unique_ptr<BackgroundCall> blocker = Start(SlowDemoRequest(16));
  std::vector<std::unique_ptr<OpenStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(Open());
    ASSERT_TRUE(streams.back()->stream->Write(ExtendOf({QkvItem(ids[i], 1, 50 + i)})));
  }
  ASSERT_TRUE(server_->scheduler().AwaitQueued(kStreams, absl::Seconds(30)));
  const int64_t joined_before = CallsJoiningABatch(server_->metrics().Text());
  CancelAndWait(blocker.get());
  for (int i = 0; i < kStreams; ++i) {
    v1::ExtendResponse response;
    ASSERT_TRUE(streams[i]->stream->Read(&response));
    EXPECT_EQ(response.results(0).length(), 4 + i);
  }
  EXPECT_EQ(CallsJoiningABatch(server_->metrics().Text()) - joined_before, kStreams - 1);
}

TEST_F(ExtendStreamTest, TheStreamsDeadlineEndsAWaitingStepAndChangesNoSession) {
  const std::string id = Created(HeadSession());
  ASSERT_TRUE(Extend(ExtendOf({QkvItem(id, 3)})).ok());
  std::unique_ptr<BackgroundCall> blocker = Start(SlowDemoRequest(16));
  std::unique_ptr<OpenStream> open = Open(std::chrono::milliseconds(300));
  v1::ExtendResponse unused;
  EXPECT_FALSE(Step(*open->stream, ExtendOf({QkvItem(id, 1)}), &unused));
  EXPECT_EQ(open->stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  CancelAndWait(blocker.get());
  ASSERT_TRUE(server_->scheduler().AwaitIdle(absl::Seconds(30)));
  EXPECT_EQ(Length(id), 3);
}

TEST_F(ExtendStreamTest, CancellingTheStreamEndsTheStepUnderWay) {
  const std::string id = Created(LayerSession());
  v1::ExtendRequest slow = ExtendOf({XItem(id, 2000)});
  slow.set_backend(v1::BACKEND_REFERENCE);  // seconds of plain loops
  // An hour: admission must not refuse the step at arrival, whatever the reference's measured rate on a loaded
  // machine under a sanitizer (SessionServiceTest.CancelledAndTimedOutCallsChangeNoSession once saw 152 s).
  std::unique_ptr<OpenStream> open = Open(std::chrono::hours(1));
  ASSERT_TRUE(open->stream->Write(slow));
  ASSERT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
  open->context.TryCancel();
  EXPECT_EQ(open->stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(server_->scheduler().AwaitIdle(absl::Seconds(60)));
  EXPECT_EQ(Length(id), 0);
}

TEST_F(ExtendStreamTest, TheStreamSaysItsRequestIdAndInstance) {
  const std::string id = Created(HeadSession());
  std::unique_ptr<OpenStream> named = std::make_unique<OpenStream>();
  named->context.AddMetadata("x-request-id", "my-stream-7");
  named->stream = stub_->ExtendStream(&named->context);
  v1::ExtendResponse response;
  ASSERT_TRUE(Step(*named->stream, ExtendOf({QkvItem(id, 1)}), &response));
  const auto& metadata = named->context.GetServerInitialMetadata();
  ASSERT_EQ(metadata.count("x-request-id"), 1u);
  EXPECT_EQ(std::string(metadata.find("x-request-id")->second.data(), metadata.find("x-request-id")->second.size()),
            "my-stream-7");
  EXPECT_EQ(metadata.count("mha-instance-id"), 1u);
}

}  // namespace
}  // namespace mha::testing
