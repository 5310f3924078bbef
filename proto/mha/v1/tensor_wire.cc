#include "proto/mha/v1/tensor_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mha {
namespace {

// Protobuf's wire types (https://protobuf.dev/programming-guides/encoding/).
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr int kTensorDataField = 3;  // mha.v1.Tensor.data

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void AppendTag(int field, int wire_type, std::string* out) {
  AppendVarint(static_cast<uint64_t>(field) << 3 | wire_type, out);
}

void FreeSlice(void* data) { std::free(data); }

// Reads a byte buffer's slices front to back without joining them.
class SliceReader {
 public:
  explicit SliceReader(const grpc::ByteBuffer& in) {
    // Dump takes references to the slices; it fails only for a buffer that was never filled.
    if (in.Valid()) (void)in.Dump(&slices_);
    for (const grpc::Slice& slice : slices_) remaining_ += slice.size();
    Settle();
  }

  size_t remaining() const { return remaining_; }

  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (remaining_ == 0) return false;
      const uint8_t byte = slices_[slice_].begin()[offset_];
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than ten bytes
  }

  // Copies the next `n` bytes to `out` (or skips them when out is null); false if fewer remain.
  bool Read(size_t n, char* out) {
    if (n > remaining_) return false;
    while (n > 0) {
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min(n, slice.size() - offset_);
      if (out != nullptr) {
        std::memcpy(out, slice.begin() + offset_, take);
        out += take;
      }
      Advance(take);
      n -= take;
    }
    return true;
  }

  bool Append(size_t n, std::string* out) {
    if (n > remaining_) return false;
    const size_t at = out->size();
    out->resize(at + n);
    return Read(n, &(*out)[at]);
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
    Settle();
  }

  // Steps past exhausted (and empty) slices.
  void Settle() {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t remaining_ = 0;
};

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what));
}

// Copies one field, whose tag has been read, into `out` as protobuf would write it. The enclosing message ends
// where `end` bytes of `reader` remain (0 at the top level).
absl::Status CopyField(int field, int wire_type, size_t end, SliceReader* reader, std::string* out) {
  AppendTag(field, wire_type, out);
  const auto left = [&] { return reader->remaining() < end ? 0 : reader->remaining() - end; };
  switch (wire_type) {
    case kVarint: {
      uint64_t value;
      if (!reader->ReadVarint(&value) || reader->remaining() < end) return Malformed("truncated varint");
      AppendVarint(value, out);
      return absl::OkStatus();
    }
    case kFixed64:
      return left() >= 8 && reader->Append(8, out) ? absl::OkStatus() : Malformed("truncated fixed64");
    case kFixed32:
      return left() >= 4 && reader->Append(4, out) ? absl::OkStatus() : Malformed("truncated fixed32");
    case kLengthDelimited: {
      uint64_t size;
      if (!reader->ReadVarint(&size) || reader->remaining() < end) return Malformed("truncated length");
      if (size > left()) return Malformed("a length past the end");
      AppendVarint(size, out);
      return reader->Append(size, out) ? absl::OkStatus() : Malformed("truncated field");
    }
    default:
      return Malformed(absl::StrCat("field ", field, " has wire type ", wire_type, ", which this API never uses"));
  }
}

// Reads a tag; false at the end of the input or on a malformed one (then *status says so).
bool ReadTag(SliceReader* reader, size_t end_remaining, int* field, int* wire_type, absl::Status* status) {
  if (reader->remaining() <= end_remaining) return false;
  uint64_t tag;
  if (!reader->ReadVarint(&tag) || tag >> 3 == 0 || tag >> 3 > 536870911) {
    *status = Malformed("bad tag");
    return false;
  }
  *field = static_cast<int>(tag >> 3);
  *wire_type = static_cast<int>(tag & 7);
  return true;
}

