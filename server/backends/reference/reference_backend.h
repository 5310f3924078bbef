// Plain-loop attention with double accumulation: written to be read, and the ground truth every other backend
// and the Python/PyTorch tests are compared against. Single-threaded; stateless, so thread-safe.
#ifndef MHA_SERVER_BACKENDS_REFERENCE_REFERENCE_BACKEND_H_
#define MHA_SERVER_BACKENDS_REFERENCE_REFERENCE_BACKEND_H_

#include <string>

#include "server/backends/backend.h"

namespace mha {

class ReferenceBackend final : public Backend {
 public:
  absl::string_view name() const override { return kReferenceBackend; }
  std::string device() const override { return "host CPU, scalar loops"; }
  // Every shape, dtype and option: it is the ground truth.
  absl::Status Supports(const AttentionProblem& problem) const override { return absl::OkStatus(); }
  // Double copies of the inputs, projections and head outputs.
  int64_t WorkspaceBytes(const AttentionProblem& problem) const override;
  // A 16-token layer of width 64 (about 1 MFLOP).
  absl::StatusOr<double> WarmUp() override;
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;
  // Sessions: each sequence's whole cache decoded to double, then the stateless causal computation above.
  absl::Status SupportsPaged(const PagedProblem& problem) const override { return absl::OkStatus(); }
  int64_t PagedWorkspaceBytes(const PagedProblem& problem) const override;
  absl::Status PagedAttention(const PagedArgs& args) override;
};

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_REFERENCE_REFERENCE_BACKEND_H_
