#include "server/app/options.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/backends/backend.h"
#include "server/base/status_macros.h"
#include "server/transport/listen_address.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

// The session flags' ranges.
absl::Status CheckSessionOptions(const ServerOptions& o) {
  const auto in = [](absl::string_view flag, int64_t value, int64_t lo, int64_t hi) {
    return value >= lo && value <= hi
               ? absl::OkStatus()
               : absl::InvalidArgumentError(absl::StrCat("--", flag, " must be in [", lo, ", ", hi, "], got ", value));
  };
  RETURN_IF_ERROR(in("kv_cache_mb", o.kv_cache_mb, 2, int64_t{1} << 24));
  RETURN_IF_ERROR(in("kv_block_tokens", o.kv_block_tokens, 1, 1024));
  if (o.kv_cache_memory != "auto" && o.kv_cache_memory != "host" && o.kv_cache_memory != kCudaBackend) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_memory must be auto, host or cuda, got '", o.kv_cache_memory, "'"));
  }
  if (o.prefix_cache_scope != "token" && o.prefix_cache_scope != "server") {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix_cache_scope must be token or server, got '", o.prefix_cache_scope, "'"));
  }
  RETURN_IF_ERROR(in("max_sessions", o.max_sessions, 1, 1 << 20));
  RETURN_IF_ERROR(in("max_sessions_per_token", o.max_sessions_per_token, 0, o.max_sessions));
  RETURN_IF_ERROR(in("kv_cache_mb_per_token", o.kv_cache_mb_per_token, 0, o.kv_cache_mb));
  RETURN_IF_ERROR(in("max_session_tokens", o.max_session_tokens, 1, 1 << 24));
  RETURN_IF_ERROR(in("session_idle_s", o.session_idle_s, 1, 30 * 86400));
  return in("max_session_idle_s", o.max_session_idle_s, o.session_idle_s, 30 * 86400);
}

}  // namespace

absl::Status CheckOptions(ServerOptions* options) {
  if (options->grpc_memory_mb < 0 ||
      (options->grpc_memory_mb > 0 && options->grpc_memory_mb < options->max_message_mb)) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc_memory_mb must be 0 (unlimited) or at least ",
                                                   "--max_message_mb (", options->max_message_mb, "), got ",
                                                   options->grpc_memory_mb));
  }
  if (options->log_max_calls_per_s < 0) return absl::InvalidArgumentError("--log_max_calls_per_s must be >= 0");
  if (options->max_streams_per_connection < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_streams_per_connection must be 0 (unlimited) or more, got ",
                                                   options->max_streams_per_connection));
  }
  if (options->max_message_mb < 1 || options->max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb must be in [1, 2047] (gRPC's limit is below 2 GiB), got ",
                     options->max_message_mb));
  }
  if (options->threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  if (options->threads == 0) options->threads = std::max(1u, std::thread::hardware_concurrency());
  if (options->max_queue_size < 1) return absl::InvalidArgumentError("--max_queue_size must be >= 1");
  if (options->max_queued_mb < 1) return absl::InvalidArgumentError("--max_queued_mb must be >= 1");
  if (options->max_inflight_mb < 1) return absl::InvalidArgumentError("--max_inflight_mb must be >= 1");
  if (options->max_batch_rows < 0) return absl::InvalidArgumentError("--max_batch_rows must be >= 0");
  if (options->max_queue_delay_us < 0) return absl::InvalidArgumentError("--max_queue_delay_us must be >= 0");
  if (options->max_prefill_chunk < 0) return absl::InvalidArgumentError("--max_prefill_chunk must be >= 0");
  if (options->prefill_quiet_ms < 0) return absl::InvalidArgumentError("--prefill_quiet_ms must be >= 0");
  if (!(options->default_deadline_s > 0)) return absl::InvalidArgumentError("--default_deadline_s must be > 0");
  if (!(options->shutdown_grace_s >= 0)) return absl::InvalidArgumentError("--shutdown_grace_s must be >= 0");
  if (!(options->drain_idle_s >= 0)) return absl::InvalidArgumentError("--drain_idle_s must be >= 0");
  if (options->max_shared_memory_regions < 0 || options->max_shared_memory_regions > kMaxMappedRegions) {
    return absl::InvalidArgumentError(absl::StrCat("--max_shared_memory_regions must be in [0, ", kMaxMappedRegions,
                                                   "], got ", options->max_shared_memory_regions));
  }
  if (options->max_shared_memory_mb < 1) return absl::InvalidArgumentError("--max_shared_memory_mb must be >= 1");
  if (options->cuda_device < 0) return absl::InvalidArgumentError("--cuda_device must be >= 0");
  if (options->cuda_streams < 1 || options->cuda_streams > 16) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_streams must be in [1, 16], got ", options->cuda_streams));
  }
  if (options->cuda_layer_cache_mb < 0) return absl::InvalidArgumentError("--cuda_layer_cache_mb must be >= 0");
  RETURN_IF_ERROR(CheckSessionOptions(*options));
  options->metrics_listen = OnListenHost(options->metrics_listen, options->listen);
  // Before anything slow starts: an address that cannot be served fails at once, in one line naming the flag.
  for (const auto& [flag, text] : {std::pair<const char*, const std::string&>{"--listen", options->listen},
                                   {"--health_listen", options->health_listen},
                                   {"--metrics_listen", options->metrics_listen}}) {
    if (text.empty()) continue;
    ASSIGN_OR_RETURN(const ListenAddress address, ParseListenAddress(flag, text));
    RETURN_IF_ERROR(CheckCanBind(flag, address));
  }
  if (!options->listen_unix.empty()) {
    ASSIGN_OR_RETURN(const ListenAddress address,
                     ParseListenAddress("--listen_unix", absl::StrCat("unix:", options->listen_unix)));
    RETURN_IF_ERROR(CheckCanBind("--listen_unix", address));
  }
  return absl::OkStatus();
}

