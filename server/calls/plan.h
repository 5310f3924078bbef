// The plan of a validated call: what the compute step runs without further checks (the problem, the chosen
// backend, the tensors it borrows from the request, the costs the scheduler weighs), and the softmax statistics it
// asks for. Made by validation (validate.h), queued by the scheduler (server/scheduling), run by execute.h.
#ifndef MHA_SERVER_CALLS_PLAN_H_
#define MHA_SERVER_CALLS_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"
#include "server/layers/layer.h"
#include "server/transport/shared_memory.h"

namespace mha {

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

// Everything the compute step needs. Tensor pointers borrow from the request, which must outlive the plan.
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

}  // namespace mha

#endif  // MHA_SERVER_CALLS_PLAN_H_
