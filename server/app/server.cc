#include "server/app/server.h"

#include <malloc.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server_builder.h"
#include "server/base/status_macros.h"
#include "server/scheduling/work_item.h"
#include "server/transport/listen_address.h"
#include "server/transport/token_gate.h"
#include "spdlog/spdlog.h"

namespace mha {
namespace {

// Whether a gRPC listen address (host:port, [v6]:port, unix:path) is reachable from this machine only.
bool IsLoopback(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

// Leaves gRPC's server reflection (registered for every builder by InitProtoReflectionServerBuilderPlugin) out of
// one server: the health-only port serves health alone, and where tokens are required reflection is not served,
// since gRPC 1.51 offers no hook that checks a token before the reflection service answers.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(
                                               plugin.get()) != nullptr;
                                  }),
                   plugins->end());
  }
};

// Every method it is asked for: UNIMPLEMENTED. The health-only port registers it beside the health service, which
// gRPC does not count as a polled service of its own.
class UnimplementedService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const std::string& method) {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, method + " is not served on the health-only port"));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal(context->method());
  }
};

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
  RETURN_IF_ERROR(in("max_sessions", o.max_sessions, 1, 1 << 20));
  RETURN_IF_ERROR(in("max_session_tokens", o.max_session_tokens, 1, 1 << 24));
  RETURN_IF_ERROR(in("session_idle_s", o.session_idle_s, 1, 30 * 86400));
  return in("max_session_idle_s", o.max_session_idle_s, o.session_idle_s, 30 * 86400);
}

SessionStoreOptions SessionOptions(const ServerOptions& o) {
  SessionStoreOptions s;
  s.capacity_bytes = static_cast<int64_t>(o.kv_cache_mb) << 20;
  s.block_tokens = o.kv_block_tokens;
  s.max_sessions = o.max_sessions;
  s.max_tokens = o.max_session_tokens;
  s.idle_timeout = absl::Seconds(o.session_idle_s);
  s.max_idle_timeout = absl::Seconds(o.max_session_idle_s);
  s.max_waiting = o.max_queue_size;
  s.max_waiting_bytes = static_cast<int64_t>(o.max_queued_mb) << 20;
  return s;
}

// The memory of the KV-cache pool (--kv_cache_memory): a backend's arena of `bytes`, or null for host memory the
// pool reserves itself. "cuda" fails, naming the flag, when the CUDA backend is not there or cannot lend the memory;
// "auto" takes the default backend's (BACKEND_AUTO's) when it lends some, and otherwise host memory.
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

// The flags' ranges, and the listen addresses parsed and bound once, so that a mistake fails the start at once, in one
// line naming the flag. Resolves --threads 0 and --metrics_listen :PORT.
absl::Status CheckOptions(ServerOptions* options) {
  if (options->grpc_memory_mb < 0 ||
      (options->grpc_memory_mb > 0 && options->grpc_memory_mb < options->max_message_mb)) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc_memory_mb must be 0 (unlimited) or at least --max_message_mb (",
                                                   options->max_message_mb, "), got ", options->grpc_memory_mb));
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
  return absl::OkStatus();
}

