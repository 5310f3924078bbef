// The plan of an Extend whose sessions are held: what the backend computes (the paged problem, each item's cache
// and new tokens) and what the session store reserves. Made by ValidateExtendHeld (validate_session.h), computed by
// execute_session.h.
#ifndef MHA_SERVER_SESSIONS_EXTEND_PLAN_H_
#define MHA_SERVER_SESSIONS_EXTEND_PLAN_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "proto/mha/v1/attention.pb.h"
#include "server/backends/backend.h"
#include "server/calls/plan.h"
#include "server/layers/layer.h"
#include "server/sessions/session_store.h"

namespace mha {

// Borrows the request.
struct ExtendPlan : AttentionPlan {
  PagedProblem paged;
  std::shared_ptr<const Layer> layer;  // a layer session's layer at layer_index
  struct Item {
    const v1::ExtendItem* request = nullptr;
    int64_t length = 0;      // of the cache before the call
    int64_t new_tokens = 0;  // n
    bool append = true;      // false: attends to the cache alone, writes nothing (ExtendItem.append)
  };
  std::vector<Item> items;
  std::vector<ReserveItem> reserve;  // what the store is asked for, one per item
};

}  // namespace mha

#endif  // MHA_SERVER_SESSIONS_EXTEND_PLAN_H_
