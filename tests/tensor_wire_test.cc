// Tensors outside the protobuf message: the encoding is protobuf's own, decoding routes each tensor's data to the
// caller's memory and accepts exactly what protobuf accepts.
#include "proto/mha/v1/tensor_wire.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

// gRPC's slices need the library initialised, as a server or channel would have it.
class GrpcEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { grpc_init(); }
  void TearDown() override { grpc_shutdown(); }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new GrpcEnvironment);

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& slice : slices) out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return out;
}

// `bytes` as a byte buffer of slices of `piece` bytes each (the last may be shorter).
grpc::ByteBuffer Split(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) slices.emplace_back(bytes.substr(at, piece));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::Tensor MakeTensor(std::vector<int64_t> shape, v1::DataType dtype, std::string data) {
  v1::Tensor tensor;
  for (int64_t d : shape) tensor.add_shape(d);
  tensor.set_dtype(dtype);
  tensor.set_data(std::move(data));
  return tensor;
}

TensorBytes Out(int field, const v1::Tensor& tensor, std::vector<grpc::Slice>* keep) {
  TensorBytes out;
  out.field = field;
  out.header = tensor;
  out.header.clear_data();
  out.data = grpc::Slice(tensor.data());
  keep->push_back(out.data);
  return out;
}

v1::MultiHeadAttentionResponse SampleResponse() {
  v1::MultiHeadAttentionResponse response;
  *response.mutable_output() = MakeTensor({1, 2, 3}, v1::FP32, std::string(24, '\x11'));
  *response.mutable_attention_weights() = MakeTensor({1, 1, 2, 2}, v1::BF16, std::string(8, '\x22'));
  response.set_backend("cpu");
  response.mutable_timing()->set_compute_us(12345);
  return response;
}

v1::MultiHeadAttentionRequest SampleRequest() {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query() = MakeTensor({2, 3, 4}, v1::FP32, std::string(96, 'q'));
  *request.mutable_key() = MakeTensor({2, 5, 4}, v1::FP16, std::string(80, 'k'));
  request.set_layer("demo");
  request.add_key_lengths(5);
  request.add_key_lengths(3);
  *request.mutable_attn_mask() = MakeTensor({3, 5}, v1::FP32, std::string(60, 'm'));
  request.add_head_mask(0.5f);
  request.set_output_dtype(v1::BF16);
  return request;
}

// Decodes with fields {1, 2} going to per-field strings, the way a client fills its arrays.
struct Decoded {
  absl::Status status;
  std::map<int, std::string> data;
  int calls = 0;
};

template <typename Message>
Decoded Decode(const grpc::ByteBuffer& in, Message* message, std::vector<int> fields = {1, 2}) {
  Decoded decoded;
  CopyingSink sink([&](int field, size_t bytes) {
    ++decoded.calls;
    std::string& to = decoded.data[field];
    to.assign(bytes, '\0');
    return to.data();
  });
  decoded.status = DecodeWithTensors(in, fields, &sink, message);
  return decoded;
}

TEST(TensorWire, AResponseEncodesToTheBytesProtobufWrites) {
  const v1::MultiHeadAttentionResponse response = SampleResponse();
  std::vector<grpc::Slice> keep;
  const TensorBytes output = Out(1, response.output(), &keep);
  const TensorBytes weights = Out(2, response.attention_weights(), &keep);
  v1::MultiHeadAttentionResponse rest = response;
  rest.clear_output();
  rest.clear_attention_weights();
  grpc::ByteBuffer encoded;
  const TensorBytes* tensors[] = {&output, &weights};
  ASSERT_TRUE(EncodeWithTensors(tensors, rest, &encoded).ok());
  EXPECT_EQ(Bytes(encoded), response.SerializeAsString());
}

TEST(TensorWire, TheDataSliceIsSentAsIsNotCopied) {
  char* data = nullptr;
  TensorBytes output;
  output.field = 1;
  output.header = MakeTensor({4}, v1::FP32, "");
  output.data = NewTensorSlice(16, &data);
  grpc::ByteBuffer encoded;
  const TensorBytes* tensors[] = {&output};
  ASSERT_TRUE(EncodeWithTensors(tensors, v1::MultiHeadAttentionResponse(), &encoded).ok());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(encoded.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), data);
}