// The main port's channel arguments and options: message sizes, keepalive, connection age, calls per connection,
// gRPC's memory quota, no port sharing, no reflection where tokens are required, no compressed requests unless
// accepted.
void ConfigureMainPort(const ServerOptions& options, bool tokens_required, grpc::ServerBuilder* builder) {
  const int max_bytes = options.max_message_mb << 20;
  builder->SetMaxReceiveMessageSize(max_bytes);
  builder->SetMaxSendMessageSize(max_bytes);
  if (options.keepalive_s > 0) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_s * 1000));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  }
  if (options.max_connection_age_s > 0) {
    // Connections close gracefully (GOAWAY, then in-flight calls get this long) so that clients reconnect and
    // spread over the replicas that exist now (gRFC A9).
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(options.max_connection_age_s * 1000));
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                static_cast<int>(std::max(options.shutdown_grace_s, 1.0) * 1000));
  }
  if (options.max_streams_per_connection > 0) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  }
  if (options.grpc_memory_mb > 0) {
    grpc::ResourceQuota quota("mha_server");
    quota.Resize(static_cast<size_t>(options.grpc_memory_mb) << 20);
    builder->SetResourceQuota(quota);
  }
  // A port another process holds is an error, not a port to share (gRPC's default is SO_REUSEPORT).
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (tokens_required) builder->SetOption(std::make_unique<WithoutReflection>());
  if (!options.accept_compressed) {
    // gRPC checks a message's algorithm against these before inflating it, and fails the call (UNIMPLEMENTED).
    builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
    builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MhaServer>> MhaServer::Start(ServerOptions options) {
  RETURN_IF_ERROR(CheckOptions(&options));

  std::unique_ptr<MhaServer> server(new MhaServer());
  if (!options.auth_tokens_file.empty()) {
    ASSIGN_OR_RETURN(server->auth_, TokenAuth::FromFile(options.auth_tokens_file));
    spdlog::info("bearer tokens required: {} loaded from {}", server->auth_->size(), options.auth_tokens_file);
  }
  if (!options.tls_cert.empty() || !options.tls_key.empty() || !options.tls_client_ca.empty()) {
    ASSIGN_OR_RETURN(server->tls_, TlsServer::Create({options.tls_cert, options.tls_key, options.tls_client_ca}));
    spdlog::info("TLS with {}{}", options.tls_cert,
                 server->tls_->mutual() ? ", client certificates required (mutual TLS)" : "");
  }
  if (!options.listen.empty() && !IsLoopback(options.listen) && server->tls_ == nullptr &&
      server->auth_ == nullptr) {
    spdlog::warn("{} is reachable beyond this machine with neither TLS nor tokens: anyone who reaches it may "
                 "compute and load layers (see --tls_cert, --auth_tokens_file, docs/SECURITY.md)",
                 options.listen);
  }
  server->layers_ = std::make_unique<LayerStore>(static_cast<int64_t>(options.max_layer_mb) << 20,
                                                  options.max_layers);
  RETURN_IF_ERROR(server->layers_->Add(MakeDemoLayer()));
  if (!options.layers_dir.empty()) RETURN_IF_ERROR(server->layers_->LoadDirectory(options.layers_dir));

  BackendOptions backend_options;
  backend_options.cuda_device = options.cuda_device;
  backend_options.cuda_streams = options.cuda_streams;
  backend_options.cuda_allow_tf32 = options.cuda_allow_tf32;
  backend_options.cuda_layer_cache_bytes = static_cast<int64_t>(options.cuda_layer_cache_mb) << 20;
  server->backends_ = BackendRegistry::Create(backend_options);
  RETURN_IF_ERROR(server->backends_->SetDefault(options.backend, "--backend"));
  // Inline calls run on gRPC's threads, so only as large as a backend keeps single-threaded.
  double inline_limit = 0;
  for (const BackendEntry& entry : server->backends_->entries()) {
    spdlog::info("backend {}: {}", entry.name,
                 entry.available() ? entry.device : absl::StrCat("unavailable (", entry.detail, ")"));
    if (entry.available()) inline_limit = std::max(inline_limit, entry.backend->inline_max_flops());
  }
  if (!(options.inline_max_mflop >= 0 && options.inline_max_mflop * 1e6 <= inline_limit)) {
    return absl::InvalidArgumentError(absl::StrCat("--inline_max_mflop must be in [0, ", inline_limit / 1e6,
                                                   "] (what the backends run single-threaded), got ",
                                                   options.inline_max_mflop));
  }
  for (const auto& layer : server->layers_->List()) {
    const HeadSpec& heads = layer->shape.heads;
    spdlog::info("layer {}: d_model={} H={} Hkv={} d_k={} ({})", layer->name, layer->shape.d_model,
                 heads.num_heads, heads.num_kv_heads, heads.head_dim, layer->source);
  }

  server->metrics_ = std::make_unique<ServerMetrics>();
  if (!options.metrics_listen.empty()) RETURN_IF_ERROR(server->metrics_->Serve(options.metrics_listen));
  SchedulerOptions scheduling;
  scheduling.compute_threads = options.threads;
  // One concurrent thread per call a backend overlaps (the CUDA backend's lanes); none on a CPU-only server.
  for (const BackendEntry& entry : server->backends_->entries()) {
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
  server->scheduler_ = std::make_unique<Scheduler>(scheduling, server->metrics_.get());
  server->WarmUp();
  const SessionStoreOptions session_options = SessionOptions(options);
  ASSIGN_OR_RETURN(std::unique_ptr<CacheArena> cache_arena,
                   CacheArenaFor(options.kv_cache_memory, *server->backends_, session_options.capacity_bytes));
  server->sessions_ =
      std::make_unique<SessionStore>(session_options, server->metrics_.get(), std::move(cache_arena));
  spdlog::info("KV cache: {} MiB in {} (--kv_cache_memory {})", server->sessions_->capacity_bytes() >> 20,
               server->sessions_->cache_memory(), options.kv_cache_memory);
  server->service_ = std::make_unique<AttentionService>(options, server->layers_.get(), server->backends_.get(),
                                                        server->scheduler_.get(), server->metrics_.get(),
                                                        server->auth_.get(), server->sessions_.get());
  server->kserve_ = std::make_unique<KServeService>(
      server->service_.get(), [s = server.get()] { return s->live_.load(); },
      [s = server.get()] { return s->ready_.load(); });

  if (server->tls_ != nullptr && server->auth_ != nullptr) {
    // Calls without a valid token are refused on their metadata, before gRPC reads their messages.
    server->tls_->credentials()->SetAuthMetadataProcessor(std::make_shared<TokenGate>(server->auth_.get()));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ConfigureMainPort(options, server->auth_ != nullptr, &builder);
  if (!options.listen.empty()) {
    builder.AddListeningPort(options.listen,
                             server->tls_ != nullptr ? server->tls_->credentials() : grpc::InsecureServerCredentials(),
                             &server->port_);
  }
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->kserve_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || (!options.listen.empty() && server->port_ == 0)) {
    // CheckCanBind above passed: another process took the port since, or gRPC refused the address (it logs why).
    return absl::UnavailableError(absl::StrCat("--listen ", options.listen, ": gRPC could not serve there"));
  }
  if (!options.health_listen.empty()) RETURN_IF_ERROR(server->StartHealthServer(options.health_listen));
  if (!options.port_file.empty()) {
    const std::string tmp = options.port_file + ".tmp";
    std::ofstream(tmp) << server->port_ << "\n";
    std::rename(tmp.c_str(), options.port_file.c_str());  // readers never see a half-written file
  }
  server->options_ = std::move(options);
  server->SetServing("", true);
  server->SetServing(v1::Attention::service_full_name(), true);
  server->watchdog_ = std::thread([s = server.get()] { s->Watch(); });
  return server;
}

void MhaServer::Watch() {
  const absl::Duration limit = absl::Seconds(options_.stuck_after_s);
  const std::string readiness = v1::Attention::service_full_name();
  bool live = true, ready = true;
  int stalled_listener = -1;
  constexpr absl::Duration kListenerStall = absl::Seconds(10);
  for (int tick = 1; !stop_watch_.WaitForNotificationWithTimeout(absl::Milliseconds(250)); ++tick) {
    // Free pages of the allocator's arenas go back to the system every few seconds (it keeps them otherwise).
    if (tick % 12 == 0) malloc_trim(0);
    sessions_->ExpireIdle(absl::Now());
    const absl::Duration stuck = scheduler_->StuckFor();
    // A listener that no longer accepts never recovers (gRPC 1.51): liveness fails for good, so that the pod restarts.
    if (stalled_listener < 0) stalled_listener = listeners_.Stalled(absl::Now(), kListenerStall);
    const bool now_live = (options_.stuck_after_s <= 0 || stuck <= limit) && stalled_listener < 0;
    const int depth = scheduler_->QueueDepth();
    const bool now_ready = now_live && (options_.ready_max_queue <= 0 || depth < options_.ready_max_queue);
    if (now_live != live) {
      live = now_live;
      SetServing("", live);
      if (live) {
        spdlog::info("health: SERVING again, the compute thread moved on");
      } else if (stalled_listener >= 0) {
        spdlog::error("health: NOT_SERVING, a listening port (fd {}) has had connections waiting {} s without "
                      "accepting one; restart the server",
                      stalled_listener, absl::ToInt64Seconds(kListenerStall));
      } else {
        spdlog::error("health: NOT_SERVING, one call has computed for {} s with others waiting",
                      absl::ToInt64Seconds(stuck));
      }
    }
    if (now_ready != ready) {
      ready = now_ready;
      SetServing(readiness, ready);
      if (live) spdlog::info("readiness: {} ({} calls waiting)", ready ? "SERVING" : "NOT_SERVING", depth);
    }
  }
}

absl::Status MhaServer::StartHealthServer(const std::string& address) {
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetOption(std::make_unique<WithoutReflection>());
  unimplemented_ = std::make_unique<UnimplementedService>();
  builder.RegisterCallbackGenericService(unimplemented_.get());
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &health_port_);
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen: cannot listen on ", address));
  }
  return absl::OkStatus();
}

