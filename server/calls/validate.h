// Request validation: turns a request into a plan the compute step can run without further checks, or an error
// naming the field with expected vs given values. Runs on the gRPC thread, before anything proportional to the
// request is allocated or decoded: it reads shapes, dtypes, byte counts and the small repeated fields (key_lengths,
// head_mask), and scans each input tensor's bytes once for NaN and inf (CheckFinite). Decoding (and the checks that
// need values, such as the attention mask's) happens on the compute side (execute.h).
#ifndef MHA_SERVER_CALLS_VALIDATE_H_
#define MHA_SERVER_CALLS_VALIDATE_H_

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
#include "server/calls/plan.h"
#include "server/calls/request_reader.h"
#include "server/layers/layer_store.h"
#include "server/transport/shared_memory.h"

namespace mha {

// INVALID_ARGUMENT for a sink_tokens outside [0, 1048576] (0 means 4) or return_row_stats without
// return_head_stats.
absl::StatusOr<StatsRequest> ValidateStats(bool lse, bool head_stats, int32_t sink_tokens, bool row_stats);

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
  // The layer a MultiHeadAttention request names, when its front door resolved it already (KServe's model), so
  // that it is not looked up twice; null: looked up in `layers`.
  std::shared_ptr<const Layer> layer;
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

#endif  // MHA_SERVER_CALLS_VALIDATE_H_
