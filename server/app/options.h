// The server's options checked, and turned into each part's own: the flags' ranges and the listen addresses
// (CheckOptions, before anything slow starts), then the backends', the scheduler's, the session store's (and the
// memory its KV cache lives in) and the validation limits.
#ifndef MHA_SERVER_APP_OPTIONS_H_
#define MHA_SERVER_APP_OPTIONS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backends/registry.h"
#include "server/calls/validate.h"
#include "server/config/server_options.h"
#include "server/layers/layer_store.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/transport/shared_memory.h"

namespace mha {

// INVALID_ARGUMENT naming the flag for a value out of its range; the listen addresses parsed and checked for
// binding (UNAVAILABLE naming the flag for one in use). Resolves --threads 0 and --metrics_listen :PORT.
absl::Status CheckOptions(ServerOptions* options);

BackendOptions BackendOptionsOf(const ServerOptions& options);
// The scheduler's options; one concurrent thread per call each available backend of `backends` overlaps.
SchedulerOptions SchedulerOptionsOf(const ServerOptions& options, const BackendRegistry& backends);
SessionStoreOptions SessionOptionsOf(const ServerOptions& options);
// The limits every call is validated against, over the server's registries (borrowed).
ValidationContext ValidationOf(const ServerOptions& options, const LayerStore* layers,
                               const BackendRegistry* backends, const SharedMemoryRegistry* shared_memory);

// The memory of the KV-cache pool (--kv_cache_memory): a backend's arena of `bytes`, or null for host memory the
// pool reserves itself. "cuda" fails, naming the flag, when the CUDA backend is not there or cannot lend the memory;
// "auto" takes the default backend's (BACKEND_AUTO's) when it lends some, and otherwise host memory.
absl::StatusOr<std::unique_ptr<CacheArena>> CacheArenaFor(const std::string& memory, const BackendRegistry& backends,
                                                          int64_t bytes);

}  // namespace mha

#endif  // MHA_SERVER_APP_OPTIONS_H_