void MhaServer::SetServing(const std::string& service, bool serving) {
  if (service.empty()) live_ = serving;
  if (service == v1::Attention::service_full_name()) ready_ = serving;
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService(); health != nullptr) {
      health->SetServingStatus(service, serving);
    }
  }
}

void MhaServer::DrainSessions(absl::Time deadline) {
  SessionStore::Activity activity = sessions_ != nullptr ? sessions_->activity() : SessionStore::Activity();
  if (activity.open == 0 || options_.drain_idle_s <= 0) return;
  SetServing(v1::Attention::service_full_name(), false);
  spdlog::warn("shutdown: readiness NOT_SERVING; {} session(s) open, their calls served until none is open, {} s "
               "pass without a session call, or the grace ends",
               activity.open, options_.drain_idle_s);
  // Idle time counts from the later of the last session call and the drain's start: a session idle before SIGTERM
  // still gets its caller a chance to move it.
  const absl::Time start = absl::Now();
  const absl::Duration idle = absl::Seconds(options_.drain_idle_s);
  while (absl::Now() < deadline && activity.open > 0 &&
         (activity.in_use > 0 || absl::Now() - std::max(activity.last_used, start) < idle)) {
    absl::SleepFor(absl::Milliseconds(50));
    activity = sessions_->activity();
  }
  spdlog::info("shutdown: drain over, {} session(s) still open", activity.open);
}

