#include "server/calls/head_stats.h"

#include <cmath>
#include <cstring>

namespace mha {

StatsBuffers::StatsBuffers(const StatsRequest& request, int64_t items, int64_t heads, int64_t rows, bool has_w_o)
    : request_(request), items_(items), heads_(heads), rows_(rows) {
  const size_t n = static_cast<size_t>(items * heads * rows);
  if (request.any()) lse_.resize(n);
  if (request.head_stats) {
    for (std::vector<float>* v : {&entropy_, &confidence_, &distance_, &sink_}) v->resize(n);
    if (has_w_o) contribution_.resize(n);
  }
}

RowStats StatsBuffers::View() {
  const auto at = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  RowStats stats;
  stats.lse = at(lse_);
  stats.entropy = at(entropy_);
  stats.confidence = at(confidence_);
  stats.distance = at(distance_);
  stats.sink = at(sink_);
  stats.contribution = at(contribution_);
  stats.sink_tokens = request_.sink_tokens;
  return stats;
}

void StatsBuffers::Fill(absl::FunctionRef<int64_t(int64_t, int64_t)> visible_keys, bool batched, v1::Tensor* lse,
                        v1::HeadStats* head_stats, v1::HeadStats* row_stats) const {
  if (request_.lse) {
    if (batched) lse->add_shape(items_);
    lse->add_shape(heads_);
    lse->add_shape(rows_);
    lse->set_dtype(v1::FP32);
    lse->set_data(lse_.data(), lse_.size() * sizeof(float));  // little-endian hosts only, as the codec
  }
  if (!request_.head_stats) return;
  // normalized_entropy per row: entropy / ln(visible keys), 0 for one key.
  std::vector<float> normalized(lse_.size());
  for (int64_t b = 0; b < items_; ++b) {
    for (int64_t r = 0; r < rows_; ++r) {
      const int64_t keys = visible_keys(b, r);
      for (int64_t h = 0; h < heads_; ++h) {
        const size_t at = static_cast<size_t>((b * heads_ + h) * rows_ + r);
        normalized[at] = keys > 1 ? static_cast<float>(entropy_[at] / std::log(static_cast<double>(keys))) : 0.0f;
      }
    }
  }
  const std::vector<float>* sources[] = {&entropy_, &normalized, &confidence_, &distance_, &sink_, &contribution_};
  const auto field = [](v1::HeadStats* s, int k) {
    google::protobuf::RepeatedField<float>* fields[] = {
        s->mutable_entropy(), s->mutable_normalized_entropy(), s->mutable_confidence(),
        s->mutable_distance(), s->mutable_sink_mass(),         s->mutable_contribution()};
    return fields[k];
  };
  for (int k = 0; k < 6; ++k) {
    const std::vector<float>& values = *sources[k];
    if (values.empty()) continue;
    for (int64_t bh = 0; bh < items_ * heads_; ++bh) {
      double sum = 0;
      int64_t counted = 0;
      for (int64_t r = 0; r < rows_; ++r) {
        const size_t at = static_cast<size_t>(bh * rows_ + r);
        const bool sees = lse_[at] != -INFINITY;  // NaN rows count, and make the mean NaN
        if (sees) {
          sum += values[at];
          ++counted;
        }
        if (request_.row_stats) field(row_stats, k)->Add(sees ? values[at] : 0.0f);
      }
      field(head_stats, k)->Add(counted > 0 ? static_cast<float>(sum / counted) : 0.0f);
    }
  }
}

}  // namespace mha
