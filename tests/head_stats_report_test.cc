// mha_client heads' arithmetic without a server: the batch means and the ranking by contribution, the ablation's
// measured change and its bound, and the formats' shapes.
#include "client/head_stats_report.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// B = 2 items of H = 3 heads, each field the same per-item values.
v1::HeadStats Stats(const std::vector<float>& values) {
  v1::HeadStats stats;
  for (float x : values) {
    stats.add_entropy(x);
    stats.add_normalized_entropy(x);
    stats.add_confidence(x);
    stats.add_distance(x);
    stats.add_sink_mass(x);
    stats.add_contribution(x);
  }
  return stats;
}

std::vector<int64_t> Order(const std::vector<HeadSummary>& ranked) {
  std::vector<int64_t> heads;
  for (const HeadSummary& s : ranked) heads.push_back(s.head);
  return heads;
}

TEST(RankHeads, MeansOverTheBatchRankedByContributionLargestFirst) {
  // item 0: 0.125 0.75 0.5; item 1: 0.125 0.25 0.5 -> means 0.125 0.5 0.5 (a tie: lower head first).
  absl::StatusOr<std::vector<HeadSummary>> ranked =
      RankHeads(Stats({0.125f, 0.75f, 0.5f, 0.125f, 0.25f, 0.5f}), 2, 3, 3);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  EXPECT_THAT(Order(*ranked), ElementsAre(1, 2, 0));
  EXPECT_EQ((*ranked)[2].contribution, 0.125);
  EXPECT_EQ((*ranked)[0].entropy, 0.5);
}

TEST(RankHeads, KvGroupsFollowGqa) {
  absl::StatusOr<std::vector<HeadSummary>> ranked = RankHeads(Stats({0.4f, 0.3f, 0.2f, 0.1f}), 1, 4, 2);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  EXPECT_EQ((*ranked)[1].kv_group, 0);
  EXPECT_EQ((*ranked)[2].kv_group, 1);
}

TEST(RankHeads, WrongValueCountIsInternal) {
  v1::HeadStats stats = Stats({0.1f, 0.2f, 0.3f});
  stats.mutable_distance()->RemoveLast();
  EXPECT_EQ(RankHeads(stats, 1, 3, 3).status(),
            absl::InternalError("the server returned 2 values of head_stats.distance; expected B x H = 3"));
}

TEST(MeasureAblation, RelativeChangeWholeAndPerRowWithTheBoundOfTheAblatedHeads) {
  const std::vector<float> out = {3, 4, 0, 1};      // two rows of d_model 2: norms 5 and 1
  const std::vector<float> ablated = {3, 4, 0, 0};  // row 1 moves by 1
  std::vector<HeadSummary> ranked(2);
  ranked[0].head = 1;
  ranked[0].contribution = 0.75;
  ranked[1].head = 0;
  ranked[1].contribution = 0.25;
  Ablation ablation;
  ablation.heads = {0};
  ASSERT_TRUE(MeasureAblation(out, ablated, 2, ranked, &ablation).ok());
  EXPECT_NEAR(ablation.relative_change, 1 / std::sqrt(26.0), 1e-12);
  EXPECT_NEAR(ablation.mean_row_change, 0.5, 1e-12);  // (0 + 1) / 2
  EXPECT_DOUBLE_EQ(ablation.predicted_bound, 0.25);
  EXPECT_EQ(MeasureAblation(out, {1, 2, 3}, 2, ranked, &ablation).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FormatHeads, CsvHasAHeaderAndOneRowPerHeadWithTheAblatedColumn) {
  HeadsReport report;
  report.ranked = *RankHeads(Stats({0.1f, 0.5f, 0.3f}), 1, 3, 3);
  std::vector<std::string> lines = absl::StrSplit(FormatHeadsCsv(report), '\n', absl::SkipEmpty());
  EXPECT_EQ(lines[0], "rank,head,kv_group,contribution,entropy,normalized_entropy,confidence,distance,sink_mass");
  EXPECT_EQ(lines.size(), 4u);
  report.ablation = Ablation();
  report.ablation->heads = {0};
  lines = absl::StrSplit(FormatHeadsCsv(report), '\n', absl::SkipEmpty());
  EXPECT_THAT(lines[0], HasSubstr(",ablated"));
  EXPECT_THAT(lines[3], ::testing::StartsWith("3,0,0,"));
  EXPECT_THAT(lines[3], ::testing::EndsWith(",1"));
  EXPECT_THAT(FormatHeadsPretty(report), HasSubstr("predicted upper bound (sum of their contributions)"));
  EXPECT_THAT(FormatHeadsJson(report), HasSubstr("\"ablation\": {"));
}

}  // namespace
}  // namespace mha
