// MergeAttention (client/merge_attention.h): shards' outputs merged by their lse equal the softmax-weighted sum over
// every key; rows no shard sees stay zero with lse -inf; a shard that sees nothing changes nothing; mismatched
// shapes are INVALID_ARGUMENT.
#include "client/merge_attention.h"

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace mha {
namespace {

constexpr int64_t kBatch = 2, kRows = 3, kHeads = 2, kHeadDim = 4, kKeys = 10;

// Random scores [B, H, T, keys] in [-3, 3] and values [B, H, keys, d_k] in [-1, 1]: attention without projections.
struct Problem {
  std::vector<float> scores = testing::RandomVector(kBatch * kHeads * kRows * kKeys, 11, 3.0f);
  std::vector<float> values = testing::RandomVector(kBatch * kHeads * kKeys * kHeadDim, 12);
};

using Visible = std::function<bool(int64_t b, int64_t h, int64_t t, int64_t key)>;

// Attention over the keys [begin, end) that `visible` lets through, in double: output [B, T, H, d_k] and lse
// [B, H, T]; a row with no visible key is zero with lse -inf, as the server returns it.
MergedAttention Attend(const Problem& p, int64_t begin, int64_t end, const Visible& visible) {
  MergedAttention out{{{kBatch, kRows, kHeads, kHeadDim}, std::vector<float>(kBatch * kRows * kHeads * kHeadDim)},
                      {{kBatch, kHeads, kRows}, std::vector<float>(kBatch * kHeads * kRows)}};
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t t = 0; t < kRows; ++t) {
        const float* scores = &p.scores[((b * kHeads + h) * kRows + t) * kKeys];
        double sum = 0;
        std::vector<double> row(kHeadDim, 0.0);
        for (int64_t j = begin; j < end; ++j) {
          if (!visible(b, h, t, j)) continue;
          const double w = std::exp(static_cast<double>(scores[j]));
          sum += w;
          for (int64_t d = 0; d < kHeadDim; ++d) row[d] += w * p.values[((b * kHeads + h) * kKeys + j) * kHeadDim + d];
        }
        out.lse.values[(b * kHeads + h) * kRows + t] = static_cast<float>(std::log(sum));
        for (int64_t d = 0; d < kHeadDim; ++d) {
          out.output.values[((b * kRows + t) * kHeads + h) * kHeadDim + d] =
              sum > 0 ? static_cast<float>(row[d] / sum) : 0.0f;
        }
      }
    }
  }
  return out;
}

const Visible kAll = [](int64_t, int64_t, int64_t, int64_t) { return true; };

absl::StatusOr<MergedAttention> MergeShards(const std::vector<MergedAttention>& shards) {
  std::vector<Array> outputs, lses;
  for (const MergedAttention& shard : shards) {
    outputs.push_back(shard.output);
    lses.push_back(shard.lse);
  }
  return MergeAttention(outputs, lses);
}

TEST(MergeAttentionTest, ShardsMergeToTheUnshardedAttention) {
  const Problem p;
  const MergedAttention whole = Attend(p, 0, kKeys, kAll);
  absl::StatusOr<MergedAttention> merged =
      MergeShards({Attend(p, 0, 4, kAll), Attend(p, 4, 7, kAll), Attend(p, 7, kKeys, kAll)});
  ASSERT_OK(merged.status());
  EXPECT_EQ(merged->output.shape, whole.output.shape);
  EXPECT_EQ(merged->lse.shape, whole.lse.shape);
  EXPECT_TRUE(testing::AllClose(merged->output.values, whole.output.values, 1e-6, 1e-5));
  EXPECT_TRUE(testing::AllClose(merged->lse.values, whole.lse.values, 1e-6, 1e-5));
}

TEST(MergeAttentionTest, OneShardIsItself) {
  const Problem p;
  const MergedAttention whole = Attend(p, 0, kKeys, kAll);
  absl::StatusOr<MergedAttention> merged = MergeShards({whole});
  ASSERT_OK(merged.status());
  EXPECT_TRUE(testing::AllClose(merged->output.values, whole.output.values, 1e-6, 1e-6));
  EXPECT_TRUE(testing::AllClose(merged->lse.values, whole.lse.values, 1e-6, 1e-6));
}

