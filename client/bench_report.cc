#include "client/bench_report.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace mha {
namespace {

double Ms(double seconds) { return seconds * 1e3; }

std::string CodeName(int code) { return absl::StatusCodeToString(static_cast<absl::StatusCode>(code)); }

std::string ModeString(const RunConfig& c) {
  if (c.open_loop) {
    return absl::StrFormat("open loop at %.6g req/s (at most %d in flight)", c.target_rps, c.max_in_flight);
  }
  return absl::StrFormat("closed loop, concurrency %d", c.concurrency);
}

nlohmann::ordered_json ToJson(const BenchReport& r) {
  const RunConfig& c = r.config;
  const AttentionShape& s = c.shape;
  nlohmann::ordered_json j;
  j["mode"] = c.open_loop ? "open" : "closed";
  j["concurrency"] = c.concurrency;
  j["target_rps"] = c.target_rps;
  j["max_in_flight"] = c.max_in_flight;
  j["connections"] = c.connections;
  j["warmup"] = c.warmup;
  j["target"] = c.target;
  j["weights"] = c.weights;
  j["protocol"] = c.protocol;
  j["request"] = {{"batch", s.batch},
                  {"query_len", s.q_len},
                  {"key_len", s.kv_len},
                  {"d_model", s.d_model},
                  {"d_kv_in", s.d_kv_in},
                  {"d_v_in", s.d_v_in},
                  {"num_heads", s.heads.num_heads},
                  {"num_kv_heads", s.heads.num_kv_heads},
                  {"head_dim", s.heads.head_dim},
                  {"causal", s.heads.causal},
                  {"gflop", AttentionFlops(s) / 1e9},
                  {"bytes", c.request_bytes}};
  j["count"] = {{"sent", r.sent}, {"ok", r.ok}, {"errors", r.errors}};
  j["total_s"] = r.total_seconds;
  j["rps"] = r.rps;
  j["gflops"] = r.gflops;
  j["in_flight_waits"] = r.in_flight_waits;
  const LatencySummary& l = r.latency;
  j["latency_ms"] = {{"fastest", Ms(l.fastest)}, {"slowest", Ms(l.slowest)}, {"mean", Ms(l.mean)},
                     {"stddev", Ms(l.stddev)},   {"p50", Ms(l.p50)},         {"p90", Ms(l.p90)},
                     {"p95", Ms(l.p95)},         {"p99", Ms(l.p99)},         {"p99_9", Ms(l.p999)}};
  nlohmann::ordered_json histogram = nlohmann::ordered_json::array();
  for (const HistogramBucket& b : r.histogram) {
    histogram.push_back({{"lower_ms", Ms(b.lower)}, {"upper_ms", Ms(b.upper)}, {"count", b.count}});
  }
  j["histogram"] = histogram;
  const LatencySplit& p = r.split;
  j["split_ms"] = {{"send_delay", Ms(p.send_delay)},         {"serialize", Ms(p.serialize)},
                   {"server_queue", Ms(p.server_queue)},     {"server_compute", Ms(p.server_compute)},
                   {"server_other", Ms(p.server_other)},     {"deserialize", Ms(p.deserialize)},
                   {"other", Ms(p.other)}};
  nlohmann::ordered_json statuses = nlohmann::ordered_json::array();
  for (const StatusSummary& st : r.statuses) {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    for (const auto& [message, count] : st.messages) messages.push_back({{"message", message}, {"count", count}});
    statuses.push_back({{"code", CodeName(st.code)}, {"count", st.count}, {"messages", messages}});
  }
  j["status"] = statuses;
  if (r.health_calls > 0) {
    const LatencySummary& h = r.health;
    j["health_rtt_ms"] = {{"calls", r.health_calls}, {"mean", Ms(h.mean)}, {"p50", Ms(h.p50)},
                          {"p90", Ms(h.p90)},        {"p99", Ms(h.p99)},   {"fastest", Ms(h.fastest)}};
  }
  return j;
}

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  // The epsilon keeps decimal percentiles exact: 99.9% of 1000 is rank 999, not ceil(999.0000000000001).
  const double rank = std::ceil(p / 100.0 * static_cast<double>(sorted.size()) - 1e-9);
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(sorted.size()))) - 1;
  return sorted[index];
}

std::vector<HistogramBucket> Histogram(const std::vector<double>& sorted, int buckets) {
  std::vector<HistogramBucket> out;
  if (sorted.empty()) return out;
  const double lo = sorted.front(), hi = sorted.back();
  if (!(hi > lo) || buckets <= 1) return {HistogramBucket{lo, hi, static_cast<int64_t>(sorted.size())}};
  // Latencies have long tails: log-spaced bounds (a constant ratio) keep both the bulk and the tail readable.
  // Linear bounds when the fastest is not positive.
  const bool log_spaced = lo > 0;
  auto bound = [&](int i) {
    if (i == buckets) return hi;
    const double f = static_cast<double>(i) / buckets;
    return log_spaced ? lo * std::pow(hi / lo, f) : lo + (hi - lo) * f;
  };
  for (int i = 0; i < buckets; ++i) out.push_back(HistogramBucket{bound(i), bound(i + 1), 0});
  size_t i = 0;
  for (double x : sorted) {  // ascending, so the bucket index only moves forward
    while (i + 1 < out.size() && x > out[i].upper) ++i;
    out[i].count++;
  }
  return out;
}

