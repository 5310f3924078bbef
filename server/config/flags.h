// The server's command-line flags: one absl flag per ServerOptions field, with the field's name and default.
#ifndef MHA_SERVER_CONFIG_FLAGS_H_
#define MHA_SERVER_CONFIG_FLAGS_H_

#include "server/config/server_options.h"

namespace mha {

// The options the parsed flags give (call after absl::ParseCommandLine).
ServerOptions ServerOptionsFromFlags();

}  // namespace mha

#endif  // MHA_SERVER_CONFIG_FLAGS_H_
