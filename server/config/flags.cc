#include "server/config/flags.h"

#include <string>

#include "absl/flags/flag.h"

namespace {
const mha::ServerOptions kDefaults;
}  // namespace

// The help texts are what `mha_server --helpfull` prints and docs/SERVER.md's flag table repeats (tests/flags_doc_test.py
// keeps the two in step).
ABSL_FLAG(std::string, listen, kDefaults.listen, "host:port to serve on; port 0 picks a free one");
ABSL_FLAG(std::string, listen_unix, kDefaults.listen_unix,
          "also serve on this Unix socket path, for callers on the same host (plaintext; tokens as on --listen)");
ABSL_FLAG(std::string, port_file, kDefaults.port_file, "write the bound port to this file once serving");
ABSL_FLAG(std::string, metrics_listen, kDefaults.metrics_listen,
          "serve Prometheus metrics at http://HOST:PORT/metrics; :PORT = on --listen's host; empty = off");
ABSL_FLAG(std::string, layers_dir, kDefaults.layers_dir,
          "register every *.safetensors file in this folder as a layer, and every transformers checkpoint folder in "
          "it (config.json and its safetensors) as layers <folder>.<i>");
ABSL_FLAG(std::string, backend, kDefaults.backend, "what BACKEND_AUTO means: auto, cpu, reference or cuda");
ABSL_FLAG(int, max_message_mb, kDefaults.max_message_mb, "largest request or response, MiB");
ABSL_FLAG(bool, accept_compressed, kDefaults.accept_compressed,
          "accept gzip/deflate-compressed requests (inflated up to --max_message_mb before any check); off: "
          "UNIMPLEMENTED");
ABSL_FLAG(int, max_streams_per_connection, kDefaults.max_streams_per_connection,
          "concurrent calls one connection may open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); 0 = unlimited");
ABSL_FLAG(int, grpc_memory_mb, kDefaults.grpc_memory_mb,
          "MiB gRPC may buffer (its resource quota): past it, calls are cancelled to reclaim memory; 0 = unlimited");
ABSL_FLAG(int, log_max_calls_per_s, kDefaults.log_max_calls_per_s,
          "call log lines per second at most; the next line says how many were left out; 0 = every call");
ABSL_FLAG(int, threads, kDefaults.threads, "compute threads per request; 0 = all cores");
ABSL_FLAG(int, max_queue_size, kDefaults.max_queue_size,
          "requests waiting to compute before RESOURCE_EXHAUSTED; also each caller's session calls waiting for their "
          "sessions");
ABSL_FLAG(int, max_queued_mb, kDefaults.max_queued_mb,
          "MiB of request data the waiting requests may hold (and each caller's waiting session calls)");
ABSL_FLAG(int, max_layer_mb, kDefaults.max_layer_mb, "total fp32 MiB of registered layers");
ABSL_FLAG(int, max_layers, kDefaults.max_layers, "registered layers at most, demo included");
ABSL_FLAG(int, max_shared_memory_regions, kDefaults.max_shared_memory_regions,
          "shared-memory regions clients may register for tensors (RegisterSharedMemory); 0 = off");
ABSL_FLAG(int, max_shared_memory_mb, kDefaults.max_shared_memory_mb,
          "MiB of registered shared-memory regions together");
ABSL_FLAG(int, max_scratch_mb, kDefaults.max_scratch_mb, "working memory one request may need, MiB");
ABSL_FLAG(double, inline_max_mflop, kDefaults.inline_max_mflop,
          "requests up to this many MFLOP run on the receiving gRPC thread; 0 = always the compute thread");
ABSL_FLAG(double, max_request_gflop, kDefaults.max_request_gflop,
          "GFLOP (projections + attention over visible pairs) one request may ask for");
ABSL_FLAG(double, max_reference_gflop, kDefaults.max_reference_gflop,
          "GFLOP one request may ask of the reference backend");
ABSL_FLAG(double, default_deadline_s, kDefaults.default_deadline_s, "deadline of a call whose client sets none, s");
ABSL_FLAG(int, max_inflight_mb, kDefaults.max_inflight_mb,
          "MiB that admitted calls may hold together: requests, responses, working memory");
