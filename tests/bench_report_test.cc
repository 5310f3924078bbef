// The statistics behind `mha_client bench` on hand-made samples: percentiles, histogram, counts, latency split,
// status grouping, the three output formats, and the option checks (no server needed).
#include "client/bench_report.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "client/bench.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/mha/v1/attention_shape.h"

namespace mha {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

CallSample Ok(double latency, double queue = 0, double compute = 0, double handler = 0) {
  CallSample s;
  s.latency = latency;
  s.server_queue = queue;
  s.server_compute = compute;
  s.server_handler = handler;
  return s;
}

CallSample Error(int code, const std::string& message, double latency = 0.001) {
  CallSample s;
  s.code = code;
  s.message = message;
  s.latency = latency;
  return s;
}

AttentionShape DemoShape(int64_t batch, int64_t seq) {
  AttentionShape s;
  s.batch = batch;
  s.q_len = s.kv_len = seq;
  s.d_model = s.d_kv_in = s.d_v_in = 512;
  s.heads.num_heads = s.heads.num_kv_heads = 8;
  s.heads.head_dim = 64;
  return s;
}

TEST(Percentile, IsNearestRank) {
  std::vector<double> sorted;
  for (int i = 1; i <= 1000; ++i) sorted.push_back(i);
  EXPECT_EQ(Percentile(sorted, 50), 500);
  EXPECT_EQ(Percentile(sorted, 90), 900);
  EXPECT_EQ(Percentile(sorted, 99), 990);
  EXPECT_EQ(Percentile(sorted, 99.9), 999);
  EXPECT_EQ(Percentile(sorted, 100), 1000);
  EXPECT_EQ(Percentile(sorted, 0), 1);
  EXPECT_EQ(Percentile({7.0}, 99.9), 7.0);
  EXPECT_EQ(Percentile({}, 50), 0);
  // Four values: p50 is the 2nd, p90 and up the 4th.
  EXPECT_EQ(Percentile({1, 2, 3, 4}, 50), 2);
  EXPECT_EQ(Percentile({1, 2, 3, 4}, 90), 4);
}

TEST(Histogram, LogSpacedBucketsHoldEveryValue) {
  const std::vector<double> sorted = {1, 1, 2, 4, 8, 16, 32, 64, 128, 1024};
  const std::vector<HistogramBucket> h = Histogram(sorted, 10);
  ASSERT_EQ(h.size(), 10u);
  EXPECT_DOUBLE_EQ(h.front().lower, 1);
  EXPECT_DOUBLE_EQ(h.back().upper, 1024);
  int64_t total = 0;
  for (size_t i = 0; i < h.size(); ++i) {
    total += h[i].count;
    EXPECT_NEAR(h[i].upper / h[i].lower, 2.0, 1e-9) << "bucket " << i;  // 1024 = 2^10 over 10 buckets
    if (i > 0) {
      EXPECT_DOUBLE_EQ(h[i].lower, h[i - 1].upper);
    }
  }
  EXPECT_EQ(total, 10);
  EXPECT_EQ(h[0].count, 3);  // 1, 1 and 2 (upper bound inclusive)
  EXPECT_EQ(h[9].count, 1);  // 1024
}

TEST(Histogram, EqualValuesMakeOneBucketAndEmptyMakesNone) {
  const std::vector<HistogramBucket> h = Histogram({3, 3, 3}, 10);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].count, 3);
  EXPECT_TRUE(Histogram({}, 10).empty());
}

