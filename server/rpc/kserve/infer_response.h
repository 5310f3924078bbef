// A finished compute call's KServe v2 ModelInferResponse: the outputs' headers as protobuf writes them, then each
// output's bytes as a raw_output_contents entry whose slice is the one the backend wrote (not copied).
#ifndef MHA_SERVER_RPC_KSERVE_INFER_RESPONSE_H_
#define MHA_SERVER_RPC_KSERVE_INFER_RESPONSE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/mha/v1/tensor_wire.h"
#include "server/rpc/kserve/infer_request.h"

namespace mha {

// What a call computed, as the native reply holds it.
struct ComputedOutputs {
  const TensorBytes* output = nullptr;             // field 0 when it went to shared memory: then
  const v1::Tensor* output_in_shared_memory = nullptr;  // its shape, dtype and region (else null)
  const TensorBytes* attention_weights = nullptr;  // field 0 unless requested
  const v1::Tensor* lse = nullptr;                 // [B, H, Tq] when requested
  const v1::HeadStats* head_stats = nullptr;       // B x H values per field when requested
  std::string backend;                             // which backend ran
  const v1::Timing* timing = nullptr;
};

// Writes the response for `outputs` (in that order) into `out`: model_name, model_version "1", the request's id,
// parameters "backend", "queue_us", "compute_us" and "handler_us" (as the native Timing). INTERNAL if a requested
// output was not computed.
absl::Status EncodeInferResponse(const std::string& model, const std::string& id,
                                 absl::Span<const KServeOutput> outputs, const ComputedOutputs& computed,
                                 grpc::ByteBuffer* out);

}  // namespace mha

#endif  // MHA_SERVER_RPC_KSERVE_INFER_RESPONSE_H_
