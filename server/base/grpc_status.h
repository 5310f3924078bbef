// The one conversion from absl::Status (what every part of the server returns) to grpc::Status (what a client
// receives): the front doors (server/rpc) end every call through it, and so does the transport's token gate.
#ifndef MHA_SERVER_BASE_GRPC_STATUS_H_
#define MHA_SERVER_BASE_GRPC_STATUS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace mha {

// A message over kMaxStatusMessageBytes is cut (it travels as a trailer, which clients refuse over 8 KiB), at a
// UTF-8 character boundary, ending "... (N more bytes)". The code keeps its number: absl's and gRPC's both follow
// google.rpc.Code.
inline constexpr size_t kMaxStatusMessageBytes = 2048;
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace mha

#endif  // MHA_SERVER_BASE_GRPC_STATUS_H_