TEST(Summarize, CountsAddUpAndErrorsAreGroupedByCodeAndMessage) {
  LoadResult result;
  result.elapsed = 2.0;
  for (int i = 1; i <= 8; ++i) result.samples.push_back(Ok(i * 0.001, 0.0001, 0.0005, 0.0007));
  result.samples.push_back(Error(8, "queue full"));
  result.samples.push_back(Error(8, "queue full"));
  result.samples.push_back(Error(8, "too much work"));
  result.samples.push_back(Error(4, "deadline"));
  RunConfig config;
  config.shape = DemoShape(1, 16);
  const BenchReport r = Summarize(config, result);
  EXPECT_EQ(r.sent, 12);
  EXPECT_EQ(r.ok, 8);
  EXPECT_EQ(r.errors, 4);
  EXPECT_DOUBLE_EQ(r.rps, 6.0);
  EXPECT_DOUBLE_EQ(r.gflops, 8 * AttentionFlops(config.shape) / 2.0 / 1e9);
  // Latency statistics cover the OK calls only.
  EXPECT_DOUBLE_EQ(r.latency.fastest, 0.001);
  EXPECT_DOUBLE_EQ(r.latency.slowest, 0.008);
  EXPECT_DOUBLE_EQ(r.latency.mean, 0.0045);
  EXPECT_DOUBLE_EQ(r.latency.p50, 0.004);
  EXPECT_DOUBLE_EQ(r.latency.p99, 0.008);
  ASSERT_EQ(r.statuses.size(), 3u);
  EXPECT_EQ(r.statuses[0].code, 0);
  EXPECT_EQ(r.statuses[0].count, 8);
  EXPECT_EQ(r.statuses[1].code, 4);  // DEADLINE_EXCEEDED
  EXPECT_EQ(r.statuses[2].code, 8);  // RESOURCE_EXHAUSTED
  EXPECT_EQ(r.statuses[2].count, 3);
  EXPECT_THAT(r.statuses[2].messages, ElementsAre(std::pair<std::string, int64_t>{"queue full", 2},
                                                  std::pair<std::string, int64_t>{"too much work", 1}));
  // The split adds up to the mean latency.
  EXPECT_DOUBLE_EQ(r.split.server_queue, 0.0001);
  EXPECT_DOUBLE_EQ(r.split.server_compute, 0.0005);
  EXPECT_NEAR(r.split.server_other, 0.0001, 1e-12);  // handler 0.7 ms - queue 0.1 ms - compute 0.5 ms
  EXPECT_NEAR(r.split.send_delay + r.split.serialize + r.split.server_queue + r.split.server_compute +
                  r.split.server_other + r.split.deserialize + r.split.other,
              r.latency.mean, 1e-12);
}

TEST(Summarize, NoOkCallsGivesZeroLatencies) {
  LoadResult result;
  result.elapsed = 1.0;
  result.samples = {Error(14, "unavailable"), Error(14, "unavailable")};
  const BenchReport r = Summarize(RunConfig(), result);
  EXPECT_EQ(r.ok, 0);
  EXPECT_EQ(r.errors, 2);
  EXPECT_EQ(r.latency.p99, 0);
  EXPECT_TRUE(r.histogram.empty());
  EXPECT_EQ(r.gflops, 0);
}

BenchReport SmallReport(int concurrency) {
  LoadResult result;
  result.elapsed = 1.0;
  for (int i = 1; i <= 100; ++i) result.samples.push_back(Ok(i * 0.001));
  result.samples.push_back(Error(3, "bad \"query\""));
  RunConfig config;
  config.concurrency = concurrency;
  config.target = "127.0.0.1:1";
  config.weights = "layer demo";
  config.shape = DemoShape(1, 16);
  return Summarize(config, result);
}

TEST(FormatJson, SingleRunIsAnObjectWithCountsPercentilesAndStatuses) {
  const nlohmann::json j = nlohmann::json::parse(FormatJson({SmallReport(4)}));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["mode"], "closed");
  EXPECT_EQ(j["concurrency"], 4);
  EXPECT_EQ(j["count"]["sent"], 101);
  EXPECT_EQ(j["count"]["ok"], 100);
  EXPECT_EQ(j["count"]["errors"], 1);
  EXPECT_DOUBLE_EQ(j["latency_ms"]["p50"].get<double>(), 50);
  EXPECT_DOUBLE_EQ(j["latency_ms"]["p99_9"].get<double>(), 100);
  EXPECT_EQ(j["request"]["num_heads"], 8);
  ASSERT_EQ(j["status"].size(), 2u);
  EXPECT_EQ(j["status"][1]["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(j["status"][1]["messages"][0]["message"], "bad \"query\"");
  int64_t in_histogram = 0;
  for (const auto& bucket : j["histogram"]) in_histogram += bucket["count"].get<int64_t>();
  EXPECT_EQ(in_histogram, 100);
}

