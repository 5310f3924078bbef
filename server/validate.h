// Request validation: turns a request into a plan the compute step can run without further checks, or an error
// naming the field with expected vs given values. Runs on the gRPC thread, before anything proportional to the
// request is allocated or decoded: it reads shapes, dtypes, byte counts and the small repeated fields (key_lengths,
// head_mask), and scans each input tensor's bytes once for NaN and inf (CheckFinite). Decoding (and the checks that
// need values, such as the attention mask's) happens on the compute side (execute.h).
#ifndef MHA_SERVER_VALIDATE_H_
#define MHA_SERVER_VALIDATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"
#include "server/backends/registry.h"
#include "server/layer_store.h"
#include "server/request_reader.h"
#include "server/shared_memory.h"

namespace mha {

// Everything the compute step needs. Tensor pointers borrow from the request, which must outlive the plan.
// What a request asks of the softmax statistics (attention.proto's return_lse, return_head_stats, sink_tokens and
// return_row_stats).
struct StatsRequest {
  bool lse = false;
  bool head_stats = false;
  bool row_stats = false;
  int64_t sink_tokens = 4;

  bool any() const { return lse || head_stats; }
  // The response bytes they add for `heads` heads of `rows` query rows (one batch item).
  double ResponseBytes(int64_t heads, int64_t rows) const;
  // The per-row values the backend writes for them (StatsBuffers), bytes.
  int64_t WorkspaceBytes(int64_t heads, int64_t rows) const;
};

// INVALID_ARGUMENT for a sink_tokens outside [0, 1048576] (0 means 4) or return_row_stats without
// return_head_stats.
absl::StatusOr<StatsRequest> ValidateStats(bool lse, bool head_stats, int32_t sink_tokens, bool row_stats);

struct AttentionPlan {
  AttentionProblem problem;               // shape, wire and output dtypes, return_weights
  Backend* backend = nullptr;             // chosen, and asked whether it supports `problem`
  const v1::Tensor* attn_mask = nullptr;  // null, or [Tq, Tk] / [B, Tq, Tk]; values checked when decoded
  bool attn_mask_keep = false;            // attn_mask is boolean (MASK_KEEP: 1 attends, 0 masked), not additive
  absl::Span<const int32_t> key_lengths;  // empty or [B], each in [0, Tk]
  std::string shapes;                     // for logs, e.g. "query[8, 512, 512] self layer=demo H=8 Hkv=8"
  double flops = 0;                       // AttentionFlops(problem.shape)
  int64_t response_bytes = 0;             // the response's tensors
  int64_t workspace_bytes = 0;            // backend->WorkspaceBytes(problem)
  // Calls with the same non-empty key compute the same function of each batch item, so that they can run as one
  // backend call along the batch dimension (request batching): same backend, registered layer, sequence lengths,
  // dtypes, causal flag and weights request; self-attention without an attention or head mask, nothing in shared
  // memory. Empty: never batched.
  std::string batch_key;
  StatsRequest stats;

  // Tensors whose bytes lie in shared memory (mha.v1.SharedMemoryRef): the inputs, where the output goes instead of
  // the response (null: into the response), and the regions all of them lie in, held until the plan is gone.
  struct SharedInput {
    const v1::Tensor* tensor = nullptr;
    const char* data = nullptr;
    uint64_t bytes = 0;
    const SharedMemoryRegion* region = nullptr;  // held in `regions`
  };
  std::vector<SharedInput> shared_inputs;
  char* output_to = nullptr;
  const v1::SharedMemoryRef* output_ref = nullptr;  // the request's, when output_to is set
  std::vector<std::shared_ptr<const SharedMemoryRegion>> regions;

  // An input tensor's bytes: its shared memory, else its data.
  const char* Data(const v1::Tensor& tensor) const {
    for (const SharedInput& input : shared_inputs) {
      if (input.tensor == &tensor) return input.data;
    }
    return tensor.data().data();
  }
  // FAILED_PRECONDITION when a region the call uses shrank (SharedMemoryRegion::Intact).
  absl::Status RegionsIntact() const {
    for (const auto& region : regions) {
      if (absl::Status intact = region->Intact(); !intact.ok()) return intact;
    }
    return absl::OkStatus();
  }
};

struct MhaPlan : AttentionPlan {
  // The weights: a registered layer, or inline weights whose shapes were checked and that the compute step decodes.
  std::shared_ptr<const Layer> layer;
  const v1::AttentionWeights* inline_weights = nullptr;
  LayerShape inline_shape;
  const v1::Tensor* query = nullptr;  // [B, Tq, d_model]
  const v1::Tensor* key = nullptr;    // [B, Tk, d_kv_in]; the query for KvSource::kQuery
  const v1::Tensor* value = nullptr;  // [B, Tk, d_v_in]; the key (or query) when absent
  KvSource kv_source = KvSource::kKeyValue;
  absl::Span<const float> head_mask;  // empty or [H], finite
};

struct SdpaPlan : AttentionPlan {
  const v1::Tensor* q = nullptr;  // [B, Tq, H, d_k]
  const v1::Tensor* k = nullptr;  // [B, Tk, Hkv, d_k]
  const v1::Tensor* v = nullptr;  // [B, Tk, Hkv, d_k]
};

struct ValidationContext {
  const LayerStore* layers = nullptr;
  const BackendRegistry* backends = nullptr;
  int64_t max_message_bytes = 0;  // responses larger than this are RESOURCE_EXHAUSTED
  int64_t max_scratch_bytes = 0;  // backend working memory (Backend::WorkspaceBytes) beyond this: RESOURCE_EXHAUSTED
  double max_request_flops = 0;   // AttentionFlops beyond this: RESOURCE_EXHAUSTED
  double max_reference_flops = 0;  // the same on the reference backend
  // Inputs already scanned for inf and NaN while they were read (ReadComputeRequest); the rest are scanned here.
  absl::Span<const FiniteScan> finite_scans;
  // Where SharedMemoryRef names resolve; null: shared memory is off.
  const SharedMemoryRegistry* shared_memory = nullptr;
};

// The backend a request's `backend` field (a v1::Backend value) names, if `supports` accepts it; BACKEND_AUTO falls
// back to the CPU for what the default backend does not support. INVALID_ARGUMENT for a value outside the enum,
// UNIMPLEMENTED (with the backend's reason) for what it cannot compute, Find's errors otherwise.
absl::StatusOr<Backend*> ChooseBackend(int requested, const ValidationContext& context,
                                       absl::FunctionRef<absl::Status(const Backend&)> supports);
// RESOURCE_EXHAUSTED when plan.flops or plan.workspace_bytes pass the server's limits for plan.backend.
absl::Status CheckWorkLimits(const AttentionPlan& plan, const ValidationContext& context);

absl::StatusOr<MhaPlan> ValidateMultiHeadAttention(const v1::MultiHeadAttentionRequest& request,
                                                   const ValidationContext& context);
absl::StatusOr<SdpaPlan> ValidateScaledDotProductAttention(const v1::ScaledDotProductAttentionRequest& request,
                                                           const ValidationContext& context);

}  // namespace mha

#endif  // MHA_SERVER_VALIDATE_H_
