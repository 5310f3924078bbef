// Reading a compute request from gRPC's bytes: the message protobuf would give, and each activation scanned for
// inf and NaN on the way whenever its dtype came before its data.
#include "server/calls/request_reader.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

class GrpcEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { grpc_init(); }
  void TearDown() override { grpc_shutdown(); }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new GrpcEnvironment);

// `bytes` in slices of `piece` bytes.
grpc::ByteBuffer Split(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) slices.emplace_back(bytes.substr(at, piece));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::Tensor Floats(std::vector<int64_t> shape, v1::DataType dtype, int64_t bad_index = -1) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) values[i] = 0.01f * static_cast<float>(i % 97) - 0.5f;
  if (bad_index >= 0) values[bad_index] = std::numeric_limits<float>::quiet_NaN();
  v1::Tensor tensor;
  FloatsToTensor(values, shape, dtype, &tensor);
  return tensor;
}

v1::MultiHeadAttentionRequest MhaRequest(int64_t bad_key_index = -1) {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query() = Floats({2, 3, 8}, v1::FP32);
  *request.mutable_key() = Floats({2, 5, 8}, v1::FP16, bad_key_index);
  request.set_layer("demo");
  request.add_key_lengths(5);
  request.add_key_lengths(2);
  request.set_return_attention_weights(true);
  return request;
}

const FiniteScan* ScanOf(const std::vector<FiniteScan>& scans, const v1::Tensor& tensor) {
  for (const FiniteScan& scan : scans) {
    if (scan.tensor == &tensor) return &scan;
  }
  return nullptr;
}

TEST(RequestReader, GivesTheMessageProtobufGives) {
  const v1::MultiHeadAttentionRequest mha = MhaRequest();
  v1::ScaledDotProductAttentionRequest sdpa;
  *sdpa.mutable_q() = Floats({1, 4, 2, 8}, v1::BF16);
  *sdpa.mutable_k() = Floats({1, 6, 2, 8}, v1::BF16);
  *sdpa.mutable_v() = Floats({1, 6, 2, 8}, v1::BF16);
  *sdpa.mutable_attn_mask() = Floats({4, 6}, v1::FP32);
  sdpa.mutable_heads()->set_causal(true);
  for (size_t piece : {1, 7, 4096}) {
    v1::MultiHeadAttentionRequest read_mha;
    std::vector<FiniteScan> scans;
    ASSERT_TRUE(ReadComputeRequest(Split(mha.SerializeAsString(), piece), &read_mha, &scans).ok());
    EXPECT_EQ(read_mha.SerializeAsString(), mha.SerializeAsString()) << "slices of " << piece;
    v1::ScaledDotProductAttentionRequest read_sdpa;
    ASSERT_TRUE(ReadComputeRequest(Split(sdpa.SerializeAsString(), piece), &read_sdpa, &scans).ok());
    EXPECT_EQ(read_sdpa.SerializeAsString(), sdpa.SerializeAsString()) << "slices of " << piece;
  }
}

TEST(RequestReader, ScansEveryActivationFindingTheFirstNaNAcrossSlices) {
  // Slices of 3 bytes split fp16 and fp32 elements between slices.
  const v1::MultiHeadAttentionRequest request = MhaRequest(/*bad_key_index=*/37);
  v1::MultiHeadAttentionRequest read;
  std::vector<FiniteScan> scans;
  ASSERT_TRUE(ReadComputeRequest(Split(request.SerializeAsString(), 3), &read, &scans).ok());
  ASSERT_EQ(scans.size(), 2u);
  const FiniteScan* query = ScanOf(scans, read.query());
  const FiniteScan* key = ScanOf(scans, read.key());
  ASSERT_NE(query, nullptr);
  ASSERT_NE(key, nullptr);
  EXPECT_EQ(query->first_non_finite, -1);
  EXPECT_EQ(key->dtype, v1::FP16);
  EXPECT_EQ(key->first_non_finite, 37);
  EXPECT_EQ(key->first_non_finite, FirstNonFinite(v1::FP16, read.key().data().data(), 2 * 5 * 8));
}

TEST(RequestReader, DataBeforeItsDtypeIsLeftForValidationToScan) {
  const v1::Tensor query = Floats({1, 2, 4}, v1::FP32, /*bad_index=*/1);
  // Tensor fields in reverse order: data (3), dtype (2), shape (1).
  v1::Tensor data_only, rest;
  data_only.set_data(query.data());
  rest.set_dtype(query.dtype());
  *rest.mutable_shape() = query.shape();
  const std::string body = data_only.SerializeAsString() + rest.SerializeAsString();
  std::string bytes = "\x0a";
  bytes += static_cast<char>(body.size());
  bytes += body;
  v1::MultiHeadAttentionRequest read;
  std::vector<FiniteScan> scans;
  ASSERT_TRUE(ReadComputeRequest(Split(bytes, 5), &read, &scans).ok());
  EXPECT_EQ(read.query().SerializeAsString(), query.SerializeAsString());
  EXPECT_TRUE(scans.empty());
}

TEST(RequestReader, AScanAsAnotherDtypeThanTheMessageEndsWithIsDropped) {
  // query's data as fp32, then a second occurrence of query setting only its dtype to fp16: protobuf merges them.
  v1::MultiHeadAttentionRequest first;
  *first.mutable_query() = Floats({1, 2, 4}, v1::FP32);
  v1::MultiHeadAttentionRequest second;
  second.mutable_query()->set_dtype(v1::FP16);
  const std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  v1::MultiHeadAttentionRequest protobuf, read;
  ASSERT_TRUE(protobuf.ParseFromString(bytes));
  std::vector<FiniteScan> scans;
  ASSERT_TRUE(ReadComputeRequest(Split(bytes, 16), &read, &scans).ok());
  EXPECT_EQ(read.SerializeAsString(), protobuf.SerializeAsString());
  EXPECT_EQ(read.query().dtype(), v1::FP16);
  EXPECT_TRUE(scans.empty());
}

TEST(RequestReader, MalformedBytesAreInvalidArgument) {
  std::string bytes = MhaRequest().SerializeAsString();
  bytes.resize(bytes.size() - 3);
  v1::MultiHeadAttentionRequest read;
  std::vector<FiniteScan> scans;
  EXPECT_EQ(ReadComputeRequest(Split(bytes, 64), &read, &scans).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mha
