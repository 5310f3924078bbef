// What the host CPU is, for logs and GetServerInfo.
#ifndef MHA_SERVER_BACKENDS_CPU_CPU_INFO_H_
#define MHA_SERVER_BACKENDS_CPU_CPU_INFO_H_

#include <string>

namespace mha::cpu {

// The "model name" line of /proc/cpuinfo, or "unknown CPU".
std::string CpuModelName();

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_CPU_INFO_H_
