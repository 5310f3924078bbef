// The flags every subcommand shares and the error printing behind the exit codes.
#include <cmath>
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "gRPC target: host:port, dns:///name:port, or a list such as ipv4:127.0.0.1:50051,127.0.0.1:50052 "
          "(with --lb round_robin to spread calls over the addresses)");
ABSL_FLAG(std::string, lb, "", "load-balancing policy across the target's addresses: pick_first or round_robin");
ABSL_FLAG(double, timeout_s, 60, "deadline of each call, seconds");
ABSL_FLAG(int, max_message_mb, 256, "largest message, MiB (match the server's --max_message_mb)");
ABSL_FLAG(std::string, output, "", "call: write the output tensor to this .npy file; plot: the .svg file to write");
ABSL_FLAG(std::string, weights_output, "",
          "call, plot: write the attention weights [B, H, Tq, Tk] to this .npy file (implies --weights)");

namespace mha::cli {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return kExitFailure;
}

int UsageError(const absl::Status& status) {
  std::fprintf(stderr, "usage error: %s\n(mha_client --help lists the flags)\n",
               std::string(status.message()).c_str());
  return kExitUsage;
}

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  if (options.target.empty()) return absl::InvalidArgumentError("--target must not be empty");
  options.lb_policy = absl::GetFlag(FLAGS_lb);
  if (!options.lb_policy.empty() && options.lb_policy != "pick_first" && options.lb_policy != "round_robin") {
    return absl::InvalidArgumentError(
        absl::StrCat("--lb must be pick_first or round_robin; got '", options.lb_policy, "'"));
  }
  const double timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (!(timeout_s > 0) || !std::isfinite(timeout_s)) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout_s must be a positive number; got ", timeout_s));
  }
  options.timeout = absl::Seconds(timeout_s);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (options.max_message_mb < 1 || options.max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb must be in [1, 2047]; got ", options.max_message_mb));
  }
  return options;
}

}  // namespace mha::cli
