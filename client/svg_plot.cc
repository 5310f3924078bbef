#include "client/svg_plot.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mha {
namespace {

// Viridis, sampled at 9 evenly spaced points; colours in between are interpolated linearly.
constexpr std::array<std::array<int, 3>, 9> kViridis = {{{68, 1, 84},
                                                         {71, 44, 122},
                                                         {59, 81, 139},
                                                         {44, 113, 142},
                                                         {33, 144, 141},
                                                         {39, 173, 129},
                                                         {92, 200, 99},
                                                         {170, 220, 50},
                                                         {253, 231, 37}}};

std::string Colour(double t) {
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * (kViridis.size() - 1);
  const size_t i = std::min(static_cast<size_t>(t), kViridis.size() - 2);
  const double f = t - static_cast<double>(i);
  int rgb[3];
  for (int c = 0; c < 3; ++c) rgb[c] = static_cast<int>(std::lround(kViridis[i][c] * (1 - f) + kViridis[i + 1][c] * f));
  return absl::StrFormat("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // XML 1.0 forbids most control characters even when escaped.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t') out += c;
    }
  }
  return out;
}

std::string Label(const std::vector<std::string>& labels, int64_t i) {
  return labels.empty() ? absl::StrCat(i) : labels[i];
}

// Label every step-th token so that at most ~32 labels share an axis.
int64_t LabelStep(int64_t n) { return std::max<int64_t>(1, (n + 31) / 32); }

// Where everything goes: square-ish cells, the longer axis of a panel about 320 px (cells between 2 and 24 px).
struct Layout {
  double cell = 0, label_space = 0, panel_w = 0, panel_h = 0, stats_h = 0, top = 0, width = 0, height = 0;
  int64_t columns = 0, rows = 0;
};

std::string StatsText(const PanelStats& s) {
  return absl::StrFormat("entropy %.3g, distance %.3g, contribution %.3g", s.entropy, s.distance, s.contribution);
}

Layout PlanLayout(const HeadsPlot& plot) {
  const int64_t h = plot.num_heads, tq = plot.query_len, tk = plot.key_len;
  Layout l;
  l.cell = std::clamp(320.0 / static_cast<double>(std::max(tq, tk)), 2.0, 24.0);
  size_t longest_label = 1, longest_stats = 0;
  for (int64_t i = 0; i < tq; ++i) longest_label = std::max(longest_label, Label(plot.query_labels, i).size());
  for (int64_t i = 0; i < tk; ++i) longest_label = std::max(longest_label, Label(plot.key_labels, i).size());
  for (const PanelStats& s : plot.head_stats) longest_stats = std::max(longest_stats, StatsText(s).size());
  l.label_space = 12 + 6.5 * static_cast<double>(std::min<size_t>(longest_label, 16));
  l.stats_h = plot.head_stats.empty() ? 0 : 14;
  // The annotation (10 px, about 5.6 px per character) fits in its panel.
  l.panel_w = l.label_space + std::max(tk * l.cell, 5.6 * static_cast<double>(longest_stats)) + 16;
  l.panel_h = 24 + l.stats_h + tq * l.cell + l.label_space;
  l.columns = plot.columns > 0 ? std::min(plot.columns, h)
                               : static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(h))));
  l.rows = (h + l.columns - 1) / l.columns;
  l.top = plot.title.empty() ? 8 : 32;
  const double legend_h = 48;
  // Wide enough for the title and the legend (about 8 px per character at 14 px).
  l.width = std::max({l.columns * l.panel_w + 16, 16 + 8.0 * static_cast<double>(plot.title.size()), 560.0});
  l.height = l.top + l.rows * l.panel_h + legend_h;
  return l;
}

