// What a binary was built from, for --version and GetServerInfo: the project's version (CMake's project()), the
// git revision (12 hex digits, "-dirty" with uncommitted changes to tracked files, "unknown" without git) and the
// CMake build type. Defined in a file that cmake/build_info.cmake writes at build time.
#ifndef MHA_PROTO_BUILD_INFO_H_
#define MHA_PROTO_BUILD_INFO_H_

#include <string>

namespace mha {

const char* ProjectVersion();
const char* GitRevision();
const char* BuildType();

// "<program> <version> (git <revision>, <build type> build)\n", what --version prints.
std::string VersionText(const char* program);

// A path the compiler saw (__FILE__, absl's flag file names) relative to the repository's root: "server/flags.cc"
// rather than "/home/me/src/mhaserve/server/flags.cc". Paths outside the repository come back unchanged.
std::string RepositoryPath(const std::string& compiled_path);

}  // namespace mha

#endif  // MHA_PROTO_BUILD_INFO_H_
