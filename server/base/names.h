// The one rule for the names clients give things: layers, sessions, shared-memory regions and keys.
#ifndef MHA_SERVER_BASE_NAMES_H_
#define MHA_SERVER_BASE_NAMES_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mha {

inline constexpr int kMaxNameLength = 128;

// INVALID_ARGUMENT naming `field` unless `name` is 1..kMaxNameLength characters of [A-Za-z0-9._-]. The message
// never repeats the name (it may be huge or hold control characters), only its length or the offending character,
// escaped; so a name that passes is safe to log and to echo.
absl::Status CheckName(absl::string_view name, absl::string_view field);

}  // namespace mha

#endif  // MHA_SERVER_BASE_NAMES_H_