TEST(TensorWire, NewTensorSliceIsZeroed) {
  char* data = nullptr;
  const grpc::Slice slice = NewTensorSlice(4096, &data);
  ASSERT_EQ(slice.size(), 4096u);
  EXPECT_EQ(std::string(data, 4096), std::string(4096, '\0'));
}

TEST(TensorWire, TensorsOutOfFieldOrderStillParseAsTheWholeMessage) {
  const v1::MultiHeadAttentionRequest request = SampleRequest();
  std::vector<grpc::Slice> keep;
  const TensorBytes query = Out(1, request.query(), &keep);
  const TensorBytes mask = Out(8, request.attn_mask(), &keep);
  v1::MultiHeadAttentionRequest rest = request;
  rest.clear_query();
  rest.clear_attn_mask();
  grpc::ByteBuffer encoded;
  const TensorBytes* tensors[] = {&mask, &query};
  ASSERT_TRUE(EncodeWithTensors(tensors, rest, &encoded).ok());
  v1::MultiHeadAttentionRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Bytes(encoded)));
  EXPECT_EQ(parsed.SerializeAsString(), request.SerializeAsString());
}

TEST(TensorWire, AHeaderWithDataIsRefused) {
  TensorBytes output;
  output.field = 1;
  output.header = MakeTensor({1}, v1::FP32, "abcd");
  grpc::ByteBuffer encoded;
  const TensorBytes* tensors[] = {&output};
  EXPECT_EQ(EncodeWithTensors(tensors, v1::MultiHeadAttentionResponse(), &encoded).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorWire, DecodeSendsTheChosenTensorsDataToTheSinkAndKeepsTheRest) {
  const v1::MultiHeadAttentionRequest request = SampleRequest();
  v1::MultiHeadAttentionRequest message;
  const Decoded decoded = Decode(Split(request.SerializeAsString(), 7), &message);
  ASSERT_TRUE(decoded.status.ok()) << decoded.status;
  EXPECT_EQ(decoded.data.at(1), request.query().data());
  EXPECT_EQ(decoded.data.at(2), request.key().data());
  EXPECT_TRUE(message.query().data().empty());
  EXPECT_TRUE(message.key().data().empty());
  // Everything else is in the message, the mask's data included (field 8 was not chosen).
  v1::MultiHeadAttentionRequest whole = message;
  whole.mutable_query()->set_data(decoded.data.at(1));
  whole.mutable_key()->set_data(decoded.data.at(2));
  EXPECT_EQ(whole.SerializeAsString(), request.SerializeAsString());
}

// A sink that records what it is told.
class RecordingSink final : public TensorSink {
 public:
  bool Begin(int field, const v1::Tensor& header, size_t bytes) override {
    begins.push_back({field, header.dtype(), header.shape_size(), bytes});
    return true;
  }
  void Append(const char* data, size_t n) override { pieces.emplace_back(data, n); }

  struct Begun {
    int field;
    v1::DataType dtype;
    int rank;
    size_t bytes;
  };
  std::vector<Begun> begins;
  std::vector<std::string> pieces;
};

TEST(TensorWire, TheSinkSeesTheHeaderReadSoFarAndTheDataAsItLies) {
  const v1::MultiHeadAttentionRequest request = SampleRequest();
  RecordingSink sink;
  v1::MultiHeadAttentionRequest message;
  const int fields[] = {2};
  ASSERT_TRUE(DecodeWithTensors(Split(request.SerializeAsString(), 32), fields, &sink, &message).ok());
  ASSERT_EQ(sink.begins.size(), 1u);
  EXPECT_EQ(sink.begins[0].field, 2);
  EXPECT_EQ(sink.begins[0].dtype, v1::FP16);  // protobuf writes shape and dtype before data
  EXPECT_EQ(sink.begins[0].rank, 3);
  EXPECT_EQ(sink.begins[0].bytes, 80u);
  EXPECT_GT(sink.pieces.size(), 1u);  // 80 bytes across slices of 32
  std::string joined;
  for (const std::string& piece : sink.pieces) joined += piece;
  EXPECT_EQ(joined, request.key().data());
}

TEST(TensorWire, DecodeReadsAnySlicing) {
  const std::string bytes = SampleRequest().SerializeAsString();
  for (size_t piece : {1, 2, 3, 64, 100000}) {
    v1::MultiHeadAttentionRequest message;
    const Decoded decoded = Decode(Split(bytes, piece), &message);
    ASSERT_TRUE(decoded.status.ok()) << "slices of " << piece << ": " << decoded.status;
    EXPECT_EQ(decoded.data.at(1), SampleRequest().query().data()) << "slices of " << piece;
  }
}

// Long fields left to protobuf (here the mask, unchosen, and a long layer name) are handed on as references to the
// input's slices rather than copied; the message is the same.
TEST(TensorWire, LongUnchosenFieldsReachTheMessageWhole) {
  v1::MultiHeadAttentionRequest request = SampleRequest();
  std::string mask(10000, '\0');
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = static_cast<char>(i * 7);
  request.mutable_attn_mask()->set_data(mask);
  request.set_layer(std::string(5000, 'n'));
  for (size_t piece : {1000, 4096, 100000}) {
    v1::MultiHeadAttentionRequest message;
    const Decoded decoded = Decode(Split(request.SerializeAsString(), piece), &message);
    ASSERT_TRUE(decoded.status.ok()) << decoded.status;
    message.mutable_query()->set_data(decoded.data.at(1));
    message.mutable_key()->set_data(decoded.data.at(2));
    EXPECT_EQ(message.SerializeAsString(), request.SerializeAsString()) << "slices of " << piece;
  }
}

TEST(TensorWire, ARepeatedTensorFieldMergesAsInProtobuf) {
  // Two occurrences of query: protobuf appends the shapes and keeps the last data.
  const std::string first = MakeTensor({2}, v1::FP32, "aaaaaaaa").SerializeAsString();
  const std::string second = MakeTensor({3}, v1::FP32, "bbbb").SerializeAsString();
  std::string bytes;
  for (const std::string* body : {&first, &second}) {
    bytes += '\x0a';
    bytes += static_cast<char>(body->size());
    bytes += *body;
  }
  v1::MultiHeadAttentionRequest protobuf;
  ASSERT_TRUE(protobuf.ParseFromString(bytes));
  v1::MultiHeadAttentionRequest message;
  const Decoded decoded = Decode(Split(bytes, 5), &message);
  ASSERT_TRUE(decoded.status.ok()) << decoded.status;
  EXPECT_EQ(decoded.calls, 2);
  EXPECT_EQ(decoded.data.at(1), protobuf.query().data());
  message.mutable_query()->set_data(decoded.data.at(1));
  EXPECT_EQ(message.SerializeAsString(), protobuf.SerializeAsString());
}

// Each occurrence of a tensor's data parses the header read so far: a few are accepted (the last wins, as in
// protobuf), more are refused naming the field, so that millions of empty ones cannot hold the decoder for hours.
TEST(TensorWire, ATensorsDataOccursAtMostFourTimes) {
  for (int occurrences : {4, 5}) {
    std::string body = MakeTensor({1}, v1::FP32, "").SerializeAsString();
    for (int i = 0; i < occurrences; ++i) body += std::string("\x1a\x04") + static_cast<char>('a' + i) + "bcd";
    const std::string bytes = std::string("\x0a") + static_cast<char>(body.size()) + body;
    v1::MultiHeadAttentionRequest protobuf, message;
    ASSERT_TRUE(protobuf.ParseFromString(bytes));
    const Decoded decoded = Decode(Split(bytes, 7), &message);
    if (occurrences == 4) {
      ASSERT_TRUE(decoded.status.ok()) << decoded.status;
      EXPECT_EQ(decoded.data.at(1), protobuf.query().data());
    } else {
      EXPECT_EQ(decoded.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(decoded.status.message(), HasSubstr("field 1's data occurs more than 4 times in its tensor"));
    }
  }
}

TEST(TensorWire, DecodeAcceptsExactlyThePrefixesProtobufAccepts) {
  const std::string bytes = SampleRequest().SerializeAsString();
  for (size_t n = 0; n <= bytes.size(); ++n) {
    const std::string prefix = bytes.substr(0, n);
    v1::MultiHeadAttentionRequest protobuf, message;
    const Decoded decoded = Decode(Split(prefix, 3), &message);
    EXPECT_EQ(decoded.status.ok(), protobuf.ParseFromString(prefix)) << "prefix of " << n << " bytes";
    if (!decoded.status.ok()) {
      EXPECT_EQ(decoded.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(decoded.status.message(), HasSubstr("malformed message"));
    }
  }
}

// Found by fuzz_request_reader: protobuf reads a tag as at most five bytes kept to 32 bits, and a length as at
// most five bytes; the decoder reads them the same way.
TEST(TensorWire, TagsAndLengthsReadAsProtobufReadsThem) {
  const std::string cases[] = {
      std::string("\xd8\xcd\xfb\x8b\x23\xd9\x37", 7),          // a five-byte tag past 32 bits, then a varint
      std::string("\x0a\x80\x80\x80\x80\x80\x00", 7),          // a six-byte length of 0 for query
      std::string("\x2a\x80\x80\x80\x80\x80\x00", 7),          // the same for layer (a field left to protobuf)
      std::string("\xf8\xff\xff\xff\xff\x01\x00", 7),          // a six-byte tag
  };
  for (const std::string& bytes : cases) {
    v1::MultiHeadAttentionRequest protobuf, message;
    const bool protobuf_ok = protobuf.ParseFromString(bytes);
    const Decoded decoded = Decode(Split(bytes, 3), &message);
    EXPECT_EQ(decoded.status.ok(), protobuf_ok) << absl::CHexEscape(bytes) << ": " << decoded.status;
    if (protobuf_ok && decoded.status.ok()) {
      EXPECT_EQ(message.SerializeAsString(), protobuf.SerializeAsString());
    }
  }
}

TEST(TensorWire, ALengthPastTheEndIsRefusedBeforeTheSinkIsAsked) {
  std::string bytes = "\x0a\x05";  // query, 5 bytes
  bytes += "\x1a\x7f";              // data, 127 bytes: past the tensor's end
  bytes += "abc";
  v1::MultiHeadAttentionRequest message;
  const Decoded decoded = Decode(Split(bytes, 100), &message);
  EXPECT_EQ(decoded.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decoded.calls, 0);
}

TEST(TensorWire, ARefusingSinkFailsTheDecodeNamingTheField) {
  const std::string bytes = SampleRequest().SerializeAsString();
  v1::MultiHeadAttentionRequest message;
  const int fields[] = {2};
  CopyingSink refusing([](int, size_t) -> char* { return nullptr; });
  const absl::Status status = DecodeWithTensors(Split(bytes, 16), fields, &refusing, &message);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("field 2's data (80 bytes) is refused"));
}

// No field of this API is a group, but protobuf keeps unknown ones: the decoder (requests of 64 KiB and more) must
// accept and refuse exactly what protobuf's parse (smaller ones) does, and give the same message.
TEST(TensorWire, GroupsParseAsInProtobuf) {
  const std::string tensor = SampleRequest().SerializeAsString();
  const std::string cases[] = {
      std::string("\x0b\x0c", 2),                            // an empty group, field 1
      std::string("\xa3\x06\x08\x05\x12\x02hi\xa4\x06", 10),  // group 100 holding a varint and a string
      std::string("\x0b\x13\x14\x0c", 4),                    // a group inside a group
      tensor + std::string("\x0b\x0c", 2),                   // after the tensors
      std::string("\x0b\x14", 2),                            // ended by another field's number
      std::string("\x0b\x08\x01", 3),                        // never ended
      std::string("\x0c", 1),                                // an end without a start
      std::string(101, '\x0b') + std::string(101, '\x0c'),   // nested past protobuf's depth
  };
  for (const std::string& bytes : cases) {
    v1::MultiHeadAttentionRequest protobuf, message;
    const bool protobuf_ok = protobuf.ParseFromString(bytes);
    const Decoded decoded = Decode(Split(bytes, 3), &message);
    EXPECT_EQ(decoded.status.ok(), protobuf_ok) << absl::CHexEscape(bytes.substr(0, 16)) << ": " << decoded.status;
    if (protobuf_ok && decoded.status.ok()) {
      if (decoded.data.count(1) != 0) message.mutable_query()->set_data(decoded.data.at(1));
      if (decoded.data.count(2) != 0) message.mutable_key()->set_data(decoded.data.at(2));
      if (decoded.data.count(3) != 0) message.mutable_value()->set_data(decoded.data.at(3));
      EXPECT_EQ(message.SerializeAsString(), protobuf.SerializeAsString()) << absl::CHexEscape(bytes.substr(0, 16));
    }
  }
}

TEST(TensorWire, AnEmptyBufferIsAnEmptyMessage) {
  v1::MultiHeadAttentionResponse message;
  message.set_backend("stale");
  const Decoded decoded = Decode(grpc::ByteBuffer(), &message);
  ASSERT_TRUE(decoded.status.ok()) << decoded.status;
  EXPECT_EQ(message.SerializeAsString(), "");
}

}  // namespace
}  // namespace mha