ABSL_FLAG(double, shutdown_grace_s, kDefaults.shutdown_grace_s,
          "after SIGTERM, calls still running after this many seconds are stopped");
ABSL_FLAG(double, drain_idle_s, kDefaults.drain_idle_s,
          "after SIGTERM with sessions open, calls are still served until no session is open or none was called "
          "for this many seconds (within --shutdown_grace_s); 0 = no drain");
ABSL_FLAG(double, stuck_after_s, kDefaults.stuck_after_s,
          "health is NOT_SERVING while one call has computed this long with others waiting; 0 = never");
ABSL_FLAG(int, ready_max_queue, kDefaults.ready_max_queue,
          "readiness (health service mha.v1.Attention) is NOT_SERVING while this many calls wait; 0 = never");
ABSL_FLAG(double, keepalive_s, kDefaults.keepalive_s, "keepalive ping interval on idle connections, s");
ABSL_FLAG(double, max_connection_age_s, kDefaults.max_connection_age_s,
          "close connections gracefully after this many seconds (clients reconnect); 0 = never");
ABSL_FLAG(int, max_batch_rows, kDefaults.max_batch_rows,
          "rows (B x Tq) of waiting compatible calls computed together as one batch; 0 = no batching");
ABSL_FLAG(int, max_queue_delay_us, kDefaults.max_queue_delay_us,
          "how long a batch waits for more calls to join, us; 0 = only what already waits");
ABSL_FLAG(int, max_prefill_chunk, kDefaults.max_prefill_chunk,
          "an Extend computes at most this many new tokens (and their attention work on an empty cache) at a time, "
          "letting other calls' decode steps run between its chunks; 0 = whole calls");
ABSL_FLAG(int, prefill_quiet_ms, kDefaults.prefill_quiet_ms,
          "after this long without another call arriving, a prefill's steps are bounded by --max_prefill_chunk rows "
          "alone, not by their attention work; 0 = always by both");
ABSL_FLAG(std::string, tls_cert, kDefaults.tls_cert, "PEM certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, kDefaults.tls_key, "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, kDefaults.tls_client_ca,
          "PEM CA bundle: clients must present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, health_listen, kDefaults.health_listen,
          "also serve grpc.health.v1 alone here, plaintext and without tokens (for probes); empty = off");
ABSL_FLAG(std::string, auth_tokens_file, kDefaults.auth_tokens_file,
          "bearer tokens, one per line with an optional role (compute, admin); empty = no token needed");
ABSL_FLAG(int, cuda_device, kDefaults.cuda_device, "CUDA device ordinal of the cuda backend");
ABSL_FLAG(int, cuda_streams, kDefaults.cuda_streams,
          "calls the cuda backend computes side by side, each on its own stream and buffers (1-16)");
ABSL_FLAG(bool, cuda_allow_tf32, kDefaults.cuda_allow_tf32,
          "fp32 projections on the cuda backend may use TF32 tensor cores (about 10 bits of mantissa)");
ABSL_FLAG(int, cuda_layer_cache_mb, kDefaults.cuda_layer_cache_mb,
          "GPU MiB for stored layers kept resident on the cuda backend; 0 = a quarter of the GPU's memory");
ABSL_FLAG(int, kv_cache_mb, kDefaults.kv_cache_mb,
          "MiB of the pool KV-cache sessions' blocks come from (taken as blocks fill); at least 2");
ABSL_FLAG(std::string, kv_cache_memory, kDefaults.kv_cache_memory,
          "where the KV-cache pool lives: auto (the default backend's memory when it lends some: CUDA managed "
          "memory with a GPU), host, or cuda (fail at start without a usable CUDA backend)");
ABSL_FLAG(int, kv_block_tokens, kDefaults.kv_block_tokens,
          "tokens per KV-cache block (multiples of 16 take the decode kernels)");
ABSL_FLAG(int, max_sessions, kDefaults.max_sessions, "KV-cache sessions open at once at most");
ABSL_FLAG(int, max_sessions_per_token, kDefaults.max_sessions_per_token,
          "sessions one token may hold open at most; 0: no cap, but while several tokens hold sessions one below "
          "its equal share of --max_sessions may evict idle sessions of one above its share");
