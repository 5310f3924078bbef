#include "server/transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mha {
namespace {

constexpr size_t kMinTokenLength = 16;
constexpr size_t kMaxTokenLength = 4096;

std::array<unsigned char, 32> Digest(absl::string_view token) {
  std::array<unsigned char, 32> digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest.data());
  return digest;
}

bool PrintableToken(absl::string_view token) {
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<TokenAuth::Entry>> TokenAuth::Read(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("--auth_tokens_file ", path, ": cannot open it"));
  std::vector<Entry> entries;
  std::string line;
  for (int number = 1; std::getline(file, line); ++number) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const std::vector<absl::string_view> words = absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat("--auth_tokens_file ", path, " line ", number);
    if (words.size() > 2) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected a token and at most a role"));
    }
    if (words[0].size() < kMinTokenLength || words[0].size() > kMaxTokenLength || !PrintableToken(words[0])) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a token must be ", kMinTokenLength, "..",
                                                     kMaxTokenLength, " printable ASCII characters"));
    }
    Role role = Role::kCompute;
    if (words.size() == 2) {
      if (words[1] == "admin") {
        role = Role::kAdmin;
      } else if (words[1] != "compute") {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the role must be compute or admin"));
      }
    }
    entries.push_back({Digest(words[0]), role});
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file ", path, " holds no token"));
  }
  return entries;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(const std::string& path) {
  std::unique_ptr<TokenAuth> auth(new TokenAuth(path));
  absl::Status status = auth->Reload();
  if (!status.ok()) return status;
  return auth;
}

absl::Status TokenAuth::Reload() {
  absl::StatusOr<std::vector<Entry>> entries = Read(path_);
  if (!entries.ok()) return entries.status();
  auto fresh = std::make_shared<const std::vector<Entry>>(*std::move(entries));
  absl::MutexLock lock(&mu_);
  entries_ = std::move(fresh);
  return absl::OkStatus();
}

size_t TokenAuth::size() const {
  absl::MutexLock lock(&mu_);
  return entries_->size();
}

absl::StatusOr<TokenAuth::Principal> TokenAuth::Authenticate(absl::string_view authorization, Role needed,
                                                             absl::string_view rpc) const {
  std::shared_ptr<const std::vector<Entry>> entries;
  {
    absl::MutexLock lock(&mu_);
    entries = entries_;
  }
  // The scheme is case-insensitive (RFC 7235); one message for every way of not presenting a known token.
  constexpr absl::string_view kScheme = "bearer ";
  const bool bearer = authorization.size() > kScheme.size() &&
                      absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme);
  const std::array<unsigned char, 32> digest = Digest(bearer ? authorization.substr(kScheme.size()) : "");
  int matched_role = -1;
  for (const Entry& entry : *entries) {
    // Every entry is compared in full, so the time does not depend on which one matches or where others differ.
    const bool match = CRYPTO_memcmp(entry.digest.data(), digest.data(), digest.size()) == 0;
    matched_role = match && bearer ? static_cast<int>(entry.role) : matched_role;
  }
  if (matched_role < 0) {
    return absl::UnauthenticatedError(
        "a valid bearer token is required (metadata \"authorization: Bearer <token>\")");
  }
  if (matched_role < static_cast<int>(needed)) {
    return absl::PermissionDeniedError(absl::StrCat(rpc, " needs a token with the admin role"));
  }
  return Principal{absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest.data()),
                                                            digest.size())),
                   static_cast<Role>(matched_role)};
}

}  // namespace mha