TEST(MergeAttentionTest, RowNoShardSeesStaysZeroWithLseMinusInfinity) {
  const Problem p;
  // Batch 1, head 0, row 2 sees no key in any shard; every other row sees them all.
  const Visible visible = [](int64_t b, int64_t h, int64_t t, int64_t) { return !(b == 1 && h == 0 && t == 2); };
  absl::StatusOr<MergedAttention> merged = MergeShards({Attend(p, 0, 5, visible), Attend(p, 5, kKeys, visible)});
  ASSERT_OK(merged.status());
  const MergedAttention whole = Attend(p, 0, kKeys, visible);
  const float lse = merged->lse.values[(1 * kHeads + 0) * kRows + 2];
  EXPECT_TRUE(std::isinf(lse) && lse < 0) << lse;
  for (int64_t d = 0; d < kHeadDim; ++d) {
    EXPECT_EQ(merged->output.values[((1 * kRows + 2) * kHeads + 0) * kHeadDim + d], 0.0f) << d;
  }
  EXPECT_TRUE(testing::AllClose(merged->output.values, whole.output.values, 1e-6, 1e-5));  // no NaN anywhere
}

TEST(MergeAttentionTest, ShardThatSeesNoKeyLeavesTheOthersUnchanged) {
  const Problem p;
  const std::vector<MergedAttention> seeing = {Attend(p, 0, 6, kAll), Attend(p, 6, kKeys, kAll)};
  MergedAttention blind = Attend(p, 0, kKeys, [](int64_t, int64_t, int64_t, int64_t) { return false; });
  // Whatever a blind shard's output holds, its weight is zero.
  for (float& x : blind.output.values) x = 7.0f;
  absl::StatusOr<MergedAttention> without = MergeShards(seeing);
  absl::StatusOr<MergedAttention> with = MergeShards({seeing[0], blind, seeing[1]});
  ASSERT_OK(without.status());
  ASSERT_OK(with.status());
  EXPECT_EQ(with->output.values, without->output.values);
  EXPECT_EQ(with->lse.values, without->lse.values);
}

TEST(MergeAttentionTest, OutputsOfDifferentShapesAreInvalidArgument) {
  const Problem p;
  MergedAttention other = Attend(p, 0, 5, kAll);
  other.output.shape = {kBatch, kRows, kHeads * kHeadDim, 1};
  absl::StatusOr<MergedAttention> merged = MergeShards({Attend(p, 0, 5, kAll), other});
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument) << merged.status();
}

TEST(MergeAttentionTest, LseNotHeadsByRowsIsInvalidArgument) {
  const Problem p;
  MergedAttention shard = Attend(p, 0, 5, kAll);
  shard.lse.shape = {kBatch, kRows, kHeads};  // [..., T, H] instead of [..., H, T]
  absl::StatusOr<MergedAttention> merged = MergeShards({shard});
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument) << merged.status();
}

TEST(MergeAttentionTest, ValuesThatDoNotFillTheShapeAreInvalidArgument) {
  const Problem p;
  MergedAttention shard = Attend(p, 0, 5, kAll);
  shard.output.values.pop_back();
  EXPECT_EQ(MergeShards({shard}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MergeAttentionTest, NoShardsOrUnpairedLsesAreInvalidArgument) {
  const Problem p;
  const MergedAttention shard = Attend(p, 0, 5, kAll);
  EXPECT_EQ(MergeAttention({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MergeAttention({shard.output, shard.output}, {shard.lse}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MergeAttentionTest, OutputWithFewerThanThreeDimensionsIsInvalidArgument) {
  const Array output{{kHeads, kHeadDim}, std::vector<float>(kHeads * kHeadDim)};
  const Array lse{{kHeads}, std::vector<float>(kHeads)};
  EXPECT_EQ(MergeAttention({output}, {lse}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mha