absl::Status CheckPlot(const HeadsPlot& plot) {
  const int64_t h = plot.num_heads, hkv = plot.num_kv_heads, tq = plot.query_len, tk = plot.key_len;
  if (h < 1 || hkv < 1 || tq < 1 || tk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("plot needs H, Hkv, Tq, Tk >= 1; got ", h, ", ", hkv, ", ", tq, ", ", tk));
  }
  if (h % hkv != 0) return absl::InvalidArgumentError(absl::StrCat("Hkv ", hkv, " does not divide H ", h));
  if (h > kMaxPlotCells / tq / tk) {
    return absl::InvalidArgumentError(absl::StrCat("plot of ", h, " heads of ", tq, "x", tk, " cells exceeds ",
                                                   kMaxPlotCells, " cells; use shorter sequences"));
  }
  if (static_cast<int64_t>(plot.weights.size()) != h * tq * tk) {
    return absl::InvalidArgumentError(absl::StrCat("plot weights hold ", plot.weights.size(),
                                                   " values; [H, Tq, Tk] = [", h, ", ", tq, ", ", tk, "] needs ",
                                                   h * tq * tk));
  }
  if (!plot.query_labels.empty() && static_cast<int64_t>(plot.query_labels.size()) != tq) {
    return absl::InvalidArgumentError(
        absl::StrCat(plot.query_labels.size(), " query labels for ", tq, " queries"));
  }
  if (!plot.key_labels.empty() && static_cast<int64_t>(plot.key_labels.size()) != tk) {
    return absl::InvalidArgumentError(absl::StrCat(plot.key_labels.size(), " key labels for ", tk, " keys"));
  }
  if (!plot.head_stats.empty() && static_cast<int64_t>(plot.head_stats.size()) != h) {
    return absl::InvalidArgumentError(absl::StrCat(plot.head_stats.size(), " head statistics for ", h, " heads"));
  }
  return absl::OkStatus();
}

// The cells of one head's heatmap, whose top-left corner is (gx, gy); colours scaled by `scale`.
void AppendCells(const HeadsPlot& plot, int64_t head, double gx, double gy, double cell, double scale,
                 std::string* svg) {
  const int64_t tq = plot.query_len, tk = plot.key_len;
  const bool cell_titles = plot.num_heads * tq * tk <= 16384;  // hover values, while the file stays small
  for (int64_t q = 0; q < tq; ++q) {
    for (int64_t k = 0; k < tk; ++k) {
      const float w = plot.weights[(head * tq + q) * tk + k];
      absl::StrAppendFormat(svg,
                            "<rect class=\"cell\" data-q=\"%d\" data-k=\"%d\" x=\"%.2f\" y=\"%.2f\" "
                            "width=\"%.2f\" height=\"%.2f\" fill=\"%s\"",
                            q, k, gx + k * cell, gy + q * cell, cell, cell, Colour(w * scale));
      if (cell_titles) {
        absl::StrAppendFormat(svg, "><title>%s -&gt; %s: %.4f</title></rect>\n", Escape(Label(plot.query_labels, q)),
                              Escape(Label(plot.key_labels, k)), w);
      } else {
        *svg += "/>\n";
      }
    }
  }
}