MhaServer::~MhaServer() { Shutdown(); }

namespace {

// Runs one backend's WarmUp on the thread that computes its calls (the compute thread for a CPU backend), where
// its thread pools must start.
class WarmUpItem final : public WorkItem {
 public:
  WarmUpItem(Backend* backend, Scheduler* scheduler, absl::Notification* done)
      : WorkItem(0, absl::Now(), absl::InfiniteFuture()), scheduler_(scheduler), done_(done) {
    plan_.backend = backend;
    plan_.flops = std::numeric_limits<double>::infinity();  // never inline
    plan_.shapes = "warm-up";
  }
  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return false; }
  // Warms the backend up, then times the same computation again to seed the scheduler's rate for it.
  absl::Status Run(absl::Duration) override {
    const std::string name(plan_.backend->name());  // fmt cannot print abseil's own string_view
    const absl::Time start = absl::Now();
    absl::StatusOr<double> flops = plan_.backend->WarmUp();
    const absl::Time warm = absl::Now();
    if (flops.ok()) flops = plan_.backend->WarmUp();
    if (flops.ok()) {
      const double seconds = absl::ToDoubleSeconds(absl::Now() - warm);
      scheduler_->ObserveRate(plan_.backend, *flops, seconds);
      spdlog::info("{} backend warmed up in {} ms; {:.1f} GFLOP/s on a {:.3g} GFLOP call", name,
                   absl::ToInt64Milliseconds(warm - start), *flops / seconds / 1e9, *flops / 1e9);
    } else {
      spdlog::warn("{} backend warm-up failed: {}", name, flops.status().ToString());
    }
    done_->Notify();
    return flops.status();
  }
  void Reject(const absl::Status&) override { done_->Notify(); }