ABSL_FLAG(int, kv_cache_mb_per_token, kDefaults.kv_cache_mb_per_token,
          "MiB of the KV-cache pool one token's sessions may hold at most; 0: no cap, but while several tokens hold "
          "sessions one past its equal share of the pool evicts only its own idle sessions");
ABSL_FLAG(int, max_session_tokens, kDefaults.max_session_tokens,
          "tokens per session cache at most (a session's max_tokens default and limit)");
ABSL_FLAG(int, session_idle_s, kDefaults.session_idle_s,
          "a session's idle timeout when it asks for none, s; idle sessions expire");
ABSL_FLAG(std::string, prefix_cache_scope, kDefaults.prefix_cache_scope,
          "who finds the blocks a session published under prefix keys: token (sessions of the same token and "
          "cache_salt) or server (every caller with the same cache_salt)");
ABSL_FLAG(int, max_session_idle_s, kDefaults.max_session_idle_s, "the longest idle timeout a session may ask for, s");
ABSL_FLAG(std::string, log_level, kDefaults.log_level, "trace, debug, info, warn, error, critical or off");

namespace mha {

ServerOptions ServerOptionsFromFlags() {
  ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.listen_unix = absl::GetFlag(FLAGS_listen_unix);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.layers_dir = absl::GetFlag(FLAGS_layers_dir);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.accept_compressed = absl::GetFlag(FLAGS_accept_compressed);
  options.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  options.grpc_memory_mb = absl::GetFlag(FLAGS_grpc_memory_mb);
  options.log_max_calls_per_s = absl::GetFlag(FLAGS_log_max_calls_per_s);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  options.max_queued_mb = absl::GetFlag(FLAGS_max_queued_mb);
  options.max_layer_mb = absl::GetFlag(FLAGS_max_layer_mb);
  options.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.max_shared_memory_regions = absl::GetFlag(FLAGS_max_shared_memory_regions);
  options.max_shared_memory_mb = absl::GetFlag(FLAGS_max_shared_memory_mb);
  options.max_scratch_mb = absl::GetFlag(FLAGS_max_scratch_mb);
  options.inline_max_mflop = absl::GetFlag(FLAGS_inline_max_mflop);
  options.max_request_gflop = absl::GetFlag(FLAGS_max_request_gflop);
  options.max_reference_gflop = absl::GetFlag(FLAGS_max_reference_gflop);
  options.default_deadline_s = absl::GetFlag(FLAGS_default_deadline_s);
  options.max_inflight_mb = absl::GetFlag(FLAGS_max_inflight_mb);
  options.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  options.drain_idle_s = absl::GetFlag(FLAGS_drain_idle_s);
  options.stuck_after_s = absl::GetFlag(FLAGS_stuck_after_s);
  options.ready_max_queue = absl::GetFlag(FLAGS_ready_max_queue);
  options.keepalive_s = absl::GetFlag(FLAGS_keepalive_s);
  options.max_connection_age_s = absl::GetFlag(FLAGS_max_connection_age_s);
  options.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  options.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  options.max_prefill_chunk = absl::GetFlag(FLAGS_max_prefill_chunk);
  options.prefill_quiet_ms = absl::GetFlag(FLAGS_prefill_quiet_ms);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  options.cuda_streams = absl::GetFlag(FLAGS_cuda_streams);
  options.cuda_allow_tf32 = absl::GetFlag(FLAGS_cuda_allow_tf32);
  options.cuda_layer_cache_mb = absl::GetFlag(FLAGS_cuda_layer_cache_mb);
  options.kv_cache_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  options.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  options.kv_block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.max_sessions_per_token = absl::GetFlag(FLAGS_max_sessions_per_token);
  options.prefix_cache_scope = absl::GetFlag(FLAGS_prefix_cache_scope);
  options.kv_cache_mb_per_token = absl::GetFlag(FLAGS_kv_cache_mb_per_token);
  options.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.session_idle_s = absl::GetFlag(FLAGS_session_idle_s);
  options.max_session_idle_s = absl::GetFlag(FLAGS_max_session_idle_s);
  options.log_level = absl::GetFlag(FLAGS_log_level);
  return options;
}

}  // namespace mha
