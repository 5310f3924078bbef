// ReadComputeRequest (server/calls/request_reader.h, over proto/mha/v1/tensor_wire.h's decoder) against protobuf's own
// parser on arbitrary bytes. The first byte picks the message (high bit: ScaledDotProductAttentionRequest, else
// MultiHeadAttentionRequest) and the size of the slices the rest is cut into (1 + its low six bits). Checks:
// - whatever the reader accepts, protobuf accepts, and the messages are equal;
// - whatever protobuf accepts, the reader accepts, except groups (wire types 3 and 4), which this API refuses;
// - every scan it returns names the first inf or NaN a full scan of the final tensor finds.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "grpc/grpc.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/calls/request_reader.h"

namespace v1 = mha::v1;

namespace {

void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_request_reader: %s %s\n", what, detail.c_str());
  std::abort();
}

template <typename Request>
void Check(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) slices.emplace_back(bytes.substr(at, piece));
  const grpc::ByteBuffer buffer(slices.data(), slices.size());
  Request protobuf, read;
  const bool protobuf_ok = protobuf.ParseFromString(bytes);
  std::vector<mha::FiniteScan> scans;
  const absl::Status status = mha::ReadComputeRequest(buffer, &read, &scans);
  if (status.ok() && !protobuf_ok) Fail("read what protobuf refuses", "");
  if (!status.ok()) {
    if (status.code() != absl::StatusCode::kInvalidArgument) Fail("not INVALID_ARGUMENT:", status.ToString());
    const bool group = status.message().find("wire type 3") != absl::string_view::npos ||
                       status.message().find("wire type 4") != absl::string_view::npos;
    if (protobuf_ok && !group) Fail("refused what protobuf reads:", status.ToString());
    return;
  }
  if (read.SerializeAsString() != protobuf.SerializeAsString()) Fail("a message other than protobuf's", "");
  for (const mha::FiniteScan& scan : scans) {
    const v1::Tensor& t = *scan.tensor;
    if (t.dtype() != scan.dtype) Fail("a scan as another dtype", "");
    const size_t size = mha::DTypeSize(t.dtype());
    const int64_t first = mha::FirstNonFinite(t.dtype(), t.data().data(), t.data().size() / size);
    if (first != scan.first_non_finite) {
      Fail("a scan that disagrees with a full one:",
           std::to_string(scan.first_non_finite) + " against " + std::to_string(first));
    }
  }
}

}  // namespace

// gRPC's slices need the library initialised; protobuf's log line for every invalid UTF-8 string is noise here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = 1 + (data[0] & 63);
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 0x80) {
    Check<v1::ScaledDotProductAttentionRequest>(bytes, piece);
  } else {
    Check<v1::MultiHeadAttentionRequest>(bytes, piece);
  }
  return 0;
}
