// The .npy reader and writer against files written by numpy (tests/data/npy, made by make_fixtures.py): every
// supported file reads back with its shape, dtype and values; writing reproduces numpy's bytes exactly; every
// unsupported or damaged file is rejected with a message that says what is wrong.
#include "client/npy.h"

#include <cstdio>
#include <fstream>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "tests/test_util.h"

#ifndef MHA_NPY_FIXTURES_DIR
#error "MHA_NPY_FIXTURES_DIR must name tests/data/npy"
#endif

namespace mha {
namespace {

std::string FixturePath(const std::string& name) { return std::string(MHA_NPY_FIXTURES_DIR) + "/" + name; }

std::string FixtureBytes(const std::string& name) {
  std::ifstream file(FixturePath(name), std::ios::binary);
  std::ostringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

// The fixtures' values: element i (C order) is i * 0.5 - 1.
std::vector<float> Counting(int64_t n) {
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>(i) * 0.5f - 1.0f;
  return values;
}

std::vector<float> Values(const NpyArray& array) {
  std::vector<float> values(array.NumElements());
  DecodeToFloat(array.dtype, array.data.data(), values.size(), values.data());
  return values;
}

struct GoodFile {
  std::string name;
  std::vector<int64_t> shape;
  v1::DataType dtype;
};

std::ostream& operator<<(std::ostream& os, const GoodFile& f) { return os << f.name; }

class NpyGoodFileTest : public ::testing::TestWithParam<GoodFile> {};

TEST_P(NpyGoodFileTest, ReadsShapeDtypeAndValues) {
  const GoodFile& want = GetParam();
  absl::StatusOr<NpyArray> array = ReadNpy(FixturePath(want.name));
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, want.shape);
  EXPECT_EQ(array->dtype, want.dtype);
  EXPECT_EQ(array->data.size(), array->NumElements() * DTypeSize(want.dtype));
  EXPECT_EQ(Values(*array), Counting(array->NumElements()));
}

TEST_P(NpyGoodFileTest, RoundTripsThroughWriteAndRead) {
  absl::StatusOr<NpyArray> array = ReadNpy(FixturePath(GetParam().name));
  ASSERT_TRUE(array.ok()) << array.status();
  const std::string path = ::testing::TempDir() + "/roundtrip_" + GetParam().name;
  ASSERT_OK(WriteNpy(path, *array));
  absl::StatusOr<NpyArray> again = ReadNpy(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->shape, array->shape);
  EXPECT_EQ(again->dtype, array->dtype);
  EXPECT_EQ(again->data, array->data);
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    NumpyWritten, NpyGoodFileTest,
    ::testing::Values(GoodFile{"f4_0d.npy", {}, v1::FP32}, GoodFile{"f4_1d.npy", {5}, v1::FP32},
                      GoodFile{"f4_2d.npy", {2, 3}, v1::FP32}, GoodFile{"f4_3d.npy", {2, 3, 4}, v1::FP32},
                      GoodFile{"f4_4d.npy", {2, 1, 3, 2}, v1::FP32},
                      GoodFile{"f4_5d.npy", {1, 2, 1, 2, 2}, v1::FP32}, GoodFile{"f4_empty.npy", {0, 3}, v1::FP32},
                      GoodFile{"f2_0d.npy", {}, v1::FP16}, GoodFile{"f2_1d.npy", {7}, v1::FP16},
                      GoodFile{"f2_3d.npy", {2, 3, 4}, v1::FP16}, GoodFile{"f2_4d.npy", {1, 2, 2, 3}, v1::FP16},
                      GoodFile{"f4_2d_v2.npy", {2, 3}, v1::FP32}, GoodFile{"f4_2d_v3.npy", {2, 3}, v1::FP32}),
    [](const ::testing::TestParamInfo<GoodFile>& info) {
      std::string name = info.param.name.substr(0, info.param.name.find('.'));
      return name;
    });

// Version 1.0 fixtures are exactly what numpy.save writes, so serializing what was read must give them back.
class NpyNumpyBytesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(NpyNumpyBytesTest, SerializeWritesNumpysBytes) {
  const std::string bytes = FixtureBytes(GetParam());
  absl::StatusOr<NpyArray> array = ParseNpy(bytes, GetParam());
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(SerializeNpy(*array), bytes);
}

INSTANTIATE_TEST_SUITE_P(VersionOne, NpyNumpyBytesTest,
                         ::testing::Values("f4_0d.npy", "f4_1d.npy", "f4_2d.npy", "f4_3d.npy", "f4_4d.npy",
                                           "f4_5d.npy", "f4_empty.npy", "f2_0d.npy", "f2_1d.npy", "f2_3d.npy",
                                           "f2_4d.npy"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param.substr(0, info.param.find('.'));
                         });

TEST(Npy, HugeHeaderIsWrittenAsVersionTwo) {
  NpyArray array;
  array.shape.assign(30000, 1);  // "(1, 1, ...)" needs ~90000 header bytes, over version 1.0's 65535
  array.data = std::string(4, '\0');
  const std::string bytes = SerializeNpy(array);
  EXPECT_EQ(bytes[6], 2);
  EXPECT_EQ(bytes[7], 0);
  absl::StatusOr<NpyArray> again = ParseNpy(bytes, "huge");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->shape, array.shape);
}

void ExpectRejected(const absl::StatusOr<NpyArray>& got, const std::string& message) {
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_EQ(got.status().message(), message);
}

TEST(Npy, RejectsFloat64) {
  ExpectRejected(ParseNpy(FixtureBytes("f8_2d.npy"), "f8_2d.npy"),
                 "f8_2d.npy: dtype '<f8' is not supported; expected '<f4' (float32) or '<f2' (float16)");
}

TEST(Npy, RejectsIntegers) {
  ExpectRejected(ParseNpy(FixtureBytes("i4_1d.npy"), "i4_1d.npy"),
                 "i4_1d.npy: dtype '<i4' is not supported; expected '<f4' (float32) or '<f2' (float16)");
}

TEST(Npy, RejectsBigEndian) {
  ExpectRejected(ParseNpy(FixtureBytes("f4_be_1d.npy"), "f4_be_1d.npy"),
                 "f4_be_1d.npy: dtype '>f4' is not supported; expected '<f4' (float32) or '<f2' (float16)");
}

TEST(Npy, RejectsFortranOrder) {
  ExpectRejected(ParseNpy(FixtureBytes("f4_fortran_2d.npy"), "f.npy"),
                 "f.npy: Fortran-order arrays are not supported; save a C-order array (numpy.ascontiguousarray)");
}

TEST(Npy, RejectsStructuredDtype) {
  ExpectRejected(ParseNpy(FixtureBytes("structured.npy"), "s.npy"),
                 "s.npy: structured dtypes are not supported; expected '<f4' (float32) or '<f2' (float16)");
}

TEST(Npy, RejectsBadMagic) {
  std::string bytes = FixtureBytes("f4_2d.npy");
  bytes[1] = 'X';
  ExpectRejected(ParseNpy(bytes, "x.npy"), "x.npy: not a .npy file (no \\x93NUMPY magic string)");
  ExpectRejected(ParseNpy("", "empty.npy"), "empty.npy: not a .npy file (no \\x93NUMPY magic string)");
}

TEST(Npy, RejectsUnknownVersion) {
  std::string bytes = FixtureBytes("f4_2d.npy");
  bytes[6] = 4;
  ExpectRejected(ParseNpy(bytes, "x.npy"), "x.npy: unsupported .npy format version 4.0; expected 1.0, 2.0 or 3.0");
}

TEST(Npy, RejectsTruncatedData) {
  const std::string bytes = FixtureBytes("f4_2d.npy");  // 128 header bytes + 24 data bytes
  ExpectRejected(ParseNpy(bytes.substr(0, bytes.size() - 4), "x.npy"),
                 "x.npy: truncated data: shape (2, 3) of '<f4' needs 24 data bytes, file has 20");
}

TEST(Npy, RejectsTrailingBytes) {
  ExpectRejected(ParseNpy(FixtureBytes("f2_1d.npy") + "ab", "x.npy"),
                 "x.npy: trailing bytes: shape (7,) of '<f2' needs 14 data bytes, file has 16");
}

TEST(Npy, RejectsTruncatedHeader) {
  const std::string bytes = FixtureBytes("f4_2d.npy");
  ExpectRejected(ParseNpy(bytes.substr(0, 50), "x.npy"),
                 "x.npy: truncated header: needs 118 bytes after the 10-byte preamble, file has 40");
  ExpectRejected(ParseNpy(bytes.substr(0, 9), "x.npy"), "x.npy: truncated before the header length");
}

// A file with the given header dict text, padded the way numpy pads it.
std::string WithHeader(const std::string& dict, const std::string& data) {
  std::string header = dict;
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>(header.size() >> 8));
  return out + header + data;
}