void AppendPanel(const HeadsPlot& plot, const Layout& l, int64_t head, double scale, std::string* svg) {
  const int64_t tq = plot.query_len, tk = plot.key_len, group_size = plot.num_heads / plot.num_kv_heads;
  const double x0 = 8 + (head % l.columns) * l.panel_w, y0 = l.top + (head / l.columns) * l.panel_h;
  const double gx = x0 + l.label_space, gy = y0 + 24 + l.stats_h, cell = l.cell;
  absl::StrAppendFormat(svg,
                        "<g class=\"head\" data-head=\"%d\" data-kv-group=\"%d\" shape-rendering=\"crispEdges\">\n",
                        head, head / group_size);
  // KV groups are worth naming only when heads share a KV head (GQA, MQA); with MHA each head is its own.
  const std::string title = group_size > 1 ? absl::StrFormat("head %d / KV group %d", head, head / group_size)
                                           : absl::StrFormat("head %d", head);
  absl::StrAppendFormat(svg,
                        "<text class=\"title\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" font-weight=\"bold\">"
                        "%s</text>\n",
                        gx, y0 + 16, title);
  if (!plot.head_stats.empty()) {
    const PanelStats& s = plot.head_stats[head];
    absl::StrAppendFormat(svg,
                          "<text class=\"stats\" x=\"%.1f\" y=\"%.1f\" font-size=\"10\" fill=\"#333\" "
                          "data-entropy=\"%.6g\" data-distance=\"%.6g\" data-contribution=\"%.6g\">%s</text>\n",
                          gx, y0 + 30, s.entropy, s.distance, s.contribution, StatsText(s));
  }
  AppendCells(plot, head, gx, gy, cell, scale, svg);
  absl::StrAppendFormat(svg,
                        "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"none\" "
                        "stroke=\"#444\" stroke-width=\"0.5\"/>\n",
                        gx, gy, tk * cell, tq * cell);
  const double font = std::clamp(cell * 0.8, 7.0, 11.0);
  for (int64_t q = 0; q < tq; q += LabelStep(tq)) {
    absl::StrAppendFormat(svg,
                          "<text class=\"query-label\" x=\"%.2f\" y=\"%.2f\" font-size=\"%.1f\" "
                          "text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
                          gx - 3, gy + (q + 0.5) * cell, font, Escape(Label(plot.query_labels, q)));
  }
  for (int64_t k = 0; k < tk; k += LabelStep(tk)) {
    const double x = gx + (k + 0.5) * cell, y = gy + tq * cell + 4;
    absl::StrAppendFormat(svg,
                          "<text class=\"key-label\" x=\"%.2f\" y=\"%.2f\" font-size=\"%.1f\" "
                          "text-anchor=\"end\" dominant-baseline=\"middle\" "
                          "transform=\"rotate(-60 %.2f %.2f)\">%s</text>\n",
                          x, y, font, x, y, Escape(Label(plot.key_labels, k)));
  }
  *svg += "</g>\n";
}

// Colour scale: 0 to the largest weight in the figure.
void AppendLegend(const Layout& l, float max_weight, std::string* svg) {
  const double ly = l.top + l.rows * l.panel_h + 8, lx = 8, lw = 240;
  *svg += "<g class=\"legend\">\n";
  for (int i = 0; i < 48; ++i) {
    absl::StrAppendFormat(svg, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"12\" fill=\"%s\"/>\n",
                          lx + i * lw / 48, ly, lw / 48 + 0.3, Colour((i + 0.5) / 48));
  }
  absl::StrAppendFormat(svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">0</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%.3g</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">attention weight (rows: queries, "
                        "columns: keys)</text>\n",
                        lx, ly + 24, lx + lw, ly + 24, max_weight, lx + lw + 12, ly + 10);
  *svg += "</g>\n";
}

}  // namespace

absl::StatusOr<std::string> RenderHeadsSvg(const HeadsPlot& plot) {
  if (absl::Status s = CheckPlot(plot); !s.ok()) return s;
  const Layout layout = PlanLayout(plot);
  float max_weight = 0;
  for (float w : plot.weights) {
    if (std::isfinite(w)) max_weight = std::max(max_weight, w);
  }
  const double scale = max_weight > 0 ? 1.0 / max_weight : 1.0;
  std::string svg = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
      "font-family=\"sans-serif\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      layout.width, layout.height, layout.width, layout.height);
  if (!plot.title.empty()) {
    absl::StrAppendFormat(&svg, "<text class=\"figure-title\" x=\"8\" y=\"20\" font-size=\"14\">%s</text>\n",
                          Escape(plot.title));
  }
  for (int64_t head = 0; head < plot.num_heads; ++head) AppendPanel(plot, layout, head, scale, &svg);
  AppendLegend(layout, max_weight, &svg);
  svg += "</svg>\n";
  return svg;
}

}  // namespace mha
