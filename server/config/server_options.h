// Every knob of the server in one place, with its default; flags.cc defines one flag per field (same name, this
// default, the help text) and tests set fields directly.
#ifndef MHA_SERVER_CONFIG_SERVER_OPTIONS_H_
#define MHA_SERVER_CONFIG_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

namespace mha {

struct ServerOptions {
  // host:port to listen on. Port 0 picks a free port (see port_file).
  std::string listen = "127.0.0.1:50051";
  // When non-empty, the same service is also served on this Unix socket (a path), for callers on the same host (a
  // model runner beside the server): no TCP stack on the way, no TLS (the socket file's permissions guard it),
  // tokens as on --listen.
  std::string listen_unix;
  // When non-empty, the bound port is written to this file once the server accepts calls.
  std::string port_file;
  // When non-empty, Prometheus metrics are served over HTTP at http://<metrics_listen>/metrics (host:port; port 0
  // picks a free one). Off by default so that several servers on one machine do not compete for a port.
  std::string metrics_listen;
  // When non-empty, every *.safetensors file here is registered as a layer named after its file at start.
  std::string layers_dir;
  // What BACKEND_AUTO means: "auto" (CUDA when available, else CPU), "cpu", "reference" or "cuda".
  std::string backend = "auto";
  // Largest request or response message, in MiB. Also bounds what a request can make the server allocate.
  int max_message_mb = 256;
  // Compressed requests (gzip, deflate) are refused with UNIMPLEMENTED unless this is set: gRPC inflates a message
  // before any handler or limit of ours sees it, so a few hundred KiB of gzip can become a request of max_message_mb.
  // When set, the inflated size is bounded by max_message_mb like any message.
  bool accept_compressed = false;
  // Bounds on what gRPC buffers before any handler or check of ours runs (each message is read whole first):
  // concurrent calls per connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS), and gRPC's memory quota in MiB, past
  // which it stops reading from connections until memory is freed (and may cancel calls to reclaim it); 0 = gRPC's
  // defaults (unlimited). The quota must hold one message of max_message_mb.
  int max_streams_per_connection = 100;
  int grpc_memory_mb = 1024;
  // OpenMP threads per computation; 0 means all cores.
  int threads = 0;
  // Requests waiting for the compute thread beyond which calls get RESOURCE_EXHAUSTED, and the MiB of request
  // data they may hold together (so a queue of large requests cannot take the machine's memory).
  int max_queue_size = 64;
  int max_queued_mb = 1024;
  // Total fp32 MiB of all registered layers, and how many layers at most.
  int max_layer_mb = 4096;
  int max_layers = 256;
  // Call log lines per second at most (the rest are counted, and the next line says how many); 0 = every call.
  int log_max_calls_per_s = 1000;
  // Working memory a request may need beyond its own tensors (Backend::WorkspaceBytes), in MiB.
  int max_scratch_mb = 2048;
  // Requests needing at most this many MFLOP run right on the gRPC thread that received them, skipping the hand-off
  // to the compute thread (about 20-50 us of compute; the hand-off costs as much), when their backend runs them
  // single-threaded (Backend::inline_max_flops, which also bounds this option). 0 sends every request through the
  // compute thread.
  double inline_max_mflop = 4;
  // Work a single request may ask for (AttentionFlops), in GFLOP, on the CPU backend and on the reference backend
  // (plain loops at about 1 GFLOP/s: its limit keeps one call to seconds).
  double max_request_gflop = 4000;
  double max_reference_gflop = 20;
  // Deadline of a call whose client set none, in seconds: admission and cancellation use it like a client's.
  double default_deadline_s = 120;
  // Memory admitted calls may hold together (request, response and the backend's working memory), in MiB; a call
  // that would pass it is RESOURCE_EXHAUSTED unless nothing else is in flight.
  int max_inflight_mb = 4096;
  // After SIGTERM: health answers NOT_SERVING and new calls UNAVAILABLE at once; calls still running after this many
  // seconds are stopped, so that the process exits within it (below the Deployment's termination grace period).
  double shutdown_grace_s = 25;
  // After SIGTERM with sessions open, before the above: readiness fails at once but every call is still served
  // while sessions are open and session calls keep coming, so that their callers finish short work or move the
  // sessions elsewhere; the drain ends when none is open, when this many seconds pass without a session call, or
  // when --shutdown_grace_s is spent. 0 = no drain.
  double drain_idle_s = 2;
  // Health answers NOT_SERVING while the compute thread has run one call for longer than this many seconds with
  // others waiting (a wedged pod); 0 = never. This is the liveness answer (service ""): nothing else makes it fail.
  double stuck_after_s = 300;
  // Readiness (health service "mha.v1.Attention") also answers NOT_SERVING while this many calls or more wait to
  // compute (a saturated replica: load balancers should send new calls elsewhere), and from SIGTERM on; 0 = only
  // when stuck or draining.
  int ready_max_queue = 32;
  // gRPC keepalive pings on idle connections (seconds; 0 = gRPC's default), and the age after which a connection is
  // closed gracefully so that clients reconnect and spread over new replicas (gRFC A9; 0 = unlimited).
  double keepalive_s = 60;
  double max_connection_age_s = 0;
  // Request batching: waiting calls that compute the same function of each batch item (same layer, lengths, dtypes;
  // see AttentionPlan::batch_key) run as one backend call of at most this many rows (B Tq); 0 turns it off. A batch
  // waits up to max_queue_delay_us for more calls to join; 0 takes only the calls already waiting while the backend
  // was busy.
  int max_batch_rows = 512;
  int max_queue_delay_us = 0;
  // Chunked prefill: an Extend computes in steps of at most this many new tokens, and at most the attention work
  // (query-key pairs) of that many tokens on an empty cache, so that a step deep into a long context is as short as
  // the first; the queue's other calls (other sessions' decode steps) run, or join its step's batch, between its
  // steps. 0 computes each call whole. Calls that return weights or statistics, or have items that do not append,
  // compute whole.
  int max_prefill_chunk = 128;
  // A prefill step that has the backend to itself (nothing queued, no other call arrived for this long) is bounded
  // in rows alone: small steps deep into a long context cost the prefill more, which only buys something when others
  // wait. 0 (the default): steps are always bounded in work too, since decoders that start (or resume) after a quiet
  // spell otherwise wait out one long step (docs/PERFORMANCE.md, continuous batching: their p99 beside a prefill).
  // For replicas that mostly prefill.
  int prefill_quiet_ms = 0;
  // TLS on the gRPC port: PEM certificate chain and key (both or neither), and a PEM CA bundle that makes client
  // certificates required and verified (mutual TLS). Re-read on SIGHUP (MhaServer::Reload).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // When non-empty, grpc.health.v1.Health alone is also served here in plaintext and without tokens, for probes
  // that cannot speak TLS (Kubernetes' gRPC probes); it answers what the main port's health answers.
  std::string health_listen;
  // Shared-memory regions for tensors (RegisterSharedMemory): how many a client may register at once (0 turns
  // shared memory off, the default: it lets a caller name POSIX shared-memory objects of the server's host, so
  // enable it only where the callers share that host), and their MiB together (address space the server maps).
  int max_shared_memory_regions = 0;
  int max_shared_memory_mb = 4096;
  // Bearer tokens with roles (server/auth.h); empty = no token needed. Re-read on SIGHUP.
  std::string auth_tokens_file;
  // The CUDA backend (where compiled in): device ordinal; calls computed side by side, each on its own stream with
  // its own cuBLAS handle and buffers (the scheduler runs that many concurrent threads for it); TF32 tensor cores
  // for fp32 projections (about 10 bits of mantissa: fp32 requests then miss fp32 tolerances); device MiB for stored
  // layers kept resident, least recently used dropped beyond it, 0 meaning a quarter of the device's memory.
  int cuda_device = 0;
  int cuda_streams = 2;
  bool cuda_allow_tf32 = false;
  int cuda_layer_cache_mb = 0;
  // KV-cache sessions (CreateSession): the MiB of the pool their cache blocks come from (address space reserved at
  // start, memory taken as blocks fill; at least 2, one chunk), tokens per block (multiples of 16 take the decode
  // kernels; others gather), sessions open at once, tokens per cache (a session's max_tokens default and limit),
  // and the idle timeout a session gets when it asks for none and the longest it may ask for, in seconds.
  int kv_cache_mb = 1024;
  // Where that pool lives: "host" (memory the server reserves), "cuda" (CUDA managed memory on --cuda_device, which
  // the GPU's paged kernels read in place; the start fails without a usable CUDA backend), or "auto": the memory of
  // the default backend (what BACKEND_AUTO computes sessions on) when it lends some (CUDA where a GPU is present and
  // --backend leaves the choice to the server), else host.
  std::string kv_cache_memory = "auto";
  int kv_block_tokens = 32;
  int max_sessions = 1024;
  // Per token (--auth_tokens_file): its sessions and MiB of the pool at most; 0 leaves each token an equal share of
  // what several tokens contend for (see SessionStore), and no cap beyond it.
  int max_sessions_per_token = 0;
  int kv_cache_mb_per_token = 0;
  int max_session_tokens = 32768;
  int session_idle_s = 300;
  int max_session_idle_s = 3600;
  // Who finds the blocks published under prefix keys: "token" (the caller's token and cache_salt) or "server"
  // (every caller with the same cache_salt).
  std::string prefix_cache_scope = "token";
  // spdlog level: trace, debug, info, warn, error, critical or off.
  std::string log_level = "info";
};

}  // namespace mha

#endif  // MHA_SERVER_CONFIG_SERVER_OPTIONS_H_
