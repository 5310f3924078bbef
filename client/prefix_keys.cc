#include "client/prefix_keys.h"

#include <openssl/sha.h>

namespace mha {
namespace {

void AppendLittleEndian(uint64_t value, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

std::vector<std::string> PrefixKeys(absl::Span<const int64_t> tokens, int64_t block_tokens, absl::string_view extra) {
  std::vector<std::string> keys;
  if (block_tokens < 1) return keys;
  const size_t blocks = tokens.size() / static_cast<size_t>(block_tokens);
  std::string message;
  for (size_t b = 0; b < blocks; ++b) {
    message.clear();
    if (b > 0) message = keys.back();
    AppendLittleEndian(extra.size(), &message);
    message.append(extra.data(), extra.size());
    for (int64_t t = 0; t < block_tokens; ++t) {
      AppendLittleEndian(static_cast<uint64_t>(tokens[b * block_tokens + t]), &message);
    }
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest);
    keys.emplace_back(reinterpret_cast<const char*>(digest), sizeof(digest));
  }
  return keys;
}

}  // namespace mha
