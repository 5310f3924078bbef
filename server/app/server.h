// The process's server: MhaServer assembles every part from ServerOptions (tokens and TLS, layers, backends,
// metrics, the scheduler, the session store, the front doors on one port, health and reflection), watches it
// (liveness, readiness, idle sessions) and shuts it down. Used by main() and by the in-process tests.
#ifndef MHA_SERVER_APP_SERVER_H_
#define MHA_SERVER_APP_SERVER_H_

#include <atomic>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "server/app/ports.h"
#include "server/backends/registry.h"
#include "server/calls/validate.h"
#include "server/config/server_options.h"
#include "server/layers/layer_store.h"
#include "server/metrics/metrics.h"
#include "server/rpc/call.h"
#include "server/rpc/kserve/kserve_service.h"
#include "server/rpc/service.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/transport/auth.h"
#include "server/transport/listener_watch.h"
#include "server/transport/shared_memory.h"
#include "server/transport/tls.h"

namespace mha {

class MhaServer {
 public:
  // Starts serving. INVALID_ARGUMENT for bad options, the layer loader's error for a bad --layers_dir,
  // UNAVAILABLE if the address cannot be bound. An empty options.listen serves in-process only.
  static absl::StatusOr<std::unique_ptr<MhaServer>> Start(ServerOptions options);
  // Shuts down (see Shutdown) if still running.
  ~MhaServer();

  int port() const { return port_; }  // the bound port; 0 when in-process only
  int health_port() const { return health_ != nullptr ? health_->port() : 0; }  // 0 without options.health_listen
  int metrics_port() const { return metrics_->port(); }  // 0 unless options.metrics_listen was set
  const ServerMetrics& metrics() const { return *metrics_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  SessionStore& sessions() { return *sessions_; }
  std::shared_ptr<grpc::Channel> InProcessChannel();
  // Health answers NOT_SERVING and new calls UNAVAILABLE at once (with `drain_sessions`, after the sessions' drain:
  // DrainSessions); in-flight calls may finish until `grace` has passed since the call, when those still computing
  // or waiting are stopped; then the compute thread ends, and the sessions still open are dropped (logged, and
  // counted as mha_session_evictions_total{reason="shutdown"}). Idempotent.
  void Shutdown(absl::Duration grace, bool drain_sessions = false);
  // Shutdown with --shutdown_grace_s.
  void Shutdown();
  // SIGTERM's: the sessions' drain, then Shutdown with --shutdown_grace_s (counted from this call).
  void Terminate();
  // Re-reads --auth_tokens_file and the TLS files (SIGHUP). What fails to load keeps its previous contents; the
  // first error is returned. Open connections are kept.
  absl::Status Reload();

 private:
  MhaServer() = default;
  // Start's steps, in order; each fails the start with what it cannot do.
  absl::Status StartSecurity();  // tokens and TLS
  absl::Status StartLayers();    // the demo layer and --layers_dir
  absl::Status StartBackends();  // the registry, --backend, --inline_max_mflop against the backends
  absl::Status StartCompute();   // metrics, the scheduler and the backends' warm-up, the session store
  void StartServices();          // the call edge, shared memory, validation, the front doors
  absl::Status StartPorts();     // the main port (and the token gate on it), the health-only port, --port_file
  // Until Shutdown, four times a second: liveness (health service "") NOT_SERVING while the scheduler has been
  // stuck past --stuck_after_s; readiness (service "mha.v1.Attention") NOT_SERVING then too, and while
  // --ready_max_queue calls or more wait; idle sessions past their timeout ended; and every few seconds, the
  // allocator's free pages returned to the system.
  void Watch();
  // With sessions open and --drain_idle_s > 0: readiness NOT_SERVING at once, every call still served, until no
  // session is open, none was called for --drain_idle_s, or `deadline`.
  void DrainSessions(absl::Time deadline);
  // Beside gRPC's Shutdown, until `drained`: closes the connections once no call is in progress; at `deadline`
  // ends what still waits or computes.
  void StopWhenIdle(absl::Time deadline, absl::Notification* drained);
  // Sets health service `service` of both servers (the main one and --health_listen's).
  void SetServing(const std::string& service, bool serving);

  ServerOptions options_;
  std::unique_ptr<TokenAuth> auth_;  // null without --auth_tokens_file
  std::unique_ptr<TlsServer> tls_;   // null without --tls_cert
  std::unique_ptr<LayerStore> layers_;
  std::unique_ptr<BackendRegistry> backends_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ServerMetrics> metrics_;
  // Before the session store: a call still waiting for its sessions when the store goes is answered through it.
  std::unique_ptr<CallEdge> edge_;
  std::unique_ptr<SessionStore> sessions_;  // after metrics_, which it feeds; before the services, which use it
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  ValidationContext validation_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<KServeService> kserve_;  // the second front door, on the same port
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HealthOnlyPort> health_;  // --health_listen
  int port_ = 0;
  int unix_bound_ = 0;  // 1 once --listen_unix is bound (gRPC reports a Unix socket as port 1)
  bool shut_down_ = false;
  // What SetServing last set for "" and mha.v1.Attention, for KServe's ServerLive and ServerReady.
  std::atomic<bool> live_{false}, ready_{false};
  ListenerWatch listeners_;  // the watchdog's alone
  absl::Notification stop_watch_;
  std::thread watchdog_;
};

}  // namespace mha

#endif  // MHA_SERVER_APP_SERVER_H_
