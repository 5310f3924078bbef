#include "server/backends/cpu/paged_cascade.h"

#include <algorithm>
#include <limits>

#include "server/backends/cpu/paged_attention.h"
#include "server/backends/cpu/scratch.h"
#include "server/backends/shared_prefix.h"

namespace mha::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys of one step of the online softmax, as the prefill path takes them: its max, sum and rescaling paid once
// per this many keys.
constexpr int64_t kSpanKeys = 256;
int64_t SpanBlocks(int64_t block_tokens) { return std::max<int64_t>(1, kSpanKeys / block_tokens); }

struct CascadeScratch {
  ScratchVector<float> queries, scores, factor, query_pos;
  ScratchVector<int64_t> visible;
};

// Members `ids` (sharing `blocks` blocks) as groups of at most kCascadeMaxRows rows; a lone member is left out.
void AddGroups(const PagedProblem& p, absl::Span<const PagedSequence> sequences, const std::vector<int64_t>& ids,
               int64_t blocks, std::vector<SharedGroup>* groups) {
  const int64_t G = p.heads.group_size();
  SharedGroup group;
  group.blocks = blocks;
  const auto flush = [&] {
    if (group.members.size() >= 2) groups->push_back(group);
    group.members.clear();
    group.row0.clear();
    group.rows = 0;
  };
  for (int64_t s : ids) {
    const int64_t rows = G * sequences[s].new_tokens;
    if (group.rows + rows > kCascadeMaxRows) flush();
    group.members.push_back(s);
    group.row0.push_back(group.rows);
    group.rows += rows;
  }
  flush();
}

}  // namespace

std::vector<SharedGroup> FindSharedPrefixes(const PagedProblem& p, absl::Span<const PagedSequence> sequences) {
  std::vector<SharedGroup> groups;
  const auto decoding = [&p](const PagedSequence& seq) { return TakesDecodePath(p, seq); };
  for (const CommonPrefix& common : FindCommonPrefixes(sequences, p.cache.block_tokens, decoding)) {
    AddGroups(p, sequences, common.members, common.blocks, &groups);
  }
  return groups;
}

void RunSharedBlocks(const kernels::TileKernels& tiles, const kernels::PagedKernels& kernels, const PagedProblem& p,
                     const SharedGroup& group, absl::Span<const PagedSequence> sequences,
                     absl::Span<const int64_t> first_row, const float* q, int64_t ldq, float q_scale, bool log2,
                     int64_t b0, int64_t b1, float* partial) {
  const HeadSpec& h = p.heads;
  const KvCacheLayout& c = p.cache;
  const int64_t dk = h.head_dim, tb = c.block_tokens, G = h.group_size(), rows = group.rows;
  const int64_t half = c.KeyBytes(), span = SpanBlocks(tb), lds = span * tb;
  const PagedSequence& lead = sequences[group.members[0]];  // its blocks [0, group.blocks) are every member's
  const RowStats& asked = lead.stats;  // one call's sequences ask for the same statistics
  thread_local CascadeScratch t;
  float* queries = Grown(t.queries, rows * dk);
  float* scores = Grown(t.scores, rows * lds);
  float* factor = Grown(t.factor, rows);
  float* query_pos = Grown(t.query_pos, rows);
  int64_t* visible = Grown(t.visible, rows);
  const void* values[kSpanKeys / 16];
  const uint16_t* value_scales[kSpanKeys / 16];
  for (int64_t g = 0; g < h.num_kv_heads; ++g) {
    // KV head g's part of block b (K^T, then V `half` bytes on); null at the unit's end.
    const auto Part = [&](int64_t b) -> const char* { return b < b1 ? lead.blocks[b] + c.KeyPart(g) : nullptr; };
    float* acc = partial + g * PartialFloats(h, rows);
    float *max = acc + rows * dk, *sum = max + rows, *stats = sum + rows;
    std::fill_n(acc, rows * dk, 0.0f);
    std::fill_n(max, rows, kNegInf);
    std::fill_n(sum, rows * (1 + kernels::kStatsPerRow), 0.0f);
    for (size_t m = 0; m < group.members.size(); ++m) {
      const PagedSequence& seq = sequences[group.members[m]];
      for (int64_t i = 0; i < seq.new_tokens; ++i) {
        const int64_t r = group.row0[m] + i * G;
        tiles.copy_scaled(G, dk, q_scale, q + (first_row[group.members[m]] + i) * ldq + g * G * dk, dk,
                          queries + r * dk, dk);
        std::fill_n(query_pos + r, G, static_cast<float>(seq.length + i));
      }
    }
    for (int64_t s0 = b0; s0 < b1; s0 += span) {
      const int64_t s1 = std::min(b1, s0 + span), keys = (s1 - s0) * tb;
      for (int64_t b = s0; b < s1; ++b) {
        kernels.prefill_scores(rows, tb, dk, queries, dk, Part(b), tb, KeyScales(c, Part(b)), scores + (b - s0) * tb,
                               lds, Part(b + 1), half);
      }
      std::fill_n(visible, rows, keys);  // shared blocks are full and before every row's position
      if (asked.entropy != nullptr) {
        const kernels::SoftmaxStatsBlock block{s0 * tb, query_pos, asked.sink_tokens, stats};
        tiles.online_softmax_stats(rows, keys, visible, scores, lds, max, sum, factor, log2, block);
      } else {
        tiles.online_softmax(rows, keys, visible, scores, lds, max, sum, factor, log2);
      }
      for (int64_t b = s0; b < s1; ++b) {
        values[b - s0] = Part(b) + half;
        value_scales[b - s0] = ValueScales(c, Part(b) + half);
      }
      const char* next = Part(s1);
      kernels.prefill_values(rows, values, value_scales, s1 - s0, tb, tb, dk, scores, lds, factor, acc, dk,
                             next == nullptr ? nullptr : next + half, half);
    }
  }
}

int64_t SharedBlocksBytesPerThread(const PagedProblem& p) {
  const int64_t span_keys = SpanBlocks(p.cache.block_tokens) * p.cache.block_tokens;
  return kCascadeMaxRows * ((p.heads.head_dim + span_keys + 2) * static_cast<int64_t>(sizeof(float)) +
                            static_cast<int64_t>(sizeof(int64_t)));
}

}  // namespace mha::cpu
