// One decode step through the CPU backend in process, as the decode benchmarks time it.
#ifndef MHA_TESTS_BENCH_DECODE_STEP_H_
#define MHA_TESTS_BENCH_DECODE_STEP_H_

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "server/backends/cpu/cpu_backend.h"
#include "server/sessions/session_store.h"
#include "tests/bench/bench_util.h"

namespace mha::bench {

// A token for each of the head sessions `ids` of `store` (q [H d_k] and k = v [Hkv d_k] the same for all, out
// [sessions, H d_k]), attended over its cache and appended nowhere: the reservation is dropped, so the caches stay
// at their length and the next step reads as many tokens again. Returns the backend call's seconds; a failure is
// printed under `name`.
inline double DecodeStep(CpuBackend& backend, SessionStore& store, absl::Span<const std::string> ids,
                         const HeadSpec& heads, const KvCacheLayout& cache, const float* q, const float* kv,
                         float* out, const std::string& name) {
  const int64_t sessions = static_cast<int64_t>(ids.size());
  std::vector<ReserveItem> items;
  for (const std::string& id : ids) items.push_back({id, 0, 1, "", {}});
  ExtendReservation r = *store.Reserve(items);
  std::vector<PagedSequence> sequences(sessions);
  PagedArgs args;
  args.problem.heads = heads;
  args.problem.cache = cache;
  args.problem.sequences = args.problem.new_tokens = sessions;
  args.problem.max_new_tokens = 1;
  for (int64_t s = 0; s < sessions; ++s) {
    PagedSequence& seq = sequences[s];
    seq.blocks = r.items()[s].blocks;
    seq.length = r.items()[s].length;
    seq.new_tokens = 1;
    seq.q = {q, v1::FP32};
    seq.k = seq.v = {kv, v1::FP32};
    seq.out = {out + s * heads.q_width(), v1::FP32};
    args.problem.max_length = std::max(args.problem.max_length, seq.length + 1);
  }
  args.sequences = sequences;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = backend.PagedAttention(args);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ExitUnlessOk(status, name);
  return seconds;
}

}  // namespace mha::bench

#endif  // MHA_TESTS_BENCH_DECODE_STEP_H_
