#include "server/base/log_safe.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace mha {

std::string LogSafe(absl::string_view text, size_t max) {
  if (text.size() <= max) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max)), "...(", text.size(), " bytes)");
}

}  // namespace mha
