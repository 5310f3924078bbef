#include "server/backends/shared_prefix.h"

#include <algorithm>
#include <map>

namespace mha {

std::vector<CommonPrefix> FindCommonPrefixes(absl::Span<const PagedSequence> sequences, int64_t block_tokens,
                                             absl::FunctionRef<bool(const PagedSequence&)> eligible) {
  std::vector<CommonPrefix> found;
  if (block_tokens <= 0) return found;
  // By first block: sequences that share any block share their first (a prefix is shared from its start). Blocks
  // below length / block_tokens are full.
  std::map<const char*, std::vector<int64_t>> by_first;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
    const int64_t full = seq.length / block_tokens;
    if (full >= 1 && static_cast<int64_t>(seq.blocks.size()) >= full && eligible(seq)) {
      by_first[seq.blocks[0]].push_back(static_cast<int64_t>(s));
    }
  }
  for (auto& [first, ids] : by_first) {
    if (ids.size() < 2) continue;
    const PagedSequence& lead = sequences[ids[0]];
    int64_t blocks = lead.length / block_tokens;
    for (int64_t s : ids) {
      const PagedSequence& seq = sequences[s];
      int64_t common = 0;
      const int64_t most = std::min(blocks, seq.length / block_tokens);
      while (common < most && seq.blocks[common] == lead.blocks[common]) ++common;
      blocks = common;
    }
    found.push_back({std::move(ids), blocks});
  }
  return found;
}

}  // namespace mha
