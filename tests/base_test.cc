// What every part of the server shares (server/base): the one conversion to grpc::Status, log-safe text and the
// name rule.
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/base/grpc_status.h"
#include "server/base/log_safe.h"
#include "server/base/names.h"

namespace mha {
namespace {

TEST(ToGrpcStatus, KeepsTheCodeAndAShortMessage) {
  const grpc::Status status = ToGrpcStatus(absl::InvalidArgumentError("query: shape [2] must have rank 3"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "query: shape [2] must have rank 3");
}

TEST(ToGrpcStatus, CutsALongMessageAtACharacterBoundary) {
  // 2047 ASCII bytes, then a 2-byte character across the limit: the cut keeps whole characters.
  const std::string message = std::string(2047, 'x') + "\xc3\xa9" + std::string(10000, 'y');
  const grpc::Status status = ToGrpcStatus(absl::InvalidArgumentError(message));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), std::string(2047, 'x') + " ... (10002 more bytes)");
}

TEST(ToGrpcStatus, OkIsOk) { EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok()); }

TEST(LogSafe, EscapesWhatCouldForgeALine) {
  EXPECT_EQ(LogSafe("a\nb\"c\x01\xff"), "a\\nb\\\"c\\x01\\xff");
}

TEST(LogSafe, CutsALongTextAndSaysHowLongItWas) {
  EXPECT_EQ(LogSafe(std::string(10, 'z'), 4), "zzzz...(10 bytes)");
  EXPECT_EQ(LogSafe(std::string(4, 'z'), 4), "zzzz");
}

TEST(CheckName, NamesTheFieldAndTheCharacterWithoutEchoingTheName) {
  const absl::Status status = CheckName("ok-name\nforged line", "session_id");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "session_id may only hold [A-Za-z0-9._-]; character 7 is '\\n'");
}

}  // namespace
}  // namespace mha
