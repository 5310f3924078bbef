#include "proto/build_info.h"

#include <string>

namespace mha {

std::string VersionText(const char* program) {
  return std::string(program) + " " + ProjectVersion() + " (git " + GitRevision() + ", " + BuildType() + " build)\n";
}

std::string RepositoryPath(const std::string& compiled_path) {
  // This file's own path, less its place in the repository, is the root every other source file shares.
  static const std::string root = [] {
    const std::string self = __FILE__;
    const std::string suffix = "proto/build_info.cc";
    return self.size() >= suffix.size() ? self.substr(0, self.size() - suffix.size()) : std::string();
  }();
  if (!root.empty() && compiled_path.compare(0, root.size(), root) == 0) return compiled_path.substr(root.size());
  return compiled_path;
}

}  // namespace mha
