// Bearer-token authentication with two roles, for --auth_tokens_file.
//
// The file holds one token per line, optionally followed by whitespace and a role: "compute" (the default:
// MultiHeadAttention, ScaledDotProductAttention, ListLayers, GetServerInfo) or "admin" (also LoadLayer and
// UnloadLayer). Blank lines and lines starting with '#' are skipped. A token is 16..4096 printable ASCII
// characters without spaces. Clients send "authorization: Bearer <token>" metadata.
#ifndef MHA_SERVER_TRANSPORT_AUTH_H_
#define MHA_SERVER_TRANSPORT_AUTH_H_

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mha {

enum class Role { kCompute = 0, kAdmin = 1 };

class TokenAuth {
 public:
  // Reads `path` (see above). The error names the file and the line, never a token.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(const std::string& path);

  // Re-reads the file it was made from; on error keeps the tokens it has and returns the error. Thread-safe.
  absl::Status Reload();

  // OK when `authorization` (the metadata value, empty when absent) is "Bearer <token>" for a token whose role
  // includes `needed`. UNAUTHENTICATED with one message for a missing, malformed or unknown token;
  // PERMISSION_DENIED naming `rpc` when the token's role is too small. Compares in time independent of where a
  // presented token differs from the known ones (digests compared in full against every entry). Thread-safe.
  absl::Status Check(absl::string_view authorization, Role needed, absl::string_view rpc) const {
    return Authenticate(authorization, needed, rpc).status();
  }
  // Check, and on success who the caller is: the same token (whatever its line or role) always gives the same
  // `id` (hex of its SHA-256), different tokens different ones; what owns a caller's sessions.
  struct Principal {
    std::string id;
    Role role = Role::kCompute;
  };
  absl::StatusOr<Principal> Authenticate(absl::string_view authorization, Role needed, absl::string_view rpc) const;

  size_t size() const;  // tokens held

 private:
  struct Entry {
    std::array<unsigned char, 32> digest;  // SHA-256 of the token; the token itself is not kept
    Role role;
  };
  static absl::StatusOr<std::vector<Entry>> Read(const std::string& path);

  explicit TokenAuth(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const std::vector<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_AUTH_H_
