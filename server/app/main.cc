// mha_server: flags -> ServerOptions, start, reload on SIGHUP, wait for SIGINT/SIGTERM, drain, exit 0.
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "proto/build_info.h"
#include "server/app/server.h"
#include "server/config/flags.h"
#include "server/transport/connection_gate.h"
#include "server/transport/listen_address.h"
#include "spdlog/spdlog.h"

namespace {

// libgomp reads its wait policy from the environment once, when it loads (before main). Its default spins each idle
// worker for about 300000 iterations after every parallel region, which takes the cores from gRPC's threads (and
// from other processes on the same cores) between the many short computations of small calls. Unless the operator
// chose a policy, set a short spin and re-execute once with it.
void UseShortOpenMpSpins(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  // The binary's own path, not /proc/self/exe: the process keeps its name (ps, /proc/PID/comm) across the exec.
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return;
  path[length] = '\0';
  setenv("GOMP_SPINCOUNT", "10000", 1);
  execv(path, argv);  // returns only on failure: then run with libgomp's default
  unsetenv("GOMP_SPINCOUNT");
}

// glibc's allocator, left alone, gives each of gRPC's many threads an arena of its own, so that multi-megabyte
// request and response buffers end up scattered over arenas whose free pages are never returned (the soak test's
// RSS kept growing). Two arenas here, and the server's watchdog returns free pages every few seconds
// (MhaServer::Watch).
void BoundAllocatorMemory() { mallopt(M_ARENA_MAX, 2); }

// Every connection costs a file descriptor, and gRPC 1.51 stops accepting on a port for good after an accept fails
// for lack of one: the soft limit is raised to the hard one, which is the most an unprivileged process may take.
// Returns the limit now in force.
rlim_t RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) return raised.rlim_cur;
  }
  return limit.rlim_cur;
}

// Ends the process once the server has drained and stopped, without the teardown of gRPC's globals: there,
// grpc_shutdown (from ~grpc::Server) joins gRPC 1.51's executor threads, and one that is polling (epoll_wait with a
// timeout of up to 10 s) is joined only when its wait ends, which would hold the exit past the grace period.
// Nothing is left to tear down that the kernel does not release: every call has finished or been cancelled, and
// the log is flushed first.
// Under ASan the leak check that exit would run runs here (what is still reachable, the server included, is not
// a leak).
[[noreturn]] void ExitNow(int code) {
#if defined(__SANITIZE_ADDRESS__)
  __lsan_do_leak_check();
#endif
  spdlog::shutdown();
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  UseShortOpenMpSpins(argv);
  BoundAllocatorMemory();
  absl::SetProgramUsageMessage("Serves multi-head attention over gRPC (package mha.v1, service Attention).");
  // --help lists the server's flags (server/flags.cc), and exits 0: absl::ParseCommandLine exits 1 after it
  // (abseil 20220623), so the usage flags are handled here through abseil's internal entry points.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) { return absl::StrContains(path, "server/config/flags.cc"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view path) { return mha::RepositoryPath(std::string(path)); };
  usage.version_string = [] { return mha::VersionText("mha_server"); };
  absl::SetFlagsUsageConfig(usage);
  absl::flags_internal::ParseCommandLineImpl(argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
                                             absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
                                             absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) return 0;
  const mha::ServerOptions options = mha::ServerOptionsFromFlags();

  const std::string& level_name = options.log_level;
  const spdlog::level::level_enum level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    std::fprintf(stderr, "--log_level must be trace, debug, info, warn, error, critical or off; got %s\n",
                 level_name.c_str());
    return 2;
  }
  spdlog::set_level(level);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");

  const rlim_t open_files = RaiseOpenFileLimit();

  // Block the shutdown and reload signals in every thread (gRPC's included) so that only sigwait below sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

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
  const int gate = mha::ConnectionGateFor(open_files);
  mha::SetConnectionGate(gate);
  if (gate > 0) {
    spdlog::info("open files: at most {}; connections are refused while {} are in use", open_files, gate);
  } else {
    spdlog::info("open files: unlimited");
  }
  if ((*server)->metrics_port() != 0) {
    spdlog::info("metrics at http://{}/metrics (port {})", mha::OnListenHost(options.metrics_listen, options.listen),
                 (*server)->metrics_port());
  }

  int signal_number = 0;
  // SIGHUP re-reads the tokens and the TLS files (errors are logged; the server keeps what it had).
  while (sigwait(&signals, &signal_number) == 0 && signal_number == SIGHUP) {
    spdlog::info("received SIGHUP, reloading");
    (void)(*server)->Reload();
  }
  spdlog::info("received {}, draining in-flight calls", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Terminate();
  spdlog::info("stopped");
  ExitNow(0);
}
