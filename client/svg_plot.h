// Per-head attention weights as an SVG image: one heatmap per head in a grid, each titled "head i / KV group g",
// queries down the left side and keys along the bottom, labelled with token indices or given token strings, and one
// colour scale (0 to the largest weight) shared by all heads so that they can be compared.
//
// Structure a test (or a script) can rely on: every panel is <g class="head" data-head="i" data-kv-group="g"> holding
// a <text class="title">, Tq * Tk <rect class="cell"> elements (row-major, data-q / data-k attributes), and
// <text class="query-label"> / <text class="key-label"> axis labels; with head_stats, a <text class="stats"> under the
// title ("entropy 2.31, distance 3.2, contribution 0.34") whose data-entropy, data-distance and data-contribution
// attributes hold the values.
#ifndef MHA_CLIENT_SVG_PLOT_H_
#define MHA_CLIENT_SVG_PLOT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mha {

// A head's softmax statistics shown under its panel's title (v1::HeadStats, one batch item's values).
struct PanelStats {
  float entropy = 0;       // nats
  float distance = 0;      // positions
  float contribution = 0;  // ||head_i W_O[i]|| / ||output||
};

struct HeadsPlot {
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // Hkv, divides H; query head i belongs to KV group i / (H / Hkv)
  int64_t query_len = 0;     // Tq
  int64_t key_len = 0;       // Tk
  std::vector<float> weights;              // [H, Tq, Tk] row-major, one batch item's softmax probabilities
  std::vector<std::string> query_labels;   // Tq labels, or empty for indices 0..Tq-1
  std::vector<std::string> key_labels;     // Tk labels, or empty for indices
  std::string title;                       // a line above the grid; may be empty
  int64_t columns = 0;                     // panels per row; 0 = ceil(sqrt(H))
  std::vector<PanelStats> head_stats;      // H entries, one per panel, or empty for no annotation
};

// Cells (H * Tq * Tk) one image may hold; beyond it the file would be too large to view.
inline constexpr int64_t kMaxPlotCells = 1 << 20;

// The SVG document. INVALID_ARGUMENT if the sizes disagree (weights size, label counts, head_stats count, H % Hkv),
// if a dimension is < 1, or if there are more than kMaxPlotCells cells.
absl::StatusOr<std::string> RenderHeadsSvg(const HeadsPlot& plot);

}  // namespace mha

#endif  // MHA_CLIENT_SVG_PLOT_H_