TEST(FormatJson, SweepIsAnArrayOfRuns) {
  const nlohmann::json j = nlohmann::json::parse(FormatJson({SmallReport(1), SmallReport(2), SmallReport(4)}));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 3u);
  EXPECT_EQ(j[2]["concurrency"], 4);
}

TEST(FormatCsv, HeaderAndOneLinePerRunWithTheSameNumberOfFields) {
  const std::string csv = FormatCsv({SmallReport(1), SmallReport(2)});
  const std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  const size_t fields = std::vector<std::string>(absl::StrSplit(lines[0], ',')).size();
  EXPECT_EQ(fields, 25u);
  for (const std::string& line : lines) EXPECT_EQ(std::vector<std::string>(absl::StrSplit(line, ',')).size(), fields);
  EXPECT_THAT(lines[1], ::testing::StartsWith("closed,1,0,1,101,100,1,"));
}

TEST(FormatPretty, ShowsEveryPartOfTheReport) {
  const std::string text = FormatPretty({SmallReport(4)});
  for (const char* part : {"Count:        101 (ok 100, errors 1)", "Requests/sec: 101.00", "GFLOP/s", "p99.9",
                           "Histogram (ms):", "client serialize", "server queue", "server compute", "server other",
                           "[INVALID_ARGUMENT] 1", "1 x bad \"query\""}) {
    EXPECT_THAT(text, HasSubstr(part));
  }
}

TEST(ParseConcurrencyRange, MultiplicativeAndAdditiveSteps) {
  EXPECT_THAT(*ParseConcurrencyRange("1:64:x2"), ElementsAre(1, 2, 4, 8, 16, 32, 64));
  EXPECT_THAT(*ParseConcurrencyRange("1:10:x3"), ElementsAre(1, 3, 9));
  EXPECT_THAT(*ParseConcurrencyRange("4:16:4"), ElementsAre(4, 8, 12, 16));
  EXPECT_THAT(*ParseConcurrencyRange("5:5:1"), ElementsAre(5));
}

TEST(ParseConcurrencyRange, RejectsMalformedRanges) {
  for (const char* bad : {"", "1:64", "0:4:1", "8:4:1", "1:4:0", "1:4:x1", "1:5000:x2", "a:b:c", "1:4:y2"}) {
    absl::StatusOr<std::vector<int>> got = ParseConcurrencyRange(bad);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseConcurrencyRange("1:64").status().message(),
            "'1:64' must be start:end:step or start:end:xFACTOR with 1 <= start <= end <= 1024, "
            "e.g. 1:64:x2");
}

TEST(ValidateLoadOptions, NeedsABoundAndSaneValues) {
  LoadOptions options;
  options.total = 10;
  EXPECT_TRUE(ValidateLoadOptions(options).ok());
  LoadOptions unbounded;
  EXPECT_EQ(ValidateLoadOptions(unbounded).message(), "a run needs a call count or a duration");
  LoadOptions bad = options;
  bad.concurrency = 0;
  EXPECT_EQ(ValidateLoadOptions(bad).message(), "concurrency must be in [1, 1024]; got 0");
  bad = options;
  bad.rps = -1;
  EXPECT_EQ(ValidateLoadOptions(bad).message(), "rps must be a finite number >= 0; got -1");
  bad = options;
  bad.max_in_flight = 0;
  EXPECT_EQ(ValidateLoadOptions(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = options;
  bad.timeout = absl::ZeroDuration();
  EXPECT_EQ(ValidateLoadOptions(bad).message(), "timeout must be > 0; got 0");
}

}  // namespace
}  // namespace mha
