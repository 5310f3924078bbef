// What the front doors work with: every part is MhaServer's (server/app), borrowed for the server's life, so the
// doors share them without reaching into each other.
#ifndef MHA_SERVER_RPC_SERVICE_PARTS_H_
#define MHA_SERVER_RPC_SERVICE_PARTS_H_

#include "server/backends/registry.h"
#include "server/calls/validate.h"
#include "server/config/server_options.h"
#include "server/layers/layer_store.h"
#include "server/metrics/metrics.h"
#include "server/rpc/call.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/transport/shared_memory.h"

namespace mha {

struct ServiceParts {
  CallEdge* edge = nullptr;
  const ServerOptions* options = nullptr;
  // The limits and registries every call is validated against (per-call fields left unset).
  const ValidationContext* validation = nullptr;
  LayerStore* layers = nullptr;
  BackendRegistry* backends = nullptr;
  Scheduler* scheduler = nullptr;
  SessionStore* sessions = nullptr;
  SharedMemoryRegistry* shared_memory = nullptr;
  ServerMetrics* metrics = nullptr;
};

}  // namespace mha

#endif  // MHA_SERVER_RPC_SERVICE_PARTS_H_
