// Statistics of a load test and their rendering (pretty text, JSON, CSV): what `mha_client bench` prints.
// Pure functions of the recorded samples, so they are tested without a server.
#ifndef MHA_CLIENT_BENCH_REPORT_H_
#define MHA_CLIENT_BENCH_REPORT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "proto/mha/v1/attention_shape.h"
#include "client/bench.h"

namespace mha {

// What was asked for, echoed in the report.
struct RunConfig {
  bool open_loop = false;
  int concurrency = 1;     // closed loop (and warmup)
  double target_rps = 0;   // open loop
  int max_in_flight = 0;   // open loop
  int connections = 1;
  int64_t warmup = 0;
  std::string target;
  std::string weights;     // "layer demo" or "file w.safetensors"
  std::string protocol = "native";  // the front door: "native" (mha.v1) or "kserve" (KServe v2 ModelInfer)
  AttentionShape shape;
  int64_t request_bytes = 0;  // serialized request size
};

// Seconds.
struct LatencySummary {
  double fastest = 0, slowest = 0, mean = 0, stddev = 0;
  double p50 = 0, p90 = 0, p95 = 0, p99 = 0, p999 = 0;
};

// Calls whose latency is in (lower, upper] seconds; the first bucket also holds latency == lower.
struct HistogramBucket {
  double lower = 0, upper = 0;
  int64_t count = 0;
};

// Mean seconds per OK call; the parts add up to the mean latency.
struct LatencySplit {
  double send_delay = 0;      // open loop: intended send time -> the client started the call
  double serialize = 0;       // client: request -> gRPC byte buffer
  double server_queue = 0;    // Timing.queue_us
  double server_compute = 0;  // Timing.compute_us
  double server_other = 0;    // Timing.handler_us - queue_us - compute_us: validation, response assembly
  double deserialize = 0;     // client: byte buffer -> response
  double other = 0;           // the rest: network, HTTP/2, gRPC's parsing and serialization on the server
};

struct StatusSummary {
  int code = 0;  // absl::StatusCode value
  int64_t count = 0;
  // Distinct error messages with their counts, most frequent first, at most kMaxMessagesPerCode.
  std::vector<std::pair<std::string, int64_t>> messages;
};

inline constexpr int kHistogramBuckets = 10;
inline constexpr int kMaxMessagesPerCode = 5;

struct BenchReport {
  RunConfig config;
  int64_t sent = 0, ok = 0, errors = 0;  // sent == ok + errors: every call completes with a status
  double total_seconds = 0;              // measurement start -> last call completed
  double rps = 0;                        // sent / total_seconds
  double gflops = 0;                     // ok * AttentionFlops(shape) / total_seconds / 1e9
  int64_t in_flight_waits = 0;
  LatencySummary latency;                // over OK calls; all zero when there are none
  std::vector<HistogramBucket> histogram;  // over OK calls
  LatencySplit split;
  std::vector<StatusSummary> statuses;   // ascending code
  // grpc.health.v1 Check round trips measured right after the load (health_calls == 0: not measured).
  int64_t health_calls = 0;
  LatencySummary health;
};

// fastest/slowest/mean/stddev and nearest-rank percentiles of `latencies` (any order); all zero when empty.
LatencySummary SummarizeLatencies(std::vector<double> latencies);

// Nearest-rank percentile of ascending `sorted`: sorted[ceil(p / 100 * n) - 1], so p50 <= p90 <= ... <= max.
// 0 when empty.
double Percentile(const std::vector<double>& sorted, double p);

// `buckets` buckets from sorted.front() to sorted.back(), log-spaced (each bound a constant factor above the last;
// linear if sorted.front() <= 0); one bucket when front == back. Counts add up to sorted.size(). Empty when sorted
// is.
std::vector<HistogramBucket> Histogram(const std::vector<double>& sorted, int buckets);

BenchReport Summarize(const RunConfig& config, const LoadResult& result);

// A human-readable report per run, then (for a sweep) a one-line-per-run table.
std::string FormatPretty(const std::vector<BenchReport>& reports);
// One JSON object for a single run, an array of them for a sweep; times in milliseconds.
std::string FormatJson(const std::vector<BenchReport>& reports);
// A header line and one line per run.
std::string FormatCsv(const std::vector<BenchReport>& reports);

}  // namespace mha

#endif  // MHA_CLIENT_BENCH_REPORT_H_
