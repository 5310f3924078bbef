#include "server/backends/cuda/paged_plan.h"

#include <algorithm>

#include "server/backends/shared_prefix.h"

namespace mha {
namespace cuda {
namespace {

// The cascade groups among `sequences` (PlanPaged says which) and their shared units, added to `plan`.
void AddSharedUnits(const PagedProblem& problem, absl::Span<const PagedSequence> sequences, PagedPlan* plan) {
  const HeadSpec& h = problem.heads;
  const int64_t tb = problem.cache.block_tokens, group = h.group_size();
  const int64_t members_per_unit = PagedRowsPerUnit(h.head_dim) / group;
  plan->shared_keys.assign(sequences.size(), 0);
  if (members_per_unit < 2) return;
  const auto decoding = [](const PagedSequence& seq) { return seq.new_tokens == 1; };
  for (const CommonPrefix& common : FindCommonPrefixes(sequences, tb, decoding)) {
    const std::vector<int64_t>& ids = common.members;
    const int64_t blocks = common.blocks;
    const int32_t member0 = static_cast<int32_t>(plan->cascade.size());
    for (int64_t s : ids) {
      plan->cascade.push_back(static_cast<int32_t>(s));
      plan->shared_keys[s] = blocks * tb;
    }
    for (int64_t g = 0; g < h.num_kv_heads; ++g) {
      for (int64_t m = 0; m < static_cast<int64_t>(ids.size()); m += members_per_unit) {
        PagedUnit u;
        u.kv_head = static_cast<int32_t>(g);
        u.head0 = static_cast<int32_t>(g * group);
        u.heads = static_cast<int32_t>(group);
        u.member0 = static_cast<int32_t>(member0 + m);
        u.members = static_cast<int32_t>(std::min<int64_t>(members_per_unit, static_cast<int64_t>(ids.size()) - m));
        plan->units.push_back(u);
      }
    }
  }
}

}  // namespace

bool TakesDensePath(const PagedProblem& problem, const PagedSequence& seq) {
  const int64_t dk = problem.heads.head_dim;
  return seq.new_tokens >= kDenseMinTokens && seq.Keys() > 0 && problem.cache.dtype != v1::FP32 &&
         (dk == 64 || dk == 128) && !problem.return_weights;
}

PagedPlan PlanPaged(const PagedProblem& problem, absl::Span<const PagedSequence> sequences, int multiprocessors) {
  const HeadSpec& h = problem.heads;
  const int64_t rows_per_unit = PagedRowsPerUnit(h.head_dim), group = h.group_size();
  const int64_t unit_heads = std::min(group, rows_per_unit), unit_tokens = std::max<int64_t>(1, rows_per_unit / group);
  PagedPlan plan;
  int64_t max_keys = 0;
  plan.dense.assign(sequences.size(), false);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const PagedSequence& seq = sequences[s];
    const int64_t keys = seq.Keys();
    plan.rows += seq.new_tokens;
    if (problem.return_weights) plan.weights_elements += h.num_heads * seq.new_tokens * keys;
    if (TakesDensePath(problem, seq)) {
      plan.dense[s] = true;
      const int64_t elements = seq.new_tokens * h.q_width() + 2 * keys * h.kv_width();
      plan.dense_scratch_bytes = std::max(plan.dense_scratch_bytes, elements * 2);
      continue;
    }
    max_keys = std::max(max_keys, keys);
    for (int64_t g = 0; g < h.num_kv_heads; ++g) {
      for (int64_t t = 0; t < seq.new_tokens; t += unit_tokens) {
        for (int64_t h0 = 0; h0 < group; h0 += unit_heads) {
          PagedUnit u;
          u.seq = static_cast<int32_t>(s);
          u.kv_head = static_cast<int32_t>(g);
          u.head0 = static_cast<int32_t>(g * group + h0);
          u.heads = static_cast<int32_t>(std::min(unit_heads, group - h0));
          u.token0 = static_cast<int32_t>(t);
          u.tokens = static_cast<int32_t>(std::min(unit_tokens, seq.new_tokens - t));
          plan.units.push_back(u);
        }
      }
    }
  }
  AddSharedUnits(problem, sequences, &plan);
  const int64_t units = std::max<int64_t>(1, static_cast<int64_t>(plan.units.size()));
  const int64_t wanted = (kBlocksPerMultiprocessor * std::max(1, multiprocessors) + units - 1) / units;
  const int64_t most = std::max<int64_t>(1, max_keys / kMinSplitKeys);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, std::min<int64_t>(most, 1024));
  const int64_t per_split = (max_keys + splits - 1) / splits;
  plan.split_keys = std::max<int64_t>(kPagedTileKeys, (per_split + kPagedTileKeys - 1) / kPagedTileKeys * kPagedTileKeys);
  plan.splits = static_cast<int>(std::max<int64_t>(1, (max_keys + plan.split_keys - 1) / plan.split_keys));
  return plan;
}

int64_t PagedScratchBytes(const PagedProblem& problem, const PagedPlan& plan) {
  const HeadSpec& h = problem.heads;
  return plan.rows * h.num_heads * PagedSlotsOf(plan) * (h.head_dim + 5) * 4;
}

}  // namespace cuda
}  // namespace mha