BackendOptions BackendOptionsOf(const ServerOptions& options) {
  BackendOptions backend;
  backend.cuda_device = options.cuda_device;
  backend.cuda_streams = options.cuda_streams;
  backend.cuda_allow_tf32 = options.cuda_allow_tf32;
  backend.cuda_layer_cache_bytes = static_cast<int64_t>(options.cuda_layer_cache_mb) << 20;
  return backend;
}

SchedulerOptions SchedulerOptionsOf(const ServerOptions& options, const BackendRegistry& backends) {
  SchedulerOptions scheduling;
  scheduling.compute_threads = options.threads;
  // One concurrent thread per call a backend overlaps (the CUDA backend's lanes); none on a CPU-only server.
  for (const BackendEntry& entry : backends.entries()) {
    if (entry.available() && entry.backend->concurrent_calls() > 1) {
      scheduling.concurrent_threads += entry.backend->concurrent_calls();
    }
  }
  scheduling.max_queue = options.max_queue_size;
  scheduling.max_queued_bytes = static_cast<int64_t>(options.max_queued_mb) << 20;
  scheduling.inline_max_flops = options.inline_max_mflop * 1e6;
  scheduling.max_inflight_bytes = static_cast<int64_t>(options.max_inflight_mb) << 20;
  scheduling.max_batch_rows = options.max_batch_rows;
  scheduling.max_queue_delay = absl::Microseconds(options.max_queue_delay_us);
  return scheduling;
}

SessionStoreOptions SessionOptionsOf(const ServerOptions& o) {
  SessionStoreOptions s;
  s.capacity_bytes = static_cast<int64_t>(o.kv_cache_mb) << 20;
  s.block_tokens = o.kv_block_tokens;
  s.max_sessions = o.max_sessions;
  s.max_sessions_per_owner = o.max_sessions_per_token;
  s.max_bytes_per_owner = static_cast<int64_t>(o.kv_cache_mb_per_token) << 20;
  s.max_tokens = o.max_session_tokens;
  s.idle_timeout = absl::Seconds(o.session_idle_s);
  s.max_idle_timeout = absl::Seconds(o.max_session_idle_s);
  s.max_waiting = o.max_queue_size;
  s.max_waiting_bytes = static_cast<int64_t>(o.max_queued_mb) << 20;
  s.prefix_scope_server = o.prefix_cache_scope == "server";
  return s;
}

ValidationContext ValidationOf(const ServerOptions& options, const LayerStore* layers,
                               const BackendRegistry* backends, const SharedMemoryRegistry* shared_memory) {
  ValidationContext validation;
  validation.layers = layers;
  validation.backends = backends;
  validation.max_message_bytes = static_cast<int64_t>(options.max_message_mb) << 20;
  validation.max_scratch_bytes = static_cast<int64_t>(options.max_scratch_mb) << 20;
  validation.max_request_flops = options.max_request_gflop * 1e9;
  validation.max_reference_flops = options.max_reference_gflop * 1e9;
  validation.shared_memory = shared_memory;
  return validation;
}

absl::StatusOr<std::unique_ptr<CacheArena>> CacheArenaFor(const std::string& memory, const BackendRegistry& backends,
                                                          int64_t bytes) {
  if (memory == "host") return std::unique_ptr<CacheArena>();
  if (memory == kCudaBackend) {
    ASSIGN_OR_RETURN(Backend * cuda, backends.Find(kCudaBackend, "--kv_cache_memory"));
    absl::StatusOr<std::unique_ptr<CacheArena>> arena = cuda->AllocateCacheArena(bytes);
    if (!arena.ok()) {
      return absl::Status(arena.status().code(),
                          absl::StrCat("--kv_cache_memory: the cuda backend cannot hold the KV cache (--kv_cache_mb ",
                                       bytes >> 20, "): ", arena.status().message()));
    }
    return arena;
  }
  // The backend BACKEND_AUTO means computes the sessions: its memory, when it has some of its own. (A CPU default on a
  // GPU machine keeps the cache in host memory, which its kernels read fastest.)
  absl::StatusOr<Backend*> chosen = backends.Find(backends.DefaultName(), "--kv_cache_memory");
  if (!chosen.ok()) return std::unique_ptr<CacheArena>();
  absl::StatusOr<std::unique_ptr<CacheArena>> arena = (*chosen)->AllocateCacheArena(bytes);
  if (arena.ok()) return arena;
  // UNIMPLEMENTED: the backend reads host memory (every CPU backend).
  if (!absl::IsUnimplemented(arena.status())) {
    spdlog::warn("--kv_cache_memory auto: backend {} cannot hold the KV cache ({}); host memory instead",
                 backends.DefaultName(), arena.status().ToString());
  }
  return std::unique_ptr<CacheArena>();
}

}  // namespace mha
