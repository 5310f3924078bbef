// Every limit a request is checked against, at its edge: the largest allowed value passes and one past it is
// refused with the documented status, before anything proportional to the request is allocated.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/registry.h"
#include "server/base/names.h"
#include "server/calls/validate.h"
#include "server/layers/layer_store.h"
#include "tests/service_fixture.h"

namespace mha {
namespace {

using ::mha::testing::kHeads;
using ::mha::testing::ValidRequest;
using ::testing::HasSubstr;

class LimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backends_ = BackendRegistry::Create();
    layers_ = std::make_unique<LayerStore>(int64_t{1} << 30, 16);
    context_.layers = layers_.get();
    context_.backends = backends_.get();
    context_.max_message_bytes = context_.max_scratch_bytes = std::numeric_limits<int64_t>::max();
    context_.max_request_flops = context_.max_reference_flops = std::numeric_limits<double>::infinity();
    // The request's own figures, measured with every limit open.
    absl::StatusOr<MhaPlan> plan = ValidateMultiHeadAttention(Request(), context_);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *std::move(plan);
  }

  static v1::MultiHeadAttentionRequest Request() {
    v1::MultiHeadAttentionRequest request = ValidRequest();
    request.set_return_attention_weights(true);
    return request;
  }

  absl::Status Validate(const ValidationContext& context) const {
    return ValidateMultiHeadAttention(Request(), context).status();
  }

  std::unique_ptr<BackendRegistry> backends_;
  std::unique_ptr<LayerStore> layers_;
  ValidationContext context_;
  MhaPlan plan_;
};

TEST_F(LimitsTest, ResponseBytesAtTheMessageLimitPassAndOneMoreIsRefused) {
  ValidationContext at = context_;
  at.max_message_bytes = plan_.response_bytes;
  EXPECT_TRUE(Validate(at).ok()) << Validate(at);
  at.max_message_bytes = plan_.response_bytes - 1;
  EXPECT_EQ(Validate(at).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Validate(at).message(), HasSubstr("--max_message_mb"));
}

TEST_F(LimitsTest, WorkingMemoryAtTheScratchLimitPassesAndOneByteMoreIsRefused) {
  ValidationContext at = context_;
  at.max_scratch_bytes = plan_.workspace_bytes;
  EXPECT_TRUE(Validate(at).ok()) << Validate(at);
  at.max_scratch_bytes = plan_.workspace_bytes - 1;
  EXPECT_EQ(Validate(at).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Validate(at).message(), HasSubstr("--max_scratch_mb"));
}

TEST_F(LimitsTest, WorkAtTheFlopLimitPassesAndAnyMoreIsRefused) {
  ValidationContext at = context_;
  at.max_request_flops = plan_.flops;
  EXPECT_TRUE(Validate(at).ok()) << Validate(at);
  at.max_request_flops = std::nextafter(plan_.flops, 0.0);
  EXPECT_EQ(Validate(at).code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(LimitsTest, TheReferenceBackendHasItsOwnFlopLimit) {
  v1::MultiHeadAttentionRequest request = Request();
  request.set_backend(v1::BACKEND_REFERENCE);
  ValidationContext at = context_;
  at.max_reference_flops = plan_.flops;
  EXPECT_TRUE(ValidateMultiHeadAttention(request, at).ok());
  at.max_reference_flops = std::nextafter(plan_.flops, 0.0);
  EXPECT_EQ(ValidateMultiHeadAttention(request, at).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(ElementCountLimitTest, TheLargestCountPassesAndOneMoreIsAnOverflow) {
  // Counts stay below int64's maximum / 16, so that count * bytes (at most 16 per element) cannot overflow.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 16;
  EXPECT_EQ(*CheckedElementCount({kMax}, "t"), kMax);
  EXPECT_EQ(*CheckedElementCount({kMax / 2, 2}, "t"), kMax / 2 * 2);
  EXPECT_THAT(CheckedElementCount({kMax + 1}, "t").status().message(), HasSubstr("too many elements"));
  EXPECT_THAT(CheckedElementCount({kMax / 2 + 1, 2}, "t").status().message(), HasSubstr("too many elements"));
  EXPECT_THAT(CheckedElementCount({int64_t{1} << 32, int64_t{1} << 32}, "t").status().message(),
              HasSubstr("too many elements"));
}

TEST(LayerLimitTest, ALayerThatFillsTheStoreExactlyLoadsAndOneByteLessRefusesIt) {
  const v1::AttentionWeights weights = ValidRequest().inline_weights();
  v1::HeadConfig heads;
  heads.set_num_heads(kHeads);
  absl::StatusOr<LayerShape> shape = CheckLayerWeights(weights, heads, "weights");
  ASSERT_TRUE(shape.ok());
  const int64_t bytes = shape->HeldBytes();

  LayerStore exact(bytes, 4);
  EXPECT_TRUE(exact.Load("fits", "test", weights, heads, "weights").ok());
  LayerStore short_by_one(bytes - 1, 4);
  const absl::Status refused = short_by_one.Load("does_not", "test", weights, heads, "weights").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("--max_layer_mb"));
}

TEST(LayerLimitTest, TheLastAllowedLayerLoadsAndTheNextIsRefused) {
  const v1::AttentionWeights weights = ValidRequest().inline_weights();
  v1::HeadConfig heads;
  heads.set_num_heads(kHeads);
  LayerStore store(int64_t{1} << 30, 2);
  EXPECT_TRUE(store.Load("one", "test", weights, heads, "weights").ok());
  EXPECT_TRUE(store.Load("two", "test", weights, heads, "weights").ok());
  EXPECT_EQ(store.Load("three", "test", weights, heads, "weights").status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(NameLimitTest, A128CharacterNameIsAllowedAnd129IsNot) {
  EXPECT_TRUE(CheckName(std::string(128, 'a'), "name").ok());
  EXPECT_EQ(CheckName(std::string(129, 'a'), "name").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckName("", "name").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mha
