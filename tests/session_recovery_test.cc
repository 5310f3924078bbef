// The client's record of a session (client/session_recovery.h) without a server: what it keeps, how it replays,
// truncates and forks, when it gives up; and which decode options go with --recover.
#include "client/session_recovery.h"

#include <string>
#include <vector>

#include "client/decode.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A tensor [rows, width] of fp32 whose bytes are `fill`, rows after rows.
v1::Tensor Rows(int64_t rows, int64_t width, char fill) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FP32);
  tensor.add_shape(rows);
  tensor.add_shape(width);
  tensor.set_data(std::string(rows * width * 4, fill));
  return tensor;
}

v1::CreateSessionRequest HeadSession(const std::string& id) {
  v1::CreateSessionRequest create;
  create.set_session_id(id);
  create.mutable_heads()->set_num_heads(4);
  create.mutable_heads()->set_num_kv_heads(2);
  create.mutable_heads()->set_head_dim(16);
  create.set_num_layers(2);
  return create;
}

v1::CreateSessionRequest LayerSession(const std::string& id) {
  v1::CreateSessionRequest create;
  create.set_session_id(id);
  create.add_layers("demo");
  return create;
}

// A head session's item of n tokens (k and v [n, 2, 16], q [n, 4, 16]), its bytes `fill`.
v1::ExtendItem HeadItem(int64_t n, char fill) {
  v1::ExtendItem item;
  const auto heads = [&](int64_t count) {
    v1::Tensor tensor = Rows(n, count * 16, fill);
    tensor.set_shape(1, count);
    tensor.add_shape(16);
    return tensor;
  };
  *item.mutable_q() = heads(4);
  *item.mutable_k() = heads(2);
  *item.mutable_v() = heads(2);
  return item;
}

v1::ExtendItem LayerItem(int64_t n, char fill) {
  v1::ExtendItem item;
  *item.mutable_x() = Rows(n, 8, fill);
  return item;
}

// Rows per replayed request and their expected_length, as "rows@position".
std::vector<std::string> Chunks(const std::vector<v1::ExtendRequest>& requests, int layer = 0) {
  std::vector<std::string> chunks;
  for (const v1::ExtendRequest& request : requests) {
    if (request.layer_index() != layer) continue;
    const v1::ExtendItem& item = request.items(0);
    const v1::Tensor& rows = item.has_x() ? item.x() : item.k();
    chunks.push_back(std::to_string(rows.shape(0)) + "@" + std::to_string(item.expected_length()));
  }
  return chunks;
}

TEST(SessionRecord, MergesAHeadSessionsCallsAndReplaysThemInChunks) {
  SessionRecord record(HeadSession("s"));
  record.Append(0, HeadItem(5, 'a'), v1::BACKEND_AUTO);
  record.Append(0, HeadItem(1, 'b'), v1::BACKEND_AUTO);
  record.Append(0, HeadItem(3, 'c'), v1::BACKEND_AUTO);
  EXPECT_EQ(record.length(0), 9);
  EXPECT_EQ(record.length(1), 0);
  const std::vector<v1::ExtendRequest> replay = record.ReplayRequests(4);
  EXPECT_THAT(Chunks(replay), ElementsAre("4@0", "5@4"));  // 4 + 1 would leave a one-row tail
  const v1::ExtendItem& second = replay[1].items(0);
  EXPECT_EQ(second.session_id(), "s");
  EXPECT_TRUE(second.append());
  EXPECT_EQ(second.k().data(), std::string(1 * 128, 'a') + std::string(128, 'b') + std::string(3 * 128, 'c'));
  EXPECT_THAT(second.q().shape(), ElementsAre(5, 4, 16));
  EXPECT_EQ(second.q().data(), std::string(5 * 4 * 16 * 4, '\0'));
}

TEST(SessionRecord, ReplaysALayerSessionCallByCall) {
  SessionRecord record(LayerSession("s"));
  for (int64_t n : {3, 1, 1}) record.Append(0, LayerItem(n, 'x'), v1::BACKEND_CPU);
  const std::vector<v1::ExtendRequest> replay = record.ReplayRequests(1024);
  EXPECT_THAT(Chunks(replay), ElementsAre("3@0", "1@3", "1@4"));
  EXPECT_EQ(replay[0].backend(), v1::BACKEND_CPU);
  EXPECT_FALSE(replay[0].items(0).has_q());
}

TEST(SessionRecord, KeepsTheBackendOfEachCall) {
  SessionRecord record(HeadSession("s"));
  record.Append(1, HeadItem(2, 'a'), v1::BACKEND_CPU);
  record.Append(1, HeadItem(2, 'b'), v1::BACKEND_REFERENCE);
  const std::vector<v1::ExtendRequest> replay = record.ReplayRequests(1024);
  EXPECT_THAT(Chunks(replay, 1), ElementsAre("2@0", "2@2"));
  EXPECT_EQ(replay[0].backend(), v1::BACKEND_CPU);
  EXPECT_EQ(replay[1].backend(), v1::BACKEND_REFERENCE);
}

