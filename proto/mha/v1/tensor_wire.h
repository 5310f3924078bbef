// Messages whose top-level mha.v1.Tensor fields carry their bytes outside the protobuf message, so that a tensor's
// bytes go between gRPC's byte buffers and the memory that computes on them without a pass through a std::string.
//
// The encoding is plain protobuf, readable by any protobuf library: a tensor field is written as a length-delimited
// Tensor whose last field is the data, and the data's slice is put into the byte buffer as is (no copy). When the
// tensor fields are the message's lowest field numbers, given in ascending order (as the responses' output = 1,
// attention_weights = 2), the bytes are exactly the ones SerializeAsString() gives for the whole message. Otherwise
// they are still valid: protobuf merges a repeated occurrence of a message field into the first.
//
// Decoding copies each tensor's data once, from gRPC's slices straight to memory the caller provides.
#ifndef MHA_PROTO_MHA_V1_TENSOR_WIRE_H_
#define MHA_PROTO_MHA_V1_TENSOR_WIRE_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// One Tensor field of a message with its data held by a refcounted slice (shared, never copied).
struct TensorBytes {
  int field = 0;      // the field number, of type mha.v1.Tensor, in the enclosing message; 0 = not sent
  v1::Tensor header;  // shape and dtype; its data must be empty
  grpc::Slice data;
};

// Fresh zeroed memory for `bytes` bytes (at least one) in a refcounted slice that frees it when the last reference
// goes; *data points at the bytes so that they can be written before the slice is shared. Zeroed so that no byte of
// an earlier call can reach a client even if a writer skipped one.
grpc::Slice NewTensorSlice(size_t bytes, char** data);

// A slice over `bytes` bytes at `data` that neither copies nor frees them: the caller keeps them alive and unchanged
// until the call that sends them has finished.
grpc::Slice BorrowedSlice(const void* data, size_t bytes);
// The bytes of `slice`, in a slice that also keeps `keep` alive until gRPC (or whoever holds the last reference)
// lets go of it: how a response's share of the in-flight memory lasts until the response has been sent.
grpc::Slice SliceKeeping(grpc::Slice slice, std::shared_ptr<const void> keep);

// `tensors` (those with field != 0, in the order given), then `rest`, which must not set those fields, into `out`.
// INVALID_ARGUMENT if a header carries data or `rest` does not serialize.
absl::Status EncodeWithTensors(absl::Span<const TensorBytes* const> tensors, const google::protobuf::MessageLite& rest,
                               grpc::ByteBuffer* out);

// Appends a length-delimited bytes field `field` holding `data` to `slices`: its tag and length, then `data`'s slice
// itself (shared, not copied; nothing for empty data). How a message's large bytes fields (KServe v2's
// raw_input_contents and raw_output_contents) are written after the rest of the message, which protobuf accepts.
void AppendBytesField(int field, const grpc::Slice& data, std::vector<grpc::Slice>* slices);

// Where DecodeWithTensors puts the data of the chosen Tensor fields, piece by piece as it lies in gRPC's slices.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // Field `field`'s data begins: `bytes` bytes follow through Append (bounded by the message's size). `header` is
  // the tensor as read so far: its shape and dtype when they come before the data, as protobuf writes them. False
  // refuses the data (the decode then fails with INVALID_ARGUMENT). Called again if the field's data occurs again
  // (at most 4 times in one tensor, else INVALID_ARGUMENT); the last one wins, as in protobuf.
  virtual bool Begin(int field, const v1::Tensor& header, size_t bytes) = 0;
  // The next `n` bytes of the data begun last.
  virtual void Append(const char* data, size_t n) = 0;
};

// A TensorSink that copies each field's data to the memory `room(field, bytes)` returns (nullptr refuses).
class CopyingSink final : public TensorSink {
 public:
  explicit CopyingSink(std::function<char*(int field, size_t bytes)> room) : room_(std::move(room)) {}
  bool Begin(int field, const v1::Tensor&, size_t bytes) override;
  void Append(const char* data, size_t n) override;

 private:
  std::function<char*(int, size_t)> room_;
  char* at_ = nullptr;
};

// Parses `in` into `message` (cleared first), except that the data of the top-level Tensor fields numbered in
// `fields` goes to `sink` instead of into the message (their shape and dtype stay in the message).
// INVALID_ARGUMENT when the bytes are not a well-formed `message`.
absl::Status DecodeWithTensors(const grpc::ByteBuffer& in, absl::Span<const int> fields, TensorSink* sink,
                               google::protobuf::MessageLite* message);

}  // namespace mha

#endif  // MHA_PROTO_MHA_V1_TENSOR_WIRE_H_
