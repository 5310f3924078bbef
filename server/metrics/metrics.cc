#include "server/metrics/metrics.h"

#include <exception>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace mha {
namespace {

// 50 us to about 52 s, doubling: covers a tiny inline call and a long batch alike.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = [] {
    auto* b = new prometheus::Histogram::BucketBoundaries();
    for (double bound = 50e-6; bound < 60; bound *= 2) b->push_back(bound);
    return b;
  }();
  return *buckets;
}

std::string Str(absl::string_view s) { return std::string(s.data(), s.size()); }

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ServerMetrics::ServerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("mha_requests_total")
                    .Help("Calls finished, by rpc, gRPC status code and backend")
                    .Register(*registry_)),
      duration_(prometheus::BuildHistogram()
                    .Name("mha_request_duration_seconds")
                    .Help("Server-side latency of a call: validation, queue and compute")
                    .Register(*registry_)),
      compute_(prometheus::BuildHistogram()
                   .Name("mha_compute_seconds")
                   .Help("Time inside the backend, including dtype conversions")
                   .Register(*registry_)),
      flops_(prometheus::BuildCounter()
                 .Name("mha_flops_total")
                 .Help("FLOPs of successful calls as AttentionFlops counts them (projections, and attention over the "
                       "query-key pairs causal masking leaves visible); its rate is the achieved FLOP/s")
                 .Register(*registry_)),
      queue_depth_(prometheus::BuildGauge()
                       .Name("mha_queue_depth")
                       .Help("Requests waiting for the compute thread")
                       .Register(*registry_)
                       .Add({})),
      batch_size_(prometheus::BuildHistogram()
                      .Name("mha_batch_size")
                      .Help("Calls computed together in one backend call (1 when not batched), per backend call")
                      .Register(*registry_)
                      .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128})),
      sessions_open_(
          prometheus::BuildGauge().Name("mha_sessions_open").Help("KV-cache sessions open").Register(*registry_).Add({})),
      cache_used_(prometheus::BuildGauge()
                      .Name("mha_kv_cache_used_bytes")
                      .Help("Bytes of the sessions' block pool in blocks in use")
                      .Register(*registry_)
                      .Add({})),
      cache_capacity_(prometheus::BuildGauge()
                          .Name("mha_kv_cache_capacity_bytes")
                          .Help("Bytes of the sessions' block pool (--kv_cache_mb)")
                          .Register(*registry_)
                          .Add({})),
      cache_shared_(prometheus::BuildGauge()
                        .Name("mha_kv_cache_shared_blocks")
                        .Help("Cache blocks referenced by more than one session (forks share them copy-on-write)")
                        .Register(*registry_)
                        .Add({})),
      tokens_appended_(prometheus::BuildCounter()
                           .Name("mha_session_tokens_appended_total")
                           .Help("Tokens Extend calls appended to session caches")
                           .Register(*registry_)
                           .Add({})),
      evictions_(prometheus::BuildCounter()
                     .Name("mha_session_evictions_total")
                     .Help("Sessions the server ended, by reason: idle_timeout, cache_full (least recently used "
                           "idle sessions evicted to make room), or session_limit (evicted at --max_sessions for a "
                           "token below its share)")
                     .Register(*registry_)),
      extend_items_(prometheus::BuildHistogram()
                        .Name("mha_extend_items")
                        .Help("Items (sessions) per Extend call")
                        .Register(*registry_)
                        .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256})),
      prefix_blocks_(AddGauge(*registry_, "mha_prefix_cache_blocks",
                              "Cache blocks findable by prefix key (CreateSessionRequest.prefix_keys)")),
      prefix_bytes_(AddGauge(*registry_, "mha_prefix_cache_bytes", "Bytes of the blocks findable by prefix key")),
      prefix_idle_bytes_(AddGauge(*registry_, "mha_prefix_cache_idle_bytes",
                                  "Of those, bytes in blocks no session references (evicted first)")),
      prefix_tokens_(prometheus::BuildCounter()
                         .Name("mha_prefix_cache_tokens_total")
                         .Help("Tokens CreateSession asked for by prefix_keys, by result: hit (attached from the "
                               "cache) or miss (the client prefills them)")
                         .Register(*registry_)),
      prefix_evictions_(prometheus::BuildCounter()
                            .Name("mha_prefix_cache_evictions_total")
                            .Help("Idle prefix blocks evicted to make room (least recently used first)")
                            .Register(*registry_)
                            .Add({})) {
  for (const char* reason : {"idle_timeout", "cache_full", "session_limit"}) evictions_.Add({{"reason", reason}});
  for (const char* result : {"hit", "miss"}) prefix_tokens_.Add({{"result", result}});
}

absl::Status ServerMetrics::Serve(const std::string& address) {
  try {
    // An idle or slow connection holds one of civetweb's threads until its request times out (30 s by default:
    // four idle TCP connections blocked every scrape for 30 s). Eight threads, and 2 s to send a request; a scrape
    // waits at most that long behind any number of idle connections.
    exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", "8", "request_timeout_ms", "2000"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen ", address, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void ServerMetrics::RecordCall(absl::string_view rpc, absl::StatusCode code, absl::string_view backend,
                               double seconds, double compute_seconds, double flops) {
  const std::string rpc_name = Str(rpc), backend_name = Str(backend);
  requests_.Add({{"rpc", rpc_name}, {"code", absl::StatusCodeToString(code)}, {"backend", backend_name}})
      .Increment();
  duration_.Add({{"rpc", rpc_name}}, LatencyBuckets()).Observe(seconds);
  if (backend_name.empty() || code != absl::StatusCode::kOk) return;
  compute_.Add({{"backend", backend_name}}, LatencyBuckets()).Observe(compute_seconds);
  flops_.Add({{"backend", backend_name}}).Increment(flops);
}

void ServerMetrics::SetQueueDepth(int depth) { queue_depth_.Set(depth); }

void ServerMetrics::RecordBatch(int calls) { batch_size_.Observe(calls); }

void ServerMetrics::SetSessions(int open, int64_t used_bytes, int64_t capacity_bytes, int64_t shared_blocks) {
  sessions_open_.Set(open);
  cache_used_.Set(static_cast<double>(used_bytes));
  cache_capacity_.Set(static_cast<double>(capacity_bytes));
  cache_shared_.Set(static_cast<double>(shared_blocks));
}

void ServerMetrics::SetPrefixCache(int64_t blocks, int64_t bytes, int64_t idle_bytes) {
  prefix_blocks_.Set(static_cast<double>(blocks));
  prefix_bytes_.Set(static_cast<double>(bytes));
  prefix_idle_bytes_.Set(static_cast<double>(idle_bytes));
}

void ServerMetrics::RecordPrefixLookup(int64_t hit_tokens, int64_t miss_tokens) {
  prefix_tokens_.Add({{"result", "hit"}}).Increment(static_cast<double>(hit_tokens));
  prefix_tokens_.Add({{"result", "miss"}}).Increment(static_cast<double>(miss_tokens));
}

void ServerMetrics::RecordPrefixEviction() { prefix_evictions_.Increment(); }

void ServerMetrics::RecordTokensAppended(int64_t tokens) { tokens_appended_.Increment(static_cast<double>(tokens)); }

void ServerMetrics::RecordEviction(absl::string_view reason) { evictions_.Add({{"reason", Str(reason)}}).Increment(); }

void ServerMetrics::RecordExtendItems(int items) { extend_items_.Observe(items); }

std::string ServerMetrics::Text() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

}  // namespace mha
