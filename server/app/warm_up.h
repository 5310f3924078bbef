// The backends warmed up before the server serves: each one's WarmUp runs on the thread that computes its calls
// (the compute thread for a CPU backend), where its thread pools must start, and is timed a second time to seed
// the scheduler's rate for it.
#ifndef MHA_SERVER_APP_WARM_UP_H_
#define MHA_SERVER_APP_WARM_UP_H_

#include "server/backends/registry.h"
#include "server/scheduling/scheduler.h"

namespace mha {

// Every available backend of `backends`, one after the other; returns with the scheduler idle, so that nothing of
// the warm-up looks like a running call.
void WarmUpBackends(const BackendRegistry& backends, Scheduler* scheduler);

}  // namespace mha

#endif  // MHA_SERVER_APP_WARM_UP_H_
