#include "proto/mha/v1/tensor_wire.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace mha {
namespace {

// Protobuf's wire types (https://protobuf.dev/programming-guides/encoding/).
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kStartGroup = 3, kEndGroup = 4, kFixed32 = 5;
constexpr int kMaxGroupDepth = 100;  // protobuf's default recursion limit
constexpr int kTensorDataField = 3;  // mha.v1.Tensor.data
// How often one tensor's data field may occur (protobuf lets the last win; its writers put it once). Each occurrence
// parses the header read so far, so without a bound a large header followed by millions of empty data fields would
// hold a handler for hours.
constexpr int kMaxDataOccurrences = 4;

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

  // A varint of at most `max_bytes` bytes, bits past 64 dropped (as protobuf reads values).
  bool ReadVarint(uint64_t* value, int max_bytes = 10) {
    *value = 0;
    for (int i = 0; i < max_bytes; ++i) {
      if (remaining_ == 0) return false;
      const uint8_t byte = slices_[slice_].begin()[offset_];
      Advance(1);
      if (i < 10) *value |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // A tag as protobuf reads one: at most five bytes, kept to 32 bits.
  bool ReadTag(uint32_t* tag) {
    uint64_t value;
    if (!ReadVarint(&value, 5)) return false;
    *tag = static_cast<uint32_t>(value);
    return true;
  }

  // A length as protobuf reads one: at most five bytes, below 2 GiB.
  bool ReadLength(uint64_t* length) { return ReadVarint(length, 5) && *length < (uint64_t{1} << 31); }

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

  // Hands the next `n` bytes to `sink` piece by piece, as they lie in the slices; false if fewer remain.
  bool Stream(size_t n, TensorSink* sink) {
    if (n > remaining_) return false;
    while (n > 0) {
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min(n, slice.size() - offset_);
      sink->Append(reinterpret_cast<const char*>(slice.begin() + offset_), take);
      Advance(take);
      n -= take;
    }
    return true;
  }

  // The next `n` bytes as references to the slices they lie in (no copy); false if fewer remain.
  bool Share(size_t n, std::vector<grpc::Slice>* out) {
    if (n > remaining_) return false;
    while (n > 0) {
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min(n, slice.size() - offset_);
      out->push_back(slice.sub(offset_, offset_ + take));
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

// Fields at least this long are passed on as references to gRPC's slices rather than copied.
constexpr uint64_t kShareBytes = 4096;

// The message re-encoded without the chosen tensors' data: small parts written out, long fields as references to
// the input's slices, so that what the decode leaves to protobuf costs one copy, as protobuf's own parse would.
class Rest {
 public:
  std::string* text() { return &pending_; }
  size_t size() const { return flushed_ + pending_.size(); }

  bool Share(SliceReader* reader, size_t n) {
    Flush();
    flushed_ += n;
    return reader->Share(n, &slices_);
  }

  void Append(Rest&& other) {
    Flush();
    other.Flush();
    for (grpc::Slice& slice : other.slices_) slices_.push_back(std::move(slice));
    flushed_ += other.flushed_;
  }

  std::string Flatten() {
    Flush();
    std::string out;
    for (const grpc::Slice& slice : slices_) out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    return out;
  }

  bool ParseInto(google::protobuf::MessageLite* message) {
    Flush();
    message->Clear();
    if (slices_.empty()) return true;
    grpc::ByteBuffer buffer(slices_.data(), slices_.size());
    grpc::ProtoBufferReader stream(&buffer);
    return message->ParseFromZeroCopyStream(&stream);
  }

 private:
  void Flush() {
    if (pending_.empty()) return;
    flushed_ += pending_.size();
    slices_.emplace_back(pending_);
    pending_.clear();
  }

  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t flushed_ = 0;  // bytes in slices_
};

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what));
}

bool ReadTag(SliceReader* reader, size_t end_remaining, int* field, int* wire_type, absl::Status* status);

// Copies one field, whose tag has been read, into `out` as protobuf would write it. The enclosing message ends
// where `end` bytes of `reader` remain (0 at the top level). A group (no field of this API is one, but protobuf
// keeps unknown ones) is copied through its end, within `depth` groups already open.
absl::Status CopyField(int field, int wire_type, size_t end, SliceReader* reader, Rest* rest, int depth = 0) {
  std::string* out = rest->text();
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
      if (!reader->ReadLength(&size) || reader->remaining() < end) return Malformed("truncated length");
      if (size > left()) return Malformed("a length past the end");
      AppendVarint(size, out);
      const bool read = size >= kShareBytes ? rest->Share(reader, size) : reader->Append(size, out);
      return read ? absl::OkStatus() : Malformed("truncated field");
    }
    case kStartGroup: {
      if (depth >= kMaxGroupDepth) return Malformed("groups nested too deep");
      int inner, inner_type;
      absl::Status status;
      while (ReadTag(reader, end, &inner, &inner_type, &status)) {
        if (inner_type == kEndGroup) {
          if (inner != field) return Malformed("a group ends with another field's number");
          AppendTag(field, kEndGroup, rest->text());  // the text after any bytes shared meanwhile
          return absl::OkStatus();
        }
        if (absl::Status copied = CopyField(inner, inner_type, end, reader, rest, depth + 1); !copied.ok()) {
          return copied;
        }
      }
      return status.ok() ? Malformed("a group without its end") : status;
    }
    default:
      return Malformed(absl::StrCat("field ", field, " has wire type ", wire_type, ", which protobuf never writes"));
  }
}

