// Per-model call statistics for KServe v2's ModelStatistics, from what each ModelInfer call already measures.
// Thread-safe.
#ifndef MHA_SERVER_RPC_KSERVE_MODEL_STATS_H_
#define MHA_SERVER_RPC_KSERVE_MODEL_STATS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/inference/grpc_service.pb.h"

namespace mha {

class ModelStats {
 public:
  // One finished ModelInfer call of `model`: its whole duration, and for a call that computed, its queue and
  // compute times and batch items (0 when it failed before computing).
  struct Call {
    bool ok = false;
    absl::Duration total, queue, compute;
    int64_t batch_items = 0;
    absl::Time finished;
  };
  void Record(const std::string& model, const Call& call);

  // `model`'s statistics (zeros for a model never called).
  inference::ModelStatistics Get(const std::string& model) const;

  // Forgets the models `keep` refuses, once more than `max_models` are held: so that layers loaded and unloaded
  // under ever new names cannot grow the table without bound.
  void Prune(size_t max_models, const std::function<bool(const std::string&)>& keep);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, inference::ModelStatistics> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mha

#endif  // MHA_SERVER_RPC_KSERVE_MODEL_STATS_H_
