// mha_client: a command-line client for mha_server.
//   mha_client health            exit 0 only when the server reports SERVING (usable as a container probe)
//   mha_client info              server version, backends, limits and registered layers
//   mha_client call [flags]      one MultiHeadAttention call (inputs from .npy or random); prints a summary
//   mha_client bench [flags]     load test: closed loop (-c, -n, -z) or open loop (--rps); pretty, JSON or CSV
//   mha_client plot [flags]      per-head attention weights as an SVG grid of heatmaps
//   mha_client heads [flags]     per-head statistics ranked by contribution; --ablate K masks the K least ones
//   mha_client decode [flags]    KV-cache sessions: prefill, decode steps; tokens/s, step latency, KV bytes/s
//   mha_client load --checkpoint DIR   registers a transformers checkpoint's attention layers
// Exit codes: 0 success, 1 failure, 2 usage error (see client/cli.h).
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/strings/match.h"
#include "client/cli.h"
#include "proto/build_info.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mha_client health|info|call|bench|plot|heads|decode|load [--flags]: a client for mha_server\n"
      "  e.g. mha_client call --query q.npy --output out.npy --weights --weights_output w.npy\n"
      "       mha_client bench -c 4 -z 10s --batch 8 --seq 512\n"
      "       mha_client bench --rps 50 -n 500 -O json\n"
      "       mha_client plot --tokens the,cat,sat,on,the,mat --output heads.svg\n"
      "       mha_client heads --seq 64 --ablate 2\n"
      "       mha_client decode --sessions 32 --context 2048 --steps 64 --check\n"
      "       mha_client load --checkpoint ./Llama-3.2-1B --name llama");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) { return absl::StrContains(path, "client/cli"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.normalize_filename = [](absl::string_view path) { return mha::RepositoryPath(std::string(path)); };
  usage.version_string = [] { return mha::VersionText("mha_client"); };
  absl::SetFlagsUsageConfig(usage);
  // --help groups the flags by subcommand (client/cli_help.cc); --helpfull and --version are abseil's.
  if (mha::cli::WantsHelp(argc, argv)) {
    std::cout << mha::cli::HelpText();
    return mha::cli::kExitOk;
  }
  // absl::ParseCommandLine exits 1 after --helpfull or --version (abseil 20220623); help that was asked for is a
  // success, so the usage flags are handled here (through abseil's internal entry points, pinned by Debian's
  // version).
  mha::cli::BeginFlagParsing();
  std::vector<char*> args = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage, absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  mha::cli::EndFlagParsing();
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) != -1) return mha::cli::kExitOk;
  if (args.size() != 2) {
    std::fprintf(stderr,
                 "usage: mha_client health|info|call|bench|plot|heads|decode|load [--flags]  (--help for flags)\n");
    return mha::cli::kExitUsage;
  }
  absl::StatusOr<mha::ClientOptions> options = mha::cli::ClientOptionsFromFlags();
  if (!options.ok()) return mha::cli::UsageError(options.status());
  const std::string command = args[1];
  if (command == "health") return mha::cli::RunHealth(*options);
  if (command == "info") return mha::cli::RunInfo(*options);
  if (command == "call") return mha::cli::RunCall(*options);
  if (command == "bench") return mha::cli::RunBench(*options);
  if (command == "plot") return mha::cli::RunPlot(*options);
  if (command == "heads") return mha::cli::RunHeads(*options);
  if (command == "decode") return mha::cli::RunDecode(*options);
  if (command == "load") return mha::cli::RunLoad(*options);
  std::fprintf(stderr, "unknown command '%s'; expected health, info, call, bench, plot, heads, decode or load\n",
               command.c_str());
  return mha::cli::kExitUsage;
}
