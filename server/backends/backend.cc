#include "server/backends/backend.h"

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {

int64_t KvCacheLayout::BlockBytes() const { return BlockElements() * static_cast<int64_t>(DTypeSize(dtype)); }

absl::Status Backend::SupportsPaged(const PagedProblem&) const {
  return absl::UnimplementedError(absl::StrCat("sessions (paged attention over a KV cache) are not implemented on "
                                               "the ", name(), " backend"));
}

absl::Status Backend::PagedAttention(const PagedArgs& args) { return SupportsPaged(args.problem); }

}  // namespace mha
