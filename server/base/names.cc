#include "server/base/names.h"

#include <cstddef>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace mha {

absl::Status CheckName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > static_cast<size_t>(kMaxNameLength)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be 1..", kMaxNameLength,
                                                   " characters of [A-Za-z0-9._-], got ", name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(absl::StrCat(field, " may only hold [A-Za-z0-9._-]; character ", i,
                                                     " is '", absl::CHexEscape(name.substr(i, 1)), "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mha