// Reads a tag; false at the end of the input or on a malformed one (then *status says so).
bool ReadTag(SliceReader* reader, size_t end_remaining, int* field, int* wire_type, absl::Status* status) {
  if (reader->remaining() <= end_remaining) return false;
  uint32_t tag;
  if (!reader->ReadTag(&tag) || tag >> 3 == 0) {
    *status = Malformed("bad tag");
    return false;
  }
  *field = static_cast<int>(tag >> 3);
  *wire_type = static_cast<int>(tag & 7);
  return true;
}

// The body of a Tensor field `field` (its length read: `size` bytes follow), with its data sent to `sink` and the
// rest re-encoded into *header.
absl::Status SplitTensor(int field, size_t size, TensorSink* sink, SliceReader* reader, Rest* header) {
  if (size > reader->remaining()) return Malformed("a length past the end");
  const size_t end = reader->remaining() - size;
  int sub_field, wire_type, occurrences = 0;
  absl::Status status;
  while (ReadTag(reader, end, &sub_field, &wire_type, &status)) {
    if (reader->remaining() < end) return Malformed("a tensor's field crosses its end");
    if (sub_field == kTensorDataField && wire_type == kLengthDelimited) {
      if (++occurrences > kMaxDataOccurrences) {
        return absl::InvalidArgumentError(
            absl::StrCat("field ", field, "'s data occurs more than ", kMaxDataOccurrences, " times in its tensor"));
      }
      uint64_t bytes;
      if (!reader->ReadLength(&bytes)) return Malformed("truncated length");
      if (reader->remaining() < end || bytes > reader->remaining() - end) return Malformed("a length past the end");
      v1::Tensor so_far;
      if (!so_far.ParseFromString(header->Flatten())) so_far.Clear();  // malformed: the message's parse says so
      if (!sink->Begin(field, so_far, bytes)) {
        return absl::InvalidArgumentError(absl::StrCat("field ", field, "'s data (", bytes, " bytes) is refused"));
      }
      reader->Stream(bytes, sink);
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

grpc::Slice SliceKeeping(grpc::Slice slice, std::shared_ptr<const void> keep) {
  struct Kept {
    grpc::Slice slice;
    std::shared_ptr<const void> keep;
    // Made on this thread, deleted on whichever drops gRPC's last reference (a client's, over an in-process
    // channel): gRPC's core orders the two through code ThreadSanitizer cannot see; this states the order in code
    // it can.
    std::atomic<bool> made{false};
  };
  auto* kept = new Kept{std::move(slice), std::move(keep)};
  kept->made.store(true, std::memory_order_release);
  const grpc_slice raw = grpc_slice_new_with_user_data(
      const_cast<uint8_t*>(kept->slice.begin()), kept->slice.size(),
      [](void* user_data) {
        auto* kept = static_cast<Kept*>(user_data);
        kept->made.load(std::memory_order_acquire);
        delete kept;
      },
      kept);
  return grpc::Slice(raw, grpc::Slice::STEAL_REF);
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

void AppendBytesField(int field, const grpc::Slice& data, std::vector<grpc::Slice>* slices) {
  std::string prefix;
  AppendTag(field, kLengthDelimited, &prefix);
  AppendVarint(data.size(), &prefix);
  slices->emplace_back(prefix);
  if (data.size() > 0) slices->push_back(data);
}

bool CopyingSink::Begin(int field, const v1::Tensor&, size_t bytes) {
  at_ = room_(field, bytes);
  return at_ != nullptr || bytes == 0;
}

void CopyingSink::Append(const char* data, size_t n) {
  std::memcpy(at_, data, n);
  at_ += n;
}

absl::Status DecodeWithTensors(const grpc::ByteBuffer& in, absl::Span<const int> fields, TensorSink* sink,
                               google::protobuf::MessageLite* message) {
  SliceReader reader(in);
  Rest rest;
  int field, wire_type;
  absl::Status status;
  while (ReadTag(&reader, 0, &field, &wire_type, &status)) {
    const bool tensor = wire_type == kLengthDelimited && std::find(fields.begin(), fields.end(), field) != fields.end();
    if (!tensor) {
      if (absl::Status copied = CopyField(field, wire_type, 0, &reader, &rest); !copied.ok()) return copied;
      continue;
    }
    uint64_t size;
    if (!reader.ReadLength(&size)) return Malformed("truncated length");
    Rest header;
    if (absl::Status split = SplitTensor(field, size, sink, &reader, &header); !split.ok()) return split;
    AppendTag(field, kLengthDelimited, rest.text());
    AppendVarint(header.size(), rest.text());
    rest.Append(std::move(header));
  }
  if (!status.ok()) return status;
  if (!rest.ParseInto(message)) return Malformed("its fields do not parse");
  return absl::OkStatus();
}

}  // namespace mha
