#include "client/head_stats_report.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace mha {
namespace {

// The six fields in the order every format shows them: contribution first, as the ranking uses it.
struct Field {
  const char* name;
  const google::protobuf::RepeatedField<float>& (v1::HeadStats::*values)() const;
  double HeadSummary::*mean;
};
constexpr Field kFields[] = {
    {"contribution", &v1::HeadStats::contribution, &HeadSummary::contribution},
    {"entropy", &v1::HeadStats::entropy, &HeadSummary::entropy},
    {"normalized_entropy", &v1::HeadStats::normalized_entropy, &HeadSummary::normalized_entropy},
    {"confidence", &v1::HeadStats::confidence, &HeadSummary::confidence},
    {"distance", &v1::HeadStats::distance, &HeadSummary::distance},
    {"sink_mass", &v1::HeadStats::sink_mass, &HeadSummary::sink_mass},
};

constexpr char kBoundNote[] =
    "upper bound: per row, ||sum of the ablated heads' head_i W_O[i]|| <= the sum of their norms, so the mean "
    "relative change per row is at most the sum of their contributions";

}  // namespace

absl::StatusOr<std::vector<HeadSummary>> RankHeads(const v1::HeadStats& stats, int64_t batch, int64_t num_heads,
                                                   int64_t num_kv_heads) {
  if (batch < 1 || num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return absl::InternalError(absl::StrCat("head statistics for B ", batch, ", H ", num_heads, ", Hkv ",
                                            num_kv_heads));
  }
  std::vector<HeadSummary> heads(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) {
    heads[h].head = h;
    heads[h].kv_group = h / (num_heads / num_kv_heads);
  }
  for (const Field& field : kFields) {
    const auto& values = (stats.*field.values)();
    if (values.size() != batch * num_heads) {
      return absl::InternalError(absl::StrCat("the server returned ", values.size(), " values of head_stats.",
                                              field.name, "; expected B x H = ", batch * num_heads));
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      double sum = 0;
      for (int64_t b = 0; b < batch; ++b) sum += values[b * num_heads + h];
      heads[h].*field.mean = sum / static_cast<double>(batch);
    }
  }
  std::stable_sort(heads.begin(), heads.end(),
                   [](const HeadSummary& a, const HeadSummary& b) { return a.contribution > b.contribution; });
  return heads;
}

absl::Status MeasureAblation(const std::vector<float>& output, const std::vector<float>& ablated_output,
                             int64_t d_model, const std::vector<HeadSummary>& ranked, Ablation* ablation) {
  if (d_model < 1 || output.size() != ablated_output.size() || output.size() % d_model != 0) {
    return absl::InvalidArgumentError(absl::StrCat("outputs of ", output.size(), " and ", ablated_output.size(),
                                                   " values do not share rows of ", d_model, " features"));
  }
  const size_t rows = output.size() / d_model;
  double diff_total = 0, norm_total = 0, row_changes = 0;
  for (size_t r = 0; r < rows; ++r) {
    double diff = 0, norm = 0;
    for (int64_t j = 0; j < d_model; ++j) {
      const double x = output[r * d_model + j], d = ablated_output[r * d_model + j] - x;
      diff += d * d;
      norm += x * x;
    }
    diff_total += diff;
    norm_total += norm;
    if (norm > 0) row_changes += std::sqrt(diff / norm);
  }
  ablation->relative_change = norm_total > 0 ? std::sqrt(diff_total / norm_total) : 0;
  ablation->mean_row_change = rows > 0 ? row_changes / static_cast<double>(rows) : 0;
  ablation->predicted_bound = 0;
  for (int64_t head : ablation->heads) {
    for (const HeadSummary& s : ranked) {
      if (s.head == head) ablation->predicted_bound += s.contribution;
    }
  }
  return absl::OkStatus();
}

std::string FormatAblationLine(const Ablation& a) {
  return absl::StrFormat(
      "ablated %d head%s (%s): relative change ||out' - out|| / ||out|| %.4f, mean per row %.4f; predicted upper "
      "bound (sum of their contributions) %.4f\n",
      a.heads.size(), a.heads.size() == 1 ? "" : "s", absl::StrJoin(a.heads, ", "), a.relative_change,
      a.mean_row_change, a.predicted_bound);
}

std::string FormatHeadsPretty(const HeadsReport& report) {
  std::string out = absl::StrFormat("heads: %s, %s, backend %s; means over %d batch item%s, ranked by contribution\n",
                                    report.weights, report.shape, report.backend, report.batch,
                                    report.batch == 1 ? "" : "s");
  absl::StrAppendFormat(&out, "%4s %4s %8s %12s %8s %12s %10s %8s %9s\n", "rank", "head", "kv_group", "contribution",
                        "entropy", "norm_entropy", "confidence", "distance", "sink_mass");
  for (size_t i = 0; i < report.ranked.size(); ++i) {
    const HeadSummary& s = report.ranked[i];
    absl::StrAppendFormat(&out, "%4d %4d %8d %12.4f %8.4f %12.4f %10.4f %8.3f %9.4f\n", i + 1, s.head, s.kv_group,
                          s.contribution, s.entropy, s.normalized_entropy, s.confidence, s.distance, s.sink_mass);
  }
  out += "contribution: ||head_i W_O[i]|| / ||output|| per query row; entropy in nats; distance in positions\n";
  if (report.ablation.has_value()) {
    out += FormatAblationLine(*report.ablation);
    out += absl::StrCat("  (", kBoundNote, ")\n");
  }
  return out;
}

std::string FormatHeadsJson(const HeadsReport& report) {
  nlohmann::ordered_json json;
  json["weights"] = report.weights;
  json["shape"] = report.shape;
  json["backend"] = report.backend;
  json["batch"] = report.batch;
  json["heads"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < report.ranked.size(); ++i) {
    const HeadSummary& s = report.ranked[i];
    nlohmann::ordered_json head = {{"rank", i + 1}, {"head", s.head}, {"kv_group", s.kv_group}};
    for (const Field& field : kFields) head[field.name] = s.*field.mean;
    json["heads"].push_back(head);
  }
  json["ablation"] = nullptr;
  if (report.ablation.has_value()) {
    const Ablation& a = *report.ablation;
    json["ablation"] = {{"heads", a.heads},
                        {"relative_change", a.relative_change},
                        {"mean_row_change", a.mean_row_change},
                        {"predicted_bound", a.predicted_bound},
                        {"bound", kBoundNote}};
  }
  return json.dump(2) + "\n";
}

std::string FormatHeadsCsv(const HeadsReport& report) {
  std::string out = "rank,head,kv_group";
  for (const Field& field : kFields) absl::StrAppend(&out, ",", field.name);
  out += report.ablation.has_value() ? ",ablated\n" : "\n";
  for (size_t i = 0; i < report.ranked.size(); ++i) {
    const HeadSummary& s = report.ranked[i];
    absl::StrAppendFormat(&out, "%d,%d,%d", i + 1, s.head, s.kv_group);
    for (const Field& field : kFields) absl::StrAppendFormat(&out, ",%.6g", s.*field.mean);
    if (report.ablation.has_value()) {
      const std::vector<int64_t>& ablated = report.ablation->heads;
      out += std::find(ablated.begin(), ablated.end(), s.head) != ablated.end() ? ",1" : ",0";
    }
    out += "\n";
  }
  return out;
}

}  // namespace mha
