// The compute step of a call, on the thread that computes it: decodes what validation left encoded (the attention
// mask, checked for NaN and +inf while decoding; inline weights), hands the plan's backend the wire's tensors and
// the response's bytes, and fills the response.
#ifndef MHA_SERVER_CALLS_EXECUTE_H_
#define MHA_SERVER_CALLS_EXECUTE_H_

#include "absl/status/status.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/mha/v1/attention.pb.h"
#include "proto/mha/v1/tensor_wire.h"
#include "server/calls/validate.h"

namespace mha {

// A compute call's response with its tensors' bytes in slices of their own, which the backend writes and gRPC sends
// as they are (proto/mha/v1/tensor_wire.h): no copy of the bytes between the backend and the socket.
template <typename Response>
struct Reply {
  Response message;               // the rest: backend, timing; output and attention_weights stay unset here
  TensorBytes output;             // field 1 of both responses
  TensorBytes attention_weights;  // field 2; field 0 (not sent) unless requested

  // The response's bytes as protobuf would write the whole message.
  absl::Status Encode(grpc::ByteBuffer* out) const {
    const TensorBytes* tensors[] = {&output, &attention_weights};
    return EncodeWithTensors(tensors, message, out);
  }

  // The whole response as one message, the tensors' bytes copied in: for tests and fuzzers.
  Response Assembled() const {
    Response whole = message;
    for (const TensorBytes* tensor : {&output, &attention_weights}) {
      if (tensor->field == 0) continue;
      v1::Tensor* to = tensor->field == 1 ? whole.mutable_output() : whole.mutable_attention_weights();
      *to = tensor->header;
      to->set_data(reinterpret_cast<const char*>(tensor->data.begin()), tensor->data.size());
    }
    return whole;
  }
};
using MhaReply = Reply<v1::MultiHeadAttentionResponse>;
using SdpaReply = Reply<v1::ScaledDotProductAttentionResponse>;

// `plan` must come from validating the request it borrows from. Fills output, attention_weights (when requested)
// and the message's backend; INVALID_ARGUMENT for a mask value that is NaN or +inf, `stop`'s status once it says stop (it may be
// null), the backend's error otherwise.
absl::Status ExecuteMultiHeadAttention(const MhaPlan& plan, const StopSignal* stop,
                                       MhaReply* reply);
// Computes the calls of `plans` (non-empty, all with one batch_key) as one backend call along the batch dimension
// and fills replies[i] as ExecuteMultiHeadAttention would for plans[i] alone. The status applies to every call.
absl::Status ExecuteMultiHeadAttentionBatch(absl::Span<const MhaPlan* const> plans, const StopSignal* stop,
                                            absl::Span<MhaReply* const> replies);
absl::Status ExecuteScaledDotProductAttention(const SdpaPlan& plan, const StopSignal* stop,
                                              SdpaReply* reply);

}  // namespace mha

#endif  // MHA_SERVER_CALLS_EXECUTE_H_
