// mha_server: flags -> ServerOptions, start, wait for SIGINT/SIGTERM, drain, exit 0.
#include <csignal>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

namespace {
const mha::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, listen, kDefaults.listen, "host:port to serve on; port 0 picks a free one");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, metrics_listen, "", "serve Prometheus metrics at http://HOST:PORT/metrics; empty = off");
ABSL_FLAG(std::string, layers_dir, "", "register every *.safetensors file in this folder as a layer");
ABSL_FLAG(std::string, backend, kDefaults.backend, "default backend: auto, cpu, reference or cuda");
ABSL_FLAG(int, max_message_mb, kDefaults.max_message_mb, "largest request or response, MiB");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(int, threads, kDefaults.threads, "compute threads per request; 0 = all cores");
ABSL_FLAG(int, max_queue_size, kDefaults.max_queue_size, "requests waiting to compute before RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_queued_mb, kDefaults.max_queued_mb, "MiB of request data the waiting requests may hold");
ABSL_FLAG(int, max_layer_mb, kDefaults.max_layer_mb, "total fp32 MiB of registered layers");
ABSL_FLAG(int, max_layers, kDefaults.max_layers, "registered layers at most, demo included");
ABSL_FLAG(int, max_scratch_mb, kDefaults.max_scratch_mb, "working memory one request may need, MiB");
ABSL_FLAG(double, inline_max_mflop, kDefaults.inline_max_mflop,
          "requests up to this many MFLOP run on the receiving gRPC thread; 0 = always the compute thread");
ABSL_FLAG(double, max_request_gflop, kDefaults.max_request_gflop, "GFLOP (projections + attention) one request may ask for");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Serves multi-head attention over gRPC (package mha.v1, service Attention).");
  absl::ParseCommandLine(argc, argv);

  const std::string level_name = absl::GetFlag(FLAGS_log_level);
  const spdlog::level::level_enum level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    std::fprintf(stderr, "--log_level must be trace, debug, info, warn, error, critical or off; got %s\n",
                 level_name.c_str());
    return 2;
  }
  spdlog::set_level(level);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  // Block the shutdown signals in every thread (gRPC's included) so that only sigwait below sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  mha::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.port_file = absl::GetFlag(FLAGS_port_file);
  options.layers_dir = absl::GetFlag(FLAGS_layers_dir);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  options.max_queued_mb = absl::GetFlag(FLAGS_max_queued_mb);
  options.max_layer_mb = absl::GetFlag(FLAGS_max_layer_mb);
  options.max_layers = absl::GetFlag(FLAGS_max_layers);
  options.max_scratch_mb = absl::GetFlag(FLAGS_max_scratch_mb);
  options.max_request_gflop = absl::GetFlag(FLAGS_max_request_gflop);
  options.inline_max_mflop = absl::GetFlag(FLAGS_inline_max_mflop);
  if (options.listen.empty()) {
    spdlog::error("--listen must not be empty");
    return 2;
  }

  absl::StatusOr<std::unique_ptr<mha::MhaServer>> server = mha::MhaServer::Start(options);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    return 1;
  }
  spdlog::info("mha_server listening on {} (port {})", options.listen, (*server)->port());
  if ((*server)->metrics_port() != 0) {
    spdlog::info("metrics at http://{}/metrics (port {})", options.metrics_listen, (*server)->metrics_port());
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, draining in-flight calls", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();
  spdlog::info("stopped");
  return 0;
}
