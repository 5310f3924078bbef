// Reads a compute request from gRPC's bytes with one pass over each activation's data: copied from gRPC's slices
// into the request message, and scanned for inf and NaN piece by piece while the piece is still in cache, so that
// validation need not make a pass of its own over every tensor (a large part of what a large request spends
// outside compute).
#ifndef MHA_SERVER_CALLS_REQUEST_READER_H_
#define MHA_SERVER_CALLS_REQUEST_READER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// What the read found in one tensor of the request it filled.
struct FiniteScan {
  const v1::Tensor* tensor = nullptr;  // the request's tensor
  v1::DataType dtype = v1::DATA_TYPE_UNSPECIFIED;  // as which it was scanned: the scan holds while the tensor has it
  int64_t first_non_finite = -1;       // flat index of the first inf or NaN element; -1 when none
};

// Parses `bytes` into `request`, a MultiHeadAttentionRequest or ScaledDotProductAttentionRequest (their fields 1-3
// are the activations), as protobuf would, and appends to *scans a scan for each activation whose dtype came before
// its data (as protobuf and this project's clients write it) and that it scanned whole. INVALID_ARGUMENT when the
// bytes are not a well-formed request. Allocates no more than the message's size.
absl::Status ReadComputeRequest(const grpc::ByteBuffer& bytes, google::protobuf::Message* request,
                                std::vector<FiniteScan>* scans);

}  // namespace mha

#endif  // MHA_SERVER_CALLS_REQUEST_READER_H_
