// Prometheus metrics of the server (prometheus-cpp), served as text at http://<metrics_listen>/metrics when
// ServerOptions::metrics_listen is set. Thread-safe: every method may be called from any thread.
//
//   mha_requests_total{rpc, code, backend}          calls finished, by gRPC status code name
//   mha_request_duration_seconds{rpc}               handler latency: validation + queue + compute
//   mha_compute_seconds{backend}                    time inside the backend
//   mha_flops_total{backend}                        AttentionFlops of OK calls (rate = FLOP/s)
//   mha_queue_depth                                 requests waiting for the compute thread
//   mha_batch_size                                  calls computed together per backend call (request batching)
//   mha_sessions_open                               KV-cache sessions open
//   mha_kv_cache_used_bytes, mha_kv_cache_capacity_bytes  the sessions' block pool: bytes of blocks in use, of all
//   mha_kv_cache_shared_blocks                      blocks referenced by more than one session (forks)
//   mha_session_tokens_appended_total               tokens Extend calls appended to caches
//   mha_session_evictions_total{reason}             sessions ended by the server: idle_timeout, cache_full,
//                                                   session_limit, shutdown
//   mha_extend_items                                items (sessions) per Extend call
#ifndef MHA_SERVER_METRICS_METRICS_H_
#define MHA_SERVER_METRICS_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mha {

class ServerMetrics {
 public:
  ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // Starts the HTTP endpoint on `address` (host:port; port 0 picks one). UNAVAILABLE if it cannot bind.
  absl::Status Serve(const std::string& address);
  int port() const { return port_; }  // 0 until Serve succeeds

  // One finished call. `backend` is empty for calls that reached none (rejected input, layer management);
  // compute_seconds and flops are counted only when compute ran.
  void RecordCall(absl::string_view rpc, absl::StatusCode code, absl::string_view backend, double seconds,
                  double compute_seconds, double flops);
  void SetQueueDepth(int depth);
  // One backend call that computed `calls` calls together.
  void RecordBatch(int calls);
  // The session store's state after a change.
  void SetSessions(int open, int64_t used_bytes, int64_t capacity_bytes, int64_t shared_blocks);
  void RecordTokensAppended(int64_t tokens);
  // A session the server ended: `reason` is "idle_timeout", "cache_full", "session_limit" or "shutdown".
  void RecordEviction(absl::string_view reason);
  void RecordExtendItems(int items);
  // The prefix index after a change; a CreateSession's prefix_keys found (hit) and not (miss), in tokens; an idle
  // prefix block evicted.
  void SetPrefixCache(int64_t blocks, int64_t bytes, int64_t idle_bytes);
  void RecordPrefixLookup(int64_t hit_tokens, int64_t miss_tokens);
  void RecordPrefixEviction();

  // The current metrics in Prometheus' text format (what /metrics serves).
  std::string Text() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Histogram>& compute_;
  prometheus::Family<prometheus::Counter>& flops_;
  prometheus::Gauge& queue_depth_;
  prometheus::Histogram& batch_size_;
  prometheus::Gauge& sessions_open_;
  prometheus::Gauge& cache_used_;
  prometheus::Gauge& cache_capacity_;
  prometheus::Gauge& cache_shared_;
  prometheus::Counter& tokens_appended_;
  prometheus::Family<prometheus::Counter>& evictions_;
  prometheus::Histogram& extend_items_;
  prometheus::Gauge& prefix_blocks_;
  prometheus::Gauge& prefix_bytes_;
  prometheus::Gauge& prefix_idle_bytes_;
  prometheus::Family<prometheus::Counter>& prefix_tokens_;
  prometheus::Counter& prefix_evictions_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_METRICS_METRICS_H_
