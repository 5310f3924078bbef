// How the load generator puts its MultiHeadAttention request on the wire and reads each answer: through the native
// front door (mha.v1.Attention) or through the KServe v2 one (inference.GRPCInferenceService's ModelInfer, the same
// call as Triton's clients make it), so that `mha_client bench --protocol` measures the two side by side.
#ifndef MHA_CLIENT_BENCH_WIRE_H_
#define MHA_CLIENT_BENCH_WIRE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

enum class BenchProtocol { kNative, kKServe };

// The server's timings of one call, microseconds.
struct ServerTimes {
  int64_t queue_us = 0, compute_us = 0, handler_us = 0;
};

// Thread-safe: calls encode and decode concurrently.
class BenchWire {
 public:
  virtual ~BenchWire() = default;
  virtual const char* method() const = 0;  // the gRPC method path
  // The request's bytes, its tensors' bytes sent from where the request holds them (not copied).
  virtual absl::Status Encode(grpc::ByteBuffer* out) const = 0;
  // Reads a response as a client would, copying its tensors out once; INTERNAL when it does not decode.
  virtual absl::StatusOr<ServerTimes> Decode(const grpc::ByteBuffer& response) = 0;
};

// `request` must outlive the wire. kKServe needs a request on a registered layer (the model of its name) with its
// tensors in the message: INVALID_ARGUMENT otherwise.
absl::StatusOr<std::unique_ptr<BenchWire>> MakeBenchWire(BenchProtocol protocol,
                                                         const v1::MultiHeadAttentionRequest& request);

}  // namespace mha

#endif  // MHA_CLIENT_BENCH_WIRE_H_
