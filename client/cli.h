// mha_client's subcommands and what they share: the connection flags, the output flags, exit codes and error
// printing. Each subcommand lives in its own cli_<name>.cc; mha_client_main.cc only dispatches.
//
// Exit codes: 0 success; 1 failure (the server, a file, or a --check mismatch); 2 usage error (a bad flag value or
// combination), detected before anything is sent.
#ifndef MHA_CLIENT_CLI_H_
#define MHA_CLIENT_CLI_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/attention_client.h"

ABSL_DECLARE_FLAG(std::string, output);
ABSL_DECLARE_FLAG(std::string, weights_output);

namespace mha::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Prints "error: <status>" to stderr; returns kExitFailure.
int Fail(const absl::Status& status);
// Prints "usage error: <message>" and a hint to stderr; returns kExitUsage.
int UsageError(const absl::Status& status);

// Whether the command line asks for --help (-h, --helpshort): then HelpText() is the answer, exit 0.
bool WantsHelp(int argc, char** argv);
// The usage message and every mha_client flag grouped by the subcommands that read it.
std::string HelpText();
// Between these two calls, a flag absl cannot parse (unknown, or a bad value) ends the process with kExitUsage
// after absl's message, instead of absl's exit code 1.
void BeginFlagParsing();
void EndFlagParsing();

// --target, --lb, --timeout_s, --max_message_mb as ClientOptions; INVALID_ARGUMENT (a usage error) if out of range.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags();
// -O, the report format of bench and heads: "pretty", "json" or "csv"; INVALID_ARGUMENT (a usage error) otherwise.
absl::StatusOr<std::string> ReportFormatFromFlags();

int RunHealth(const ClientOptions& options);
int RunInfo(const ClientOptions& options);
int RunCall(const ClientOptions& options);
int RunBench(const ClientOptions& options);
int RunPlot(const ClientOptions& options);
int RunHeads(const ClientOptions& options);
int RunDecode(const ClientOptions& options);
int RunLoad(const ClientOptions& options);

}  // namespace mha::cli

#endif  // MHA_CLIENT_CLI_H_