TEST(SessionRecord, IgnoresItemsThatDoNotAppend) {
  SessionRecord record(HeadSession("s"));
  v1::ExtendItem item = HeadItem(2, 'a');
  item.set_append(false);
  record.Append(0, item, v1::BACKEND_AUTO);
  EXPECT_EQ(record.length(0), 0);
  EXPECT_TRUE(record.ReplayRequests(16).empty());
  EXPECT_TRUE(record.recoverable());
}

TEST(SessionRecord, TruncateCutsEveryCache) {
  SessionRecord record(HeadSession("s"));
  record.Append(0, HeadItem(6, 'a'), v1::BACKEND_AUTO);
  record.Append(1, HeadItem(2, 'b'), v1::BACKEND_AUTO);
  record.Append(1, HeadItem(2, 'c'), v1::BACKEND_CPU);
  record.Truncate(3);
  EXPECT_EQ(record.length(0), 3);
  EXPECT_EQ(record.length(1), 3);
  EXPECT_EQ(record.bytes(), 2 * (3 + 3) * 128);
  const std::vector<v1::ExtendRequest> replay = record.ReplayRequests(16);
  EXPECT_THAT(Chunks(replay, 1), ElementsAre("2@0", "1@2"));
  EXPECT_EQ(replay.back().items(0).v().data(), std::string(128, 'c'));
}

TEST(SessionRecord, AForkHasTheSameTokensUnderItsOwnId) {
  SessionRecord record(HeadSession("parent"));
  record.Append(0, HeadItem(4, 'a'), v1::BACKEND_AUTO);
  SessionRecord fork = record.Fork("child");
  record.Append(0, HeadItem(1, 'b'), v1::BACKEND_AUTO);
  EXPECT_EQ(fork.id(), "child");
  EXPECT_EQ(fork.create().heads().num_heads(), 4);
  EXPECT_EQ(fork.length(0), 4);
  EXPECT_EQ(record.length(0), 5);
  EXPECT_EQ(fork.ReplayRequests(16).front().items(0).session_id(), "child");
}

TEST(SessionRecord, PastItsBoundTheRecordIsDropped) {
  SessionRecord record(HeadSession("s"), /*max_bytes=*/1000);
  record.Append(0, HeadItem(3, 'a'), v1::BACKEND_AUTO);  // 768 bytes of k and v
  EXPECT_TRUE(record.recoverable());
  record.Append(0, HeadItem(1, 'b'), v1::BACKEND_AUTO);  // 1024
  EXPECT_FALSE(record.recoverable());
  EXPECT_EQ(record.bytes(), 0);
  EXPECT_TRUE(record.ReplayRequests(16).empty());
}

TEST(SessionRecord, ATensorInSharedMemoryCannotBeKept) {
  SessionRecord record(LayerSession("s"));
  v1::ExtendItem item = LayerItem(2, 'x');
  item.mutable_x()->clear_data();
  item.mutable_x()->mutable_shared_memory()->set_region("r");
  record.Append(0, item, v1::BACKEND_AUTO);
  EXPECT_FALSE(record.recoverable());
}

TEST(SessionRecovery, LostMeansNotFoundOrUnavailable) {
  EXPECT_TRUE(IsSessionLost(absl::NotFoundError("gone")));
  EXPECT_TRUE(IsSessionLost(absl::UnavailableError("no server")));
  EXPECT_FALSE(IsSessionLost(absl::FailedPreconditionError("expected_length")));
  EXPECT_FALSE(IsSessionLost(absl::OkStatus()));
}

TEST(DecodeOptionsRecover, GoesWithSessionsBatchedOrPerSession) {
  DecodeOptions options;
  options.recover = true;
  EXPECT_TRUE(ValidateDecodeOptions(options).ok());
  options.per_session = true;
  options.concurrency = 4;
  EXPECT_TRUE(ValidateDecodeOptions(options).ok());
}

TEST(DecodeOptionsRecover, IsAnInvalidArgumentWithStateless) {
  DecodeOptions options;
  options.recover = true;
  options.stateless = true;
  const absl::Status status = ValidateDecodeOptions(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--recover"));
  EXPECT_THAT(status.message(), HasSubstr("--stateless"));
}

TEST(DecodeOptionsRecover, IsAnInvalidArgumentWithShards) {
  DecodeOptions options;
  options.recover = true;
  options.shards = 2;
  options.rope_theta = 0;
  const absl::Status status = ValidateDecodeOptions(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--recover"));
  EXPECT_THAT(status.message(), HasSubstr("--shards"));
}

}  // namespace
}  // namespace mha
