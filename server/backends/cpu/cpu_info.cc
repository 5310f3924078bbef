#include "server/backends/cpu/cpu_info.h"

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace mha::cpu {

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (!absl::StartsWith(line, "model name")) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  return "unknown CPU";
}

}  // namespace mha::cpu
