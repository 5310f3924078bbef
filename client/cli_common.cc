// The flags every subcommand shares and the error printing behind the exit codes.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/cli.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "gRPC target: host:port, dns:///name:port, or a list such as ipv4:127.0.0.1:50051,127.0.0.1:50052 "
          "(with --lb round_robin to spread calls over the addresses); decode --shards: the shards' servers, "
          "comma-separated, shard i on server i % count");
ABSL_FLAG(std::string, lb, "", "load-balancing policy across the target's addresses: pick_first or round_robin");
ABSL_FLAG(double, timeout_s, 60, "deadline of each call, seconds");
ABSL_FLAG(int, max_message_mb, 256, "largest message, MiB (match the server's --max_message_mb)");
ABSL_FLAG(bool, tls, false, "connect with TLS (implied by --tls_ca, --tls_cert)");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of the CA that signed the server's certificate (default: system roots)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain to present to the server (mutual TLS; with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "", "name to check in the server's certificate (default: the target's host)");
ABSL_FLAG(std::string, token_file, "",
          "file whose first line is a bearer token sent with every call (servers with --auth_tokens_file)");
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

namespace {

absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read it"));
  std::ostringstream text;
  text << file.rdbuf();
  if (text.str().size() > (1 << 20)) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": over 1 MiB"));
  return text.str();
}

absl::Status SecurityOptionsFromFlags(ClientOptions* options) {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca), cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  options->tls = absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty();
  // Each file that is named is read: (flag, path, destination).
  const std::tuple<const char*, std::string, std::string*> files[] = {
      {"--tls_ca", ca, &options->tls_roots_pem},
      {"--tls_cert", cert, &options->tls_cert_pem},
      {"--tls_key", key, &options->tls_key_pem},
  };
  for (const auto& [flag, path, pem] : files) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> text = ReadFlagFile(flag, path);
    if (!text.ok()) return text.status();
    *pem = *std::move(text);
  }
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> text = ReadFlagFile("--token_file", path);
    if (!text.ok()) return text.status();
    options->token = std::string(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
    if (options->token.empty()) return absl::InvalidArgumentError(absl::StrCat("--token_file ", path, " is empty"));
  }
  return absl::OkStatus();
}

}  // namespace

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
  if (absl::Status status = SecurityOptionsFromFlags(&options); !status.ok()) return status;
  return options;
}

}  // namespace mha::cli
