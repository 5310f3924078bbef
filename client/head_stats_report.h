// What `mha_client heads` prints: every head's softmax statistics (means over the batch items) ranked by
// contribution, and, after an ablation, how much the output moved next to what the contributions predicted.
// Pure functions of the server's answers, rendered as pretty text, JSON or CSV.
#ifndef MHA_CLIENT_HEAD_STATS_REPORT_H_
#define MHA_CLIENT_HEAD_STATS_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// One head's HeadStats fields, each the mean over the batch items of the server's per-item values.
struct HeadSummary {
  int64_t head = 0;
  int64_t kv_group = 0;  // head / (H / Hkv)
  double entropy = 0, normalized_entropy = 0, confidence = 0, distance = 0, sink_mass = 0, contribution = 0;
};

// Means over the `batch` items of the B x H values of `stats` (row-major by item, then head), ranked by
// contribution, largest first (ties: lower head index first). INTERNAL if a field does not hold B x H values or
// Hkv does not divide H.
absl::StatusOr<std::vector<HeadSummary>> RankHeads(const v1::HeadStats& stats, int64_t batch, int64_t num_heads,
                                                   int64_t num_kv_heads);

// The output's change when some heads are masked out. Since output = b_o + sum_i head_i W_O[i], a query row moves
// by exactly the ablated heads' sum of head_i W_O[i], whose norm is at most the sum of their norms (the triangle
// inequality): per row, ||out'_r - out_r|| / ||out_r|| <= sum over the ablated heads of contribution_i,r.
struct Ablation {
  std::vector<int64_t> heads;   // the ablated heads, least contributing first
  double relative_change = 0;   // ||out' - out|| / ||out|| over the whole [B, Tq, d_model] output
  double mean_row_change = 0;   // the mean over the B * Tq rows of ||out'_r - out_r|| / ||out_r|| (0 for a zero row)
  double predicted_bound = 0;   // sum of the ablated heads' mean contributions: an upper bound of mean_row_change
};

// Fills relative_change and mean_row_change from two outputs of d_model features per row; the predicted bound
// from `ranked`. INVALID_ARGUMENT if the outputs' sizes differ or are not a multiple of d_model.
absl::Status MeasureAblation(const std::vector<float>& output, const std::vector<float>& ablated_output,
                             int64_t d_model, const std::vector<HeadSummary>& ranked, Ablation* ablation);

struct HeadsReport {
  std::string weights;  // "layer demo" or "file w.safetensors"
  std::string shape;    // AttentionShapeString
  std::string backend;
  int64_t batch = 0;
  std::vector<HeadSummary> ranked;  // RankHeads
  std::optional<Ablation> ablation;
};

// The table, one line per head; then the ablation, with the bound named as an upper bound.
std::string FormatHeadsPretty(const HeadsReport& report);
// One object: the request, "heads" (ranked, the six statistics each) and "ablation" (or null).
std::string FormatHeadsJson(const HeadsReport& report);
// A header and one row per head, ranked; with an ablation an "ablated" column (1 or 0). The ablation's numbers are
// not in the table: FormatAblationLine has them.
std::string FormatHeadsCsv(const HeadsReport& report);
// One line: the measured change and the predicted bound.
std::string FormatAblationLine(const Ablation& ablation);

}  // namespace mha

#endif  // MHA_CLIENT_HEAD_STATS_REPORT_H_
