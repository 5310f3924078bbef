#include "server/backends/cuda/paged_plan.h"

#include <algorithm>

#include "server/backends/shared_prefix.h"

namespace mha {
namespace cuda {
namespace {

// The cascade groups among `sequences` (PlanPaged says which) and their shared units, added to `plan` after the
// sequences' own units.
void AddSharedUnits(const PagedProblem& problem, absl::Span<const PagedSequence> sequences, PagedPlan* plan) {
  const HeadSpec& h = problem.heads;
  const int64_t tb = problem.cache.block_tokens, group = h.group_size();
  const bool mma = CascadeOnTensorCores(problem);
  const int64_t members_per_unit = (mma ? kCascadeRows : PagedRowsPerUnit(h.head_dim)) / group;
  plan->shared_keys.assign(sequences.size(), 0);
  if (members_per_unit < 2) return;
  const auto decoding = [](const PagedSequence& seq) { return seq.new_tokens == 1; };
  const size_t own_units = plan->units.size();
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
  if (mma) plan->mma_units = static_cast<int64_t>(plan->units.size() - own_units);
}

// Splits of `keys` keys (a multiple of `tile`) for `units` units: about kBlocksPerMultiprocessor blocks per
// multiprocessor, at least `min_keys` keys each; sets *splits and *split_keys.
void ChooseSplits(int64_t keys, int64_t units, int multiprocessors, int64_t min_keys, int64_t tile, int* splits,
                  int64_t* split_keys) {
  units = std::max<int64_t>(1, units);
  const int64_t wanted = (kBlocksPerMultiprocessor * std::max(1, multiprocessors) + units - 1) / units;
  const int64_t most = std::max<int64_t>(1, keys / min_keys);
  const int64_t count = std::clamp<int64_t>(wanted, 1, std::min<int64_t>(most, 1024));
  const int64_t per_split = (keys + count - 1) / count;
  *split_keys = std::max<int64_t>(tile, (per_split + tile - 1) / tile * tile);
  *splits = static_cast<int>(std::max<int64_t>(1, (keys + *split_keys - 1) / *split_keys));
}

}  // namespace

bool CascadeOnTensorCores(const PagedProblem& problem) {
  const int64_t dk = problem.heads.head_dim;
  return problem.cache.dtype != v1::FP32 && (dk == 64 || dk == 128) && !problem.return_weights &&
         problem.heads.group_size() <= kCascadeRows / 2;
}

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
  // The split kernel's longest key range: a sequence's own units start at its shared keys (the split kernel's shared
  // units need the whole range).
  int64_t range = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (plan.dense[s]) continue;
    range = std::max(range, sequences[s].Keys() - (plan.mma_units > 0 ? plan.shared_keys[s] : 0));
  }
  const int64_t split_units = static_cast<int64_t>(plan.units.size()) - plan.mma_units;
  ChooseSplits(range, split_units, multiprocessors, kMinSplitKeys, kPagedTileKeys, &plan.splits, &plan.split_keys);
  if (plan.mma_units > 0) {
    const int64_t shared = *std::max_element(plan.shared_keys.begin(), plan.shared_keys.end());
    ChooseSplits(shared, plan.mma_units, multiprocessors, kMinCascadeSplitKeys, kCascadeTileKeys, &plan.shared_splits,
                 &plan.shared_split_keys);
  } else if (!plan.cascade.empty()) {
    plan.shared_splits = plan.splits;
    plan.shared_split_keys = plan.split_keys;
  }
  return plan;
}

int64_t PagedScratchBytes(const PagedProblem& problem, const PagedPlan& plan) {
  const HeadSpec& h = problem.heads;
  return plan.rows * h.num_heads * PagedSlotsOf(plan) * (h.head_dim + 5) * 4;
}

}  // namespace cuda
}  // namespace mha