 private:
  AttentionPlan plan_;
  Scheduler* const scheduler_;
  absl::Notification* const done_;
};

}  // namespace

void MhaServer::WarmUp() {
  for (const BackendEntry& entry : backends_->entries()) {
    if (!entry.available()) continue;
    absl::Notification done;
    scheduler_->Submit(std::make_unique<WarmUpItem>(entry.backend.get(), scheduler_.get(), &done));
    done.WaitForNotification();
  }
  // Returns with the compute thread idle, so that nothing of the warm-up looks like a running call.
  scheduler_->AwaitIdle(absl::InfiniteDuration());
}

std::shared_ptr<grpc::Channel> MhaServer::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_mb << 20);
  args.SetMaxSendMessageSize(options_.max_message_mb << 20);
  return server_->InProcessChannel(args);
}

absl::Status MhaServer::Reload() {
  absl::Status first;
  if (auth_ != nullptr) {
    absl::Status status = auth_->Reload();
    if (status.ok()) {
      spdlog::info("reloaded {} bearer tokens from {}", auth_->size(), options_.auth_tokens_file);
    } else {
      spdlog::error("kept the previous tokens: {}", status.ToString());
      first.Update(status);
    }
  }
  if (tls_ != nullptr) {
    absl::Status status = tls_->Reload();
    if (status.ok()) {
      spdlog::info("reloaded the TLS files; new connections use them within a second");
    } else {
      spdlog::error("kept the previous TLS files: {}", status.ToString());
      first.Update(status);
    }
  }
  return first;
}

void MhaServer::Shutdown() { Shutdown(absl::Seconds(options_.shutdown_grace_s)); }

void MhaServer::Terminate() { Shutdown(absl::Seconds(options_.shutdown_grace_s), /*drain_sessions=*/true); }

void MhaServer::Shutdown(absl::Duration grace, bool drain_sessions) {
  if (shut_down_) return;
  shut_down_ = true;
  stop_watch_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
  if (server_ == nullptr) {
    scheduler_.reset();
    return;
  }
  const absl::Time deadline = absl::Now() + grace;
  if (drain_sessions) DrainSessions(deadline);
  // Load balancers see NOT_SERVING at once; gRPC refuses new calls (UNAVAILABLE) and waits for in-flight ones until
  // the grace deadline, when it cancels them and the scheduler stops what still computes or waits.
  live_ = false;
  ready_ = false;
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService(); health != nullptr) {
      health->Shutdown();
    }
  }
  if (scheduler_ != nullptr) scheduler_->Shutdown();
  absl::Notification drained;
  std::thread stopper([&] {
    if (drained.WaitForNotificationWithDeadline(deadline)) return;
    // Past the grace period: session calls still waiting for their sessions end too.
    if (sessions_ != nullptr) sessions_->sequencer().Shutdown();
    if (scheduler_ != nullptr) scheduler_->Abort();
  });
  server_->Shutdown(absl::ToChronoTime(deadline));
  drained.Notify();
  stopper.join();
  if (sessions_ != nullptr) {
    const SessionStore::Activity dropped = sessions_->EndAll("shutdown");
    spdlog::info("shutdown: dropped {} open session(s), {} bytes of cache", dropped.open, dropped.cache_bytes);
  }
  if (health_server_ != nullptr) health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
  // No connection is left to need them, and mha_server ends without destructors.
  if (tls_ != nullptr) tls_->RemoveCopies();
  scheduler_.reset();
}

}  // namespace mha
