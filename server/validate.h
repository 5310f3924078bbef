// Request validation: turns a request into a plan the compute step can run without further checks, or an error
// naming the field with expected vs given values. Runs before any allocation proportional to the request, on
// the gRPC thread (it is O(size of the masks) at most).
#ifndef MHA_SERVER_VALIDATE_H_
#define MHA_SERVER_VALIDATE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backend.h"
#include "server/backend_registry.h"
#include "server/layer_store.h"

namespace mha {

// Everything the compute step needs. Tensor pointers borrow from the request, which must outlive the plan.
struct AttentionPlan {
  AttentionDims dims;
  Backend* backend = nullptr;
  const v1::Tensor* attn_mask = nullptr;  // null, or [Tq, Tk] / [B, Tq, Tk]
  bool mask_per_batch = false;
  absl::Span<const int32_t> key_lengths;  // empty or [B]
  bool return_weights = false;
  v1::DataType output_dtype = v1::FP32;
  std::string shapes;  // for logs, e.g. "q[8, 512, 512] k=q"
  double flops = 0;    // projections + attention, as counted against max_request_flops
};

struct MhaPlan : AttentionPlan {
  std::shared_ptr<const Layer> layer;  // named, or built from the inline weights
  const v1::Tensor* query = nullptr;   // [B, Tq, d_model]
  const v1::Tensor* key = nullptr;     // [B, Tk, d_kv_in]; the query tensor for self-attention
  const v1::Tensor* value = nullptr;   // [B, Tk, d_v_in]
  bool self_attention = false;
  absl::Span<const float> head_mask;  // empty or [H]
};

struct SdpaPlan : AttentionPlan {
  const v1::Tensor* q = nullptr;  // [B, Tq, H, d_k]
  const v1::Tensor* k = nullptr;  // [B, Tk, Hkv, d_k]
  const v1::Tensor* v = nullptr;  // [B, Tk, Hkv, d_k]
};

struct ValidationContext {
  const LayerStore* layers = nullptr;
  const BackendRegistry* backends = nullptr;
  std::string default_backend;    // what BACKEND_AUTO resolves to
  int64_t max_message_bytes = 0;  // responses larger than this are RESOURCE_EXHAUSTED
  int64_t max_scratch_bytes = 0;  // projection working memory beyond this is RESOURCE_EXHAUSTED
  double max_request_flops = 0;   // projections + attention (4 B H Tq Tk d_k) beyond this: RESOURCE_EXHAUSTED
};

absl::StatusOr<MhaPlan> ValidateMultiHeadAttention(const v1::MultiHeadAttentionRequest& request,
                                                   const ValidationContext& context);
absl::StatusOr<SdpaPlan> ValidateScaledDotProductAttention(const v1::ScaledDotProductAttentionRequest& request,
                                                           const ValidationContext& context);

}  // namespace mha

#endif  // MHA_SERVER_VALIDATE_H_
