// Which sequences of one paged call read the same leading blocks: forks, or sessions that attached one prompt's
// blocks by prefix key (the session store hands them the same block addresses). The backends' cascade decode reads
// those blocks once for all of them (cpu/paged_cascade.h, cuda/paged_plan.h).
#ifndef MHA_SERVER_BACKENDS_SHARED_PREFIX_H_
#define MHA_SERVER_BACKENDS_SHARED_PREFIX_H_

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"

namespace mha {

// Sequences (indices into the call's, in order) whose first `blocks` blocks are the same addresses.
struct CommonPrefix {
  std::vector<int64_t> members;
  int64_t blocks = 0;
};

// Among the sequences `eligible` accepts that hold at least one full block, those whose first block is the same
// (at least two), each set with the number of leading blocks that are full in every member and the same in all: every
// query row of every member (append or not) sees all of their keys.
std::vector<CommonPrefix> FindCommonPrefixes(absl::Span<const PagedSequence> sequences, int64_t block_tokens,
                                             absl::FunctionRef<bool(const PagedSequence&)> eligible);

}  // namespace mha

#endif  // MHA_SERVER_BACKENDS_SHARED_PREFIX_H_
