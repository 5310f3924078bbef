#include "server/rpc/kserve/model_stats.h"

#include "server/rpc/kserve/infer_request.h"

namespace mha {
namespace {

void Add(absl::Duration duration, inference::StatisticDuration* to) {
  to->set_count(to->count() + 1);
  to->set_ns(to->ns() + static_cast<uint64_t>(absl::ToInt64Nanoseconds(duration)));
}

}  // namespace

void ModelStats::Record(const std::string& model, const Call& call) {
  absl::MutexLock lock(&mu_);
  inference::ModelStatistics& stats = models_[model];
  inference::InferStatistics& infer = *stats.mutable_inference_stats();
  stats.set_last_inference(static_cast<uint64_t>(absl::ToUnixMillis(call.finished)));
  if (!call.ok) {
    Add(call.total, infer.mutable_fail());
    return;
  }
  Add(call.total, infer.mutable_success());
  Add(call.queue, infer.mutable_queue());
  Add(call.compute, infer.mutable_compute_infer());
  stats.set_inference_count(stats.inference_count() + static_cast<uint64_t>(call.batch_items));
  stats.set_execution_count(stats.execution_count() + 1);
}

inference::ModelStatistics ModelStats::Get(const std::string& model) const {
  inference::ModelStatistics stats;
  {
    absl::MutexLock lock(&mu_);
    const auto it = models_.find(model);
    if (it != models_.end()) stats = it->second;
  }
  stats.set_name(model);
  stats.set_version(kModelVersion);
  return stats;
}

void ModelStats::Prune(size_t max_models, const std::function<bool(const std::string&)>& keep) {
  absl::MutexLock lock(&mu_);
  if (models_.size() <= max_models) return;
  for (auto it = models_.begin(); it != models_.end();) {
    it = keep(it->first) ? std::next(it) : models_.erase(it);
  }
}

}  // namespace mha