LatencySummary SummarizeLatencies(std::vector<double> latencies) {
  LatencySummary l;
  if (latencies.empty()) return l;
  std::sort(latencies.begin(), latencies.end());
  const double n = static_cast<double>(latencies.size());
  double sum = 0;
  for (double x : latencies) sum += x;
  l.fastest = latencies.front();
  l.slowest = latencies.back();
  l.mean = sum / n;
  double squares = 0;
  for (double x : latencies) squares += (x - l.mean) * (x - l.mean);
  l.stddev = std::sqrt(squares / n);
  l.p50 = Percentile(latencies, 50);
  l.p90 = Percentile(latencies, 90);
  l.p95 = Percentile(latencies, 95);
  l.p99 = Percentile(latencies, 99);
  l.p999 = Percentile(latencies, 99.9);
  return l;
}

BenchReport Summarize(const RunConfig& config, const LoadResult& result) {
  BenchReport r;
  r.config = config;
  r.sent = static_cast<int64_t>(result.samples.size());
  r.total_seconds = result.elapsed;
  r.in_flight_waits = result.in_flight_waits;

  std::vector<double> latencies;
  std::map<int, std::map<std::string, int64_t>> messages_by_code;
  std::map<int, int64_t> count_by_code;
  LatencySplit& split = r.split;
  for (const CallSample& s : result.samples) {
    ++count_by_code[s.code];
    if (s.code != 0) {
      ++messages_by_code[s.code][s.message];
      continue;
    }
    latencies.push_back(s.latency);
    split.send_delay += s.send_delay;
    split.serialize += s.serialize;
    split.server_queue += s.server_queue;
    split.server_compute += s.server_compute;
    if (s.server_handler > 0) {
      split.server_other += std::max(0.0, s.server_handler - s.server_queue - s.server_compute);
    }
    split.deserialize += s.deserialize;
  }
  r.ok = static_cast<int64_t>(latencies.size());
  r.errors = r.sent - r.ok;
  for (const auto& [code, count] : count_by_code) {
    StatusSummary st;
    st.code = code;
    st.count = count;
    for (const auto& entry : messages_by_code[code]) st.messages.push_back(entry);
    std::stable_sort(st.messages.begin(), st.messages.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    if (st.messages.size() > kMaxMessagesPerCode) st.messages.resize(kMaxMessagesPerCode);
    r.statuses.push_back(std::move(st));
  }

  if (r.total_seconds > 0) {
    r.rps = static_cast<double>(r.sent) / r.total_seconds;
    r.gflops = static_cast<double>(r.ok) * AttentionFlops(config.shape) / r.total_seconds / 1e9;
  }
  if (latencies.empty()) return r;

  std::sort(latencies.begin(), latencies.end());
  const double n = static_cast<double>(latencies.size());
  r.latency = SummarizeLatencies(latencies);
  const LatencySummary& l = r.latency;
  r.histogram = Histogram(latencies, kHistogramBuckets);

  split.send_delay /= n;
  split.serialize /= n;
  split.server_queue /= n;
  split.server_compute /= n;
  split.server_other /= n;
  split.deserialize /= n;
  split.other = l.mean - split.send_delay - split.serialize - split.server_queue - split.server_compute -
                split.server_other - split.deserialize;
  return r;
}

std::string FormatPretty(const std::vector<BenchReport>& reports) {
  std::string out;
  for (const BenchReport& r : reports) {
    const RunConfig& c = r.config;
    const LatencySummary& l = r.latency;
    absl::StrAppendFormat(&out, "Summary: %s, %d connection%s, target %s, %s protocol\n", ModeString(c),
                          c.connections, c.connections == 1 ? "" : "s", c.target, c.protocol);
    absl::StrAppendFormat(&out, "  Request:      %s, %s, %.4g GFLOP, %d bytes\n", c.weights,
                          AttentionShapeString(c.shape), AttentionFlops(c.shape) / 1e9, c.request_bytes);
    absl::StrAppendFormat(&out, "  Count:        %d (ok %d, errors %d)%s\n", r.sent, r.ok, r.errors,
                          c.warmup > 0 ? absl::StrFormat(", after %d warmup calls", c.warmup) : "");
    absl::StrAppendFormat(&out, "  Total:        %.3f s\n", r.total_seconds);
    absl::StrAppendFormat(&out, "  Requests/sec: %.2f\n", r.rps);
    absl::StrAppendFormat(&out, "  Attention:    %.2f GFLOP/s\n", r.gflops);
    if (c.open_loop) absl::StrAppendFormat(&out, "  Held back:    %d calls waited for a free in-flight slot\n",
                                           r.in_flight_waits);
    absl::StrAppendFormat(&out, "  Fastest:      %.3f ms\n  Slowest:      %.3f ms\n  Average:      %.3f ms"
                                " (stddev %.3f ms)\n",
                          Ms(l.fastest), Ms(l.slowest), Ms(l.mean), Ms(l.stddev));
    absl::StrAppendFormat(&out, "Latency distribution%s:\n",
                          c.open_loop ? " (from each call's intended send time)" : "");
    for (const auto& [name, value] : {std::pair<const char*, double>{"p50", l.p50},
                                      {"p90", l.p90}, {"p95", l.p95}, {"p99", l.p99}, {"p99.9", l.p999}}) {
      absl::StrAppendFormat(&out, "  %-6s %10.3f ms\n", name, Ms(value));
    }
    if (!r.histogram.empty()) {
      out += "Histogram (ms):\n";
      int64_t most = 0;
      for (const HistogramBucket& b : r.histogram) most = std::max(most, b.count);
      for (const HistogramBucket& b : r.histogram) {
        const int bar = most > 0 ? static_cast<int>(std::lround(40.0 * static_cast<double>(b.count) / most)) : 0;
        absl::StrAppendFormat(&out, "  %10.3f [%7d] |%s\n", Ms(b.upper), b.count, std::string(bar, '#'));
      }
    }
    const LatencySplit& p = r.split;
    out += "Latency split (mean per OK call):\n";
    if (c.open_loop) absl::StrAppendFormat(&out, "  send delay         %10.3f ms\n", Ms(p.send_delay));
    absl::StrAppendFormat(&out,
                          "  client serialize   %10.3f ms\n  server queue       %10.3f ms\n"
                          "  server compute     %10.3f ms\n  server other       %10.3f ms  (validation, response)\n"
                          "  client deserialize %10.3f ms\n"
                          "  other              %10.3f ms  (network, HTTP/2, gRPC parse/serialize on the server)\n",
                          Ms(p.serialize), Ms(p.server_queue), Ms(p.server_compute), Ms(p.server_other),
                          Ms(p.deserialize), Ms(p.other));
    if (r.health_calls > 0) {
      absl::StrAppendFormat(&out,
                            "Health-check round trip (%d sequential calls, same run; the floor of any call):\n"
                            "  p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, mean %.3f ms\n",
                            r.health_calls, Ms(r.health.p50), Ms(r.health.p90), Ms(r.health.p99), Ms(r.health.mean));
    }
    out += "Status codes:\n";
    for (const StatusSummary& st : r.statuses) {
      absl::StrAppendFormat(&out, "  [%s] %d\n", CodeName(st.code), st.count);
      for (const auto& [message, count] : st.messages) {
        absl::StrAppendFormat(&out, "      %d x %s\n", count, message);
      }
    }
    out += "\n";
  }
  if (reports.size() > 1) {
    absl::StrAppendFormat(&out, "%11s %8s %10s %10s %10s %10s %10s %10s\n", "concurrency", "errors", "req/s",
                          "GFLOP/s", "mean ms", "p50 ms", "p99 ms", "p99.9 ms");
    for (const BenchReport& r : reports) {
      absl::StrAppendFormat(&out, "%11d %8d %10.2f %10.2f %10.3f %10.3f %10.3f %10.3f\n", r.config.concurrency,
                            r.errors, r.rps, r.gflops, Ms(r.latency.mean), Ms(r.latency.p50), Ms(r.latency.p99),
                            Ms(r.latency.p999));
    }
  }
  return out;
}

std::string FormatJson(const std::vector<BenchReport>& reports) {
  if (reports.size() == 1) return ToJson(reports[0]).dump(2) + "\n";
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const BenchReport& r : reports) all.push_back(ToJson(r));
  return all.dump(2) + "\n";
}

