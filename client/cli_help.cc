// mha_client --help: the flags grouped by the subcommands that read them, with no build paths, and the exit code
// of a command line absl cannot parse.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/cli.h"

namespace mha::cli {
namespace {

// The files that define mha_client's flags, in the order --help shows them, and who reads them.
struct FlagGroup {
  const char* file_suffix;
  const char* title;
};
constexpr FlagGroup kGroups[] = {
    {"client/cli_common.cc", "Every subcommand: the server, the connection, output files"},
    {"client/cli_request.cc", "call, bench, plot, heads: the request (inputs, weights, heads, masks, dtypes)"},
    {"client/cli_call.cc", "call, decode"},
    {"client/cli_bench.cc", "bench: the load test"},
    {"client/cli_plot.cc", "plot: the attention weights as an SVG"},
    {"client/cli_heads.cc", "heads: per-head statistics ranked by contribution (and -O, above)"},
    {"client/cli_decode.cc",
     "decode: KV-cache sessions (--shards: one context over several servers; --recover: rebuild lost sessions)"},
    {"client/cli_load.cc", "load: a transformers checkpoint's attention layers"},
};

// `text` wrapped at `width` columns, each line indented by `indent` spaces.
std::string Wrap(const std::string& text, size_t indent, size_t width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line.append(word.data(), word.size());
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

std::string FlagText(const absl::CommandLineFlag& flag) {
  const std::string dash = flag.Name().size() == 1 ? "-" : "--";
  std::string text = "  " + dash + std::string(flag.Name());
  const std::string fallback = flag.DefaultValue();
  text += fallback.empty() ? "\n" : " (default " + fallback + ")\n";
  return text + Wrap(flag.Help(), 6, 110);
}

bool g_parsing = false;

// absl::ParseCommandLine (abseil 20220623) reports a flag it cannot parse and calls exit(1); a usage error exits 2
// in mha_client (client/cli.h). exit runs this handler, which ends the process with 2 instead while parsing.
void ExitTwoWhileParsing() {
  if (!g_parsing) return;
  std::fprintf(stderr, "(mha_client --help lists the flags)\n");
  std::fflush(nullptr);
  _exit(kExitUsage);
}

}  // namespace

bool WantsHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg == "-h" || arg == "-help" || arg == "--help" || arg == "-helpshort" || arg == "--helpshort") return true;
  }
  return false;
}

std::string HelpText() {
  std::string text = std::string(absl::ProgramUsageMessage()) + "\n";
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) flags.push_back(flag);
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (const FlagGroup& group : kGroups) {
    text += std::string("\n") + group.title + ":\n";
    for (const absl::CommandLineFlag* flag : flags) {
      if (absl::EndsWith(flag->Filename(), group.file_suffix)) text += FlagText(*flag);
    }
  }
  text += "\n  --version prints the version; --helpfull lists every flag, abseil's own included.\n";
  return text;
}

void BeginFlagParsing() {
  static const bool installed = std::atexit(ExitTwoWhileParsing) == 0;
  (void)installed;
  g_parsing = true;
}

void EndFlagParsing() { g_parsing = false; }

}  // namespace mha::cli
