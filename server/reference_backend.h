// Plain-loop attention with double accumulation: written to be read, and the ground truth every other backend
// and the Python/PyTorch tests are compared against. Single-threaded; stateless, so thread-safe.
#ifndef MHA_SERVER_REFERENCE_BACKEND_H_
#define MHA_SERVER_REFERENCE_BACKEND_H_

#include <string>

#include "server/backend.h"

namespace mha {

class ReferenceBackend final : public Backend {
 public:
  absl::string_view name() const override { return "reference"; }
  std::string device() const override { return "host CPU, scalar loops"; }
  absl::Status ScaledDotProductAttention(const SdpaArgs& args) override;
  absl::Status MultiHeadAttention(const MhaArgs& args) override;
};

}  // namespace mha

#endif  // MHA_SERVER_REFERENCE_BACKEND_H_
