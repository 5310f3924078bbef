#include "server/app/server.h"

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "server/app/options.h"
#include "server/app/warm_up.h"
#include "server/base/status_macros.h"
#include "server/transport/token_gate.h"
#include "spdlog/spdlog.h"

namespace mha {

absl::StatusOr<std::unique_ptr<MhaServer>> MhaServer::Start(ServerOptions options) {
  RETURN_IF_ERROR(CheckOptions(&options));
  std::unique_ptr<MhaServer> server(new MhaServer());
  server->options_ = std::move(options);
  RETURN_IF_ERROR(server->StartSecurity());
  RETURN_IF_ERROR(server->StartLayers());
  RETURN_IF_ERROR(server->StartBackends());
  RETURN_IF_ERROR(server->StartCompute());
  server->StartServices();
  RETURN_IF_ERROR(server->StartPorts());
  server->SetServing("", true);
  server->SetServing(v1::Attention::service_full_name(), true);
  server->watchdog_ = std::thread([s = server.get()] { s->Watch(); });
  return server;
}

absl::Status MhaServer::StartSecurity() {
  const ServerOptions& o = options_;
  if (!o.auth_tokens_file.empty()) {
    ASSIGN_OR_RETURN(auth_, TokenAuth::FromFile(o.auth_tokens_file));
    spdlog::info("bearer tokens required: {} loaded from {}", auth_->size(), o.auth_tokens_file);
  }
  if (!o.tls_cert.empty() || !o.tls_key.empty() || !o.tls_client_ca.empty()) {
    ASSIGN_OR_RETURN(tls_, TlsServer::Create({o.tls_cert, o.tls_key, o.tls_client_ca}));
    spdlog::info("TLS with {}{}", o.tls_cert, tls_->mutual() ? ", client certificates required (mutual TLS)" : "");
  }
  if (!o.listen.empty() && !IsLoopback(o.listen) && tls_ == nullptr && auth_ == nullptr) {
    spdlog::warn("{} is reachable beyond this machine with neither TLS nor tokens: anyone who reaches it may "
                 "compute and load layers (see --tls_cert, --auth_tokens_file, docs/SECURITY.md)",
                 o.listen);
  }
  return absl::OkStatus();
}

absl::Status MhaServer::StartLayers() {
  layers_ = std::make_unique<LayerStore>(static_cast<int64_t>(options_.max_layer_mb) << 20, options_.max_layers);
  RETURN_IF_ERROR(layers_->Add(MakeDemoLayer()));
  if (!options_.layers_dir.empty()) RETURN_IF_ERROR(layers_->LoadDirectory(options_.layers_dir));
  for (const auto& layer : layers_->List()) {
    const HeadSpec& heads = layer->shape.heads;
    spdlog::info("layer {}: d_model={} H={} Hkv={} d_k={} ({})", layer->name, layer->shape.d_model,
                 heads.num_heads, heads.num_kv_heads, heads.head_dim, layer->source);
  }
  return absl::OkStatus();
}

absl::Status MhaServer::StartBackends() {
  backends_ = BackendRegistry::Create(BackendOptionsOf(options_));
  RETURN_IF_ERROR(backends_->SetDefault(options_.backend, "--backend"));
  // Inline calls run on gRPC's threads, so only as large as a backend keeps single-threaded.
  double inline_limit = 0;
  for (const BackendEntry& entry : backends_->entries()) {
    spdlog::info("backend {}: {}", entry.name,
                 entry.available() ? entry.device : absl::StrCat("unavailable (", entry.detail, ")"));
    if (entry.available()) inline_limit = std::max(inline_limit, entry.backend->inline_max_flops());
  }
  if (!(options_.inline_max_mflop >= 0 && options_.inline_max_mflop * 1e6 <= inline_limit)) {
    return absl::InvalidArgumentError(absl::StrCat("--inline_max_mflop must be in [0, ", inline_limit / 1e6,
                                                   "] (what the backends run single-threaded), got ",
                                                   options_.inline_max_mflop));
  }
  return absl::OkStatus();
}

absl::Status MhaServer::StartCompute() {
  metrics_ = std::make_unique<ServerMetrics>();
  if (!options_.metrics_listen.empty()) RETURN_IF_ERROR(metrics_->Serve(options_.metrics_listen));
  scheduler_ = std::make_unique<Scheduler>(SchedulerOptionsOf(options_, *backends_), metrics_.get());
  // The first call is then not slow, and the scheduler knows each backend's speed.
  WarmUpBackends(*backends_, scheduler_.get());
  const SessionStoreOptions session_options = SessionOptionsOf(options_);
  ASSIGN_OR_RETURN(std::unique_ptr<CacheArena> cache_arena,
                   CacheArenaFor(options_.kv_cache_memory, *backends_, session_options.capacity_bytes));
  sessions_ = std::make_unique<SessionStore>(session_options, metrics_.get(), std::move(cache_arena));
  spdlog::info("KV cache: {} MiB in {} (--kv_cache_memory {})", sessions_->capacity_bytes() >> 20,
               sessions_->cache_memory(), options_.kv_cache_memory);
  return absl::OkStatus();
}

void MhaServer::StartServices() {
  shared_memory_ = std::make_unique<SharedMemoryRegistry>(options_.max_shared_memory_regions,
                                                          static_cast<int64_t>(options_.max_shared_memory_mb) << 20);
  edge_ = std::make_unique<CallEdge>(auth_.get(), metrics_.get(), options_.log_max_calls_per_s,
                                     absl::Seconds(options_.default_deadline_s));
  validation_ = ValidationOf(options_, layers_.get(), backends_.get(), shared_memory_.get());
  ServiceParts parts;
  parts.edge = edge_.get();
  parts.options = &options_;
  parts.validation = &validation_;
  parts.layers = layers_.get();
  parts.backends = backends_.get();
  parts.scheduler = scheduler_.get();
  parts.sessions = sessions_.get();
  parts.shared_memory = shared_memory_.get();
  parts.metrics = metrics_.get();
  service_ = std::make_unique<AttentionService>(parts);
  kserve_ = std::make_unique<KServeService>(parts, [this] { return live_.load(); }, [this] { return ready_.load(); });
}

absl::Status MhaServer::StartPorts() {
  if (tls_ != nullptr && auth_ != nullptr) {
    // Calls without a valid token are refused on their metadata, before gRPC reads their messages.
    tls_->credentials()->SetAuthMetadataProcessor(std::make_shared<TokenGate>(auth_.get()));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ConfigureMainPort(options_, auth_ != nullptr, &builder);
  if (!options_.listen.empty()) {
    builder.AddListeningPort(options_.listen,
                             tls_ != nullptr ? tls_->credentials() : grpc::InsecureServerCredentials(), &port_);
  }
  if (!options_.listen_unix.empty()) {
    builder.AddListeningPort("unix:" + options_.listen_unix, grpc::InsecureServerCredentials(), &unix_bound_);
  }
  builder.RegisterService(service_.get());
  builder.RegisterService(kserve_.get());
  server_ = builder.BuildAndStart();
  if (server_ != nullptr && !options_.listen_unix.empty() && unix_bound_ == 0) {
    return absl::UnavailableError(absl::StrCat("--listen_unix ", options_.listen_unix, ": gRPC could not serve there"));
  }
  if (server_ == nullptr || (!options_.listen.empty() && port_ == 0)) {
    // CheckOptions found the address free: another process took the port since, or gRPC refused the address (it
    // logs why).
    return absl::UnavailableError(absl::StrCat("--listen ", options_.listen, ": gRPC could not serve there"));
  }
  if (!options_.health_listen.empty()) {
    ASSIGN_OR_RETURN(health_, HealthOnlyPort::Start(options_.health_listen));
  }
  if (!options_.port_file.empty()) {
    const std::string tmp = options_.port_file + ".tmp";
    std::ofstream(tmp) << port_ << "\n";
    std::rename(tmp.c_str(), options_.port_file.c_str());  // readers never see a half-written file
  }
  return absl::OkStatus();
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

void MhaServer::SetServing(const std::string& service, bool serving) {
  if (service.empty()) live_ = serving;
  if (service == v1::Attention::service_full_name()) ready_ = serving;
  for (grpc::Server* server : {server_.get(), health_ != nullptr ? health_->server() : nullptr}) {
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

void MhaServer::StopWhenIdle(absl::Time deadline, absl::Notification* drained) {
  // gRPC's shutdown also waits for every connection to close after its GOAWAY, which an idle client that does not
  // poll its channel (grpcio between calls) answers seconds later: 3.6-4.5 s with nothing in flight (#54). Once no
  // call has been in progress for kIdleFor (a call gRPC had started but not yet handed to its handler would be
  // counted by then), nothing is left to wait for: the connections are closed.
  constexpr absl::Duration kPoll = absl::Milliseconds(10), kIdleFor = absl::Milliseconds(50);
  absl::Time idle_since = absl::InfiniteFuture();
  while (!drained->WaitForNotificationWithDeadline(std::min(deadline, absl::Now() + kPoll))) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      // Past the grace period: session calls still waiting for their sessions end too.
      if (sessions_ != nullptr) sessions_->sequencer().Shutdown();
      if (scheduler_ != nullptr) scheduler_->Abort();
      return;
    }
    if (edge_->calls_in_progress() > 0) {
      idle_since = absl::InfiniteFuture();
    } else if (idle_since == absl::InfiniteFuture()) {
      idle_since = now;
    } else if (now - idle_since >= kIdleFor) {
      grpc_server_cancel_all_calls(server_->c_server());  // no call left: it closes the idle connections
      return;
    }
  }
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
  for (grpc::Server* server : {server_.get(), health_ != nullptr ? health_->server() : nullptr}) {
    if (server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService(); health != nullptr) {
      health->Shutdown();
    }
  }
  if (scheduler_ != nullptr) scheduler_->Shutdown();
  absl::Notification drained;
  std::thread stopper([&] { StopWhenIdle(deadline, &drained); });
  server_->Shutdown(absl::ToChronoTime(deadline));
  drained.Notify();
  stopper.join();
  if (sessions_ != nullptr) {
    const SessionStore::Activity dropped = sessions_->EndAll("shutdown");
    spdlog::info("shutdown: dropped {} open session(s), {} bytes of cache", dropped.open, dropped.cache_bytes);
  }
  if (health_ != nullptr) health_->server()->Shutdown(absl::ToChronoTime(absl::Now()));
  // No connection is left to need them, and mha_server ends without destructors.
  if (tls_ != nullptr) tls_->RemoveCopies();
  scheduler_.reset();
}

}  // namespace mha
