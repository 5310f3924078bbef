// The wire codec: dtype sizes, fp16/bf16 rounding, and tensor checks with their exact messages.
#include "proto/mha/v1/tensor_codec.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

// INT8, FP8_E4M3 and FP8_E5M2 are what a KV cache stores (CreateSessionRequest.cache_dtype), never a tensor.
TEST(TensorCodec, TheCacheOnlyDtypesAreRefusedOnTensorsSayingSo) {
  for (v1::DataType dtype : {v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    v1::Tensor t;
    t.add_shape(4);
    t.set_dtype(dtype);
    t.set_data(std::string(4, '\0'));
    const absl::StatusOr<int64_t> count = CheckTensor(t, "query");
    EXPECT_EQ(count.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(count.status().message()),
                ::testing::HasSubstr("query.dtype " + DTypeName(dtype) + " is for KV caches only"));
    EXPECT_EQ(DTypeSize(dtype), 0u);
    EXPECT_TRUE(IsCacheOnlyDType(dtype));
  }
  EXPECT_FALSE(IsCacheOnlyDType(v1::BF16));
}

TEST(TensorCodec, HalfRoundTripsEveryFiniteHalf) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf / NaN checked below
    EXPECT_EQ(FloatToHalf(HalfToFloat(h)), h) << "bits " << bits;
  }
}

TEST(TensorCodec, HalfRoundsToNearestEven) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);              // tie -> even (down)
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 4.0f / 2048);  // tie -> even (up)
  EXPECT_EQ(HalfToFloat(FloatToHalf(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(65520.0f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(5.9604644775390625e-8f)), 5.9604644775390625e-8f);  // smallest subnormal
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(-std::numeric_limits<float>::infinity())),
            -std::numeric_limits<float>::infinity());
}

TEST(TensorCodec, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);               // tie -> even (down)
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(TensorCodec, FloatsToTensorAndBackPreservesFp32Exactly) {
  const std::vector<float> values = {1.5f, -2.25f, 3.0e-20f, 7.0f, 0.0f, -0.0f};
  v1::Tensor t;
  FloatsToTensor(values, {2, 3}, v1::FP32, &t);
  EXPECT_EQ(t.data().size(), 24u);
  ASSERT_TRUE(CheckTensor(t, "t").ok());
  EXPECT_EQ(TensorToFloats(t), values);
}

// Found by the fuzz build's UBSan (tests/fuzz): an empty vector's null data() reached memcpy. Zero elements of any
// dtype are a no-op, whatever the pointers.
TEST(TensorCodec, ZeroElementsTouchNothing) {
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16}) {
    EncodeFromFloat(dtype, nullptr, 0, nullptr);
    DecodeToFloat(dtype, nullptr, 0, nullptr);
    v1::Tensor t;
    FloatsToTensor({}, {0}, dtype, &t);
    EXPECT_TRUE(t.data().empty());
  }
}

TEST(TensorCodec, CheckTensorRejectsUnspecifiedDtype) {
  v1::Tensor t;
  t.add_shape(1);
  const absl::Status s = CheckTensor(t, "query").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("query.dtype"));
}

TEST(TensorCodec, CheckTensorRejectsWrongByteCount) {
  v1::Tensor t;
  t.add_shape(2);
  t.add_shape(3);
  t.set_dtype(v1::FP16);
  t.set_data(std::string(10, '\0'));
  const absl::Status s = CheckTensor(t, "key").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("key.data has 10 bytes, expected 12"));
}

TEST(TensorCodec, CheckTensorRejectsNonPositiveDims) {
  v1::Tensor t;
  t.add_shape(2);
  t.add_shape(0);
  t.set_dtype(v1::FP32);
  const absl::Status s = CheckTensor(t, "value").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("value.shape[1] must be >= 1, got 0"));
}

TEST(TensorCodec, CheckTensorRejectsOverflowingShapes) {
  v1::Tensor t;
  for (int i = 0; i < 4; ++i) t.add_shape(int64_t{1} << 20);
  t.set_dtype(v1::FP32);
  const absl::Status s = CheckTensor(t, "query").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("overflow"));
}

}  // namespace
}  // namespace mha