// The body of a Tensor field `field` (its length read: `size` bytes follow), with its data sent to `sink` and the
// rest re-encoded into *header.
absl::Status SplitTensor(int field, size_t size, TensorSink sink, SliceReader* reader, std::string* header) {
  if (size > reader->remaining()) return Malformed("a length past the end");
  const size_t end = reader->remaining() - size;
  int sub_field, wire_type;
  absl::Status status;
  while (ReadTag(reader, end, &sub_field, &wire_type, &status)) {
    if (reader->remaining() < end) return Malformed("a tensor's field crosses its end");
    if (sub_field == kTensorDataField && wire_type == kLengthDelimited) {
      uint64_t bytes;
      if (!reader->ReadVarint(&bytes)) return Malformed("truncated length");
      if (reader->remaining() < end || bytes > reader->remaining() - end) return Malformed("a length past the end");
      char* to = sink(field, bytes);
      if (to == nullptr && bytes > 0) {
        return absl::InvalidArgumentError(absl::StrCat("field ", field, "'s data (", bytes, " bytes) is refused"));
      }
      reader->Read(bytes, to);
      continue;
    }
    if (absl::Status copied = CopyField(sub_field, wire_type, end, reader, header); !copied.ok()) return copied;
  }
  if (!status.ok()) return status;
  if (reader->remaining() != end) return Malformed("a tensor's field crosses its end");
  return absl::OkStatus();
}

}  // namespace

grpc::Slice NewTensorSlice(size_t bytes, char** data) {
  void* memory = std::calloc(std::max<size_t>(bytes, 1), 1);
  if (memory == nullptr) throw std::bad_alloc();
  *data = static_cast<char*>(memory);
  return grpc::Slice(memory, bytes, &FreeSlice);
}

grpc::Slice BorrowedSlice(const void* data, size_t bytes) {
  return grpc::Slice(data, bytes, grpc::Slice::STATIC_SLICE);
}

absl::Status EncodeWithTensors(absl::Span<const TensorBytes* const> tensors, const google::protobuf::MessageLite& rest,
                               grpc::ByteBuffer* out) {
  std::vector<grpc::Slice> slices;
  for (const TensorBytes* tensor : tensors) {
    if (tensor->field == 0) continue;
    if (!tensor->header.data().empty()) return absl::InvalidArgumentError("a tensor header carries data");
    std::string body = tensor->header.SerializeAsString();
    const size_t bytes = tensor->data.size();
    if (bytes > 0) {  // proto3 leaves empty bytes out
      AppendTag(kTensorDataField, kLengthDelimited, &body);
      AppendVarint(bytes, &body);
    }
    std::string prefix;
    AppendTag(tensor->field, kLengthDelimited, &prefix);
    AppendVarint(body.size() + bytes, &prefix);
    prefix += body;
    slices.emplace_back(prefix);
    if (bytes > 0) slices.push_back(tensor->data);
  }
  std::string tail;
  if (!rest.SerializeToString(&tail)) return absl::InvalidArgumentError("the message does not serialize");
  if (!tail.empty()) slices.emplace_back(tail);
  grpc::ByteBuffer encoded(slices.data(), slices.size());
  out->Swap(&encoded);
  return absl::OkStatus();
}

absl::Status DecodeWithTensors(const grpc::ByteBuffer& in, absl::Span<const int> fields, TensorSink sink,
                               google::protobuf::MessageLite* message) {
  SliceReader reader(in);
  std::string rest;
  int field, wire_type;
  absl::Status status;
  while (ReadTag(&reader, 0, &field, &wire_type, &status)) {
    const bool tensor = wire_type == kLengthDelimited && std::find(fields.begin(), fields.end(), field) != fields.end();
    if (!tensor) {
      if (absl::Status copied = CopyField(field, wire_type, 0, &reader, &rest); !copied.ok()) return copied;
      continue;
    }
    uint64_t size;
    if (!reader.ReadVarint(&size)) return Malformed("truncated length");
    std::string header;
    if (absl::Status split = SplitTensor(field, size, sink, &reader, &header); !split.ok()) return split;
    AppendTag(field, kLengthDelimited, &rest);
    AppendVarint(header.size(), &rest);
    rest += header;
  }
  if (!status.ok()) return status;
  message->Clear();
  if (!message->ParseFromString(rest)) return Malformed("its fields do not parse");
  return absl::OkStatus();
}

}  // namespace mha
