// Text a client controls, made fit for one log line.
#ifndef MHA_SERVER_BASE_LOG_SAFE_H_
#define MHA_SERVER_BASE_LOG_SAFE_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace mha {

// At most `max` bytes of `text`, with control characters, quotes and non-ASCII bytes escaped, so that it can
// neither forge a line nor grow every line without bound; a longer text ends "...(N bytes)".
std::string LogSafe(absl::string_view text, size_t max = 128);

}  // namespace mha

#endif  // MHA_SERVER_BASE_LOG_SAFE_H_