TEST(Npy, RejectsMalformedHeaders) {
  ExpectRejected(ParseNpy(WithHeader("{'descr': '<f4', 'shape': (2,), }", std::string(8, '\0')), "x.npy"),
                 "x.npy: malformed header: no 'fortran_order' key");
  ExpectRejected(ParseNpy(WithHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", ""), "x.npy"),
                 "x.npy: malformed header: expected a non-negative integer at offset 51");
  ExpectRejected(ParseNpy(WithHeader("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,), }", ""), "x.npy"),
                 "x.npy: malformed header: expected True or False at offset 34");
  ExpectRejected(ParseNpy(WithHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", ""), "x.npy"),
                 "x.npy: malformed header: a one-element shape must be written (n,)");
  ExpectRejected(
      ParseNpy(WithHeader("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}", ""), "x.npy"),
      "x.npy: malformed header: unexpected key 'x'");
  ExpectRejected(ParseNpy(WithHeader("['descr']", ""), "x.npy"), "x.npy: malformed header: expected '{' at offset 0");
}

TEST(Npy, AcceptsHeaderSpellingsNumpyAccepts) {
  // Double quotes, any key order, no trailing comma, Python 2's long suffix.
  absl::StatusOr<NpyArray> array =
      ParseNpy(WithHeader(R"({"shape": (2L, 1), "fortran_order": False, "descr": "<f2"})", std::string(4, 'a')),
               "x.npy");
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(array->dtype, v1::FP16);
}

TEST(Npy, MissingFileIsNotFound) {
  absl::StatusOr<NpyArray> got = ReadNpy(FixturePath("no_such.npy"));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got.status().message(), "cannot open " + FixturePath("no_such.npy"));
}

TEST(Npy, ToTensorChecksRankAndEmptyDims) {
  absl::StatusOr<NpyArray> matrix = ReadNpy(FixturePath("f4_2d.npy"));
  ASSERT_TRUE(matrix.ok()) << matrix.status();
  v1::Tensor tensor;
  absl::Status status = NpyToTensor(*matrix, 3, "--query q.npy", "[B, Tq, d_model]", &tensor);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "--query q.npy: shape (2, 3) must be [B, Tq, d_model] with every dim >= 1");

  absl::StatusOr<NpyArray> empty = ReadNpy(FixturePath("f4_empty.npy"));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(NpyToTensor(*empty, 2, "x", "[a, b]", &tensor).code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<NpyArray> half = ReadNpy(FixturePath("f2_3d.npy"));
  ASSERT_TRUE(half.ok()) << half.status();
  ASSERT_OK(NpyToTensor(*half, 3, "x", "[a, b, c]", &tensor));
  EXPECT_EQ(tensor.dtype(), v1::FP16);
  EXPECT_EQ(TensorToFloats(tensor), Counting(24));
}

TEST(Npy, FromTensorWidensBf16ToFloat32) {
  v1::Tensor tensor;
  FloatsToTensor(Counting(6), {3, 2}, v1::BF16, &tensor);
  const NpyArray array = NpyFromTensor(tensor);
  EXPECT_EQ(array.dtype, v1::FP32);
  EXPECT_EQ(array.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(Values(array), Counting(6));  // these values are exact in bf16
}

}  // namespace
}  // namespace mha