std::string FormatCsv(const std::vector<BenchReport>& reports) {
  std::string out =
      "mode,concurrency,target_rps,connections,sent,ok,errors,total_s,rps,gflops,fastest_ms,mean_ms,p50_ms,p90_ms,"
      "p95_ms,p99_ms,p99_9_ms,slowest_ms,send_delay_ms,serialize_ms,server_queue_ms,server_compute_ms,"
      "server_other_ms,deserialize_ms,other_ms\n";
  for (const BenchReport& r : reports) {
    const LatencySummary& l = r.latency;
    const LatencySplit& p = r.split;
    absl::StrAppendFormat(&out, "%s,%d,%.6g,%d,%d,%d,%d,%.6f,%.3f,%.3f", r.config.open_loop ? "open" : "closed",
                          r.config.concurrency, r.config.target_rps, r.config.connections, r.sent, r.ok, r.errors,
                          r.total_seconds, r.rps, r.gflops);
    for (double v : {l.fastest, l.mean, l.p50, l.p90, l.p95, l.p99, l.p999, l.slowest, p.send_delay, p.serialize,
                     p.server_queue, p.server_compute, p.server_other, p.deserialize, p.other}) {
      absl::StrAppendFormat(&out, ",%.4f", Ms(v));
    }
    out += "\n";
  }
  return out;
}

}  // namespace mha
