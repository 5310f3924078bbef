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

}  // namespace

absl::StatusOr<std::string> RenderHeadsSvg(const HeadsPlot& plot) {
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

  // Geometry: square-ish cells, the longer axis of a panel about 320 px (cells between 2 and 24 px).
  const double cell = std::clamp(320.0 / static_cast<double>(std::max(tq, tk)), 2.0, 24.0);
  size_t longest_label = 1;
  for (int64_t i = 0; i < tq; ++i) longest_label = std::max(longest_label, Label(plot.query_labels, i).size());
  for (int64_t i = 0; i < tk; ++i) longest_label = std::max(longest_label, Label(plot.key_labels, i).size());
  const double label_space = 12 + 6.5 * static_cast<double>(std::min<size_t>(longest_label, 16));
  const double panel_w = label_space + tk * cell + 16, panel_h = 24 + tq * cell + label_space;
  const int64_t columns = plot.columns > 0 ? std::min(plot.columns, h)
                                           : static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(h))));
  const int64_t rows = (h + columns - 1) / columns;
  const double top = plot.title.empty() ? 8 : 32, legend_h = 48;
  // Wide enough for the title and the legend (about 8 px per character at 14 px).
  const double width = std::max({columns * panel_w + 16, 16 + 8.0 * static_cast<double>(plot.title.size()), 560.0});
  const double height = top + rows * panel_h + legend_h;

  float max_weight = 0;
  for (float w : plot.weights) {
    if (std::isfinite(w)) max_weight = std::max(max_weight, w);
  }
  const double scale = max_weight > 0 ? 1.0 / max_weight : 1.0;
  const bool cell_titles = h * tq * tk <= 16384;  // hover values, while the file stays small

  std::string svg = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
      "font-family=\"sans-serif\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height, width, height);
  if (!plot.title.empty()) {
    absl::StrAppendFormat(&svg, "<text class=\"figure-title\" x=\"8\" y=\"20\" font-size=\"14\">%s</text>\n",
                          Escape(plot.title));
  }
  const int64_t group_size = h / hkv;
  const int64_t q_step = LabelStep(tq), k_step = LabelStep(tk);
  const double font = std::clamp(cell * 0.8, 7.0, 11.0);
  for (int64_t head = 0; head < h; ++head) {
    const double x0 = 8 + (head % columns) * panel_w, y0 = top + (head / columns) * panel_h;
    const double gx = x0 + label_space, gy = y0 + 24;
    absl::StrAppendFormat(&svg,
                          "<g class=\"head\" data-head=\"%d\" data-kv-group=\"%d\" shape-rendering=\"crispEdges\">\n",
                          head, head / group_size);
    // KV groups are worth naming only when heads share a KV head (GQA, MQA); with MHA each head is its own.
    const std::string title = group_size > 1 ? absl::StrFormat("head %d / KV group %d", head, head / group_size)
                                             : absl::StrFormat("head %d", head);
    absl::StrAppendFormat(&svg,
                          "<text class=\"title\" x=\"%.1f\" y=\"%.1f\" font-size=\"12\" font-weight=\"bold\">"
                          "%s</text>\n",
                          gx, y0 + 16, title);
    for (int64_t q = 0; q < tq; ++q) {
      for (int64_t k = 0; k < tk; ++k) {
        const float w = plot.weights[(head * tq + q) * tk + k];
        absl::StrAppendFormat(&svg,
                              "<rect class=\"cell\" data-q=\"%d\" data-k=\"%d\" x=\"%.2f\" y=\"%.2f\" "
                              "width=\"%.2f\" height=\"%.2f\" fill=\"%s\"",
                              q, k, gx + k * cell, gy + q * cell, cell, cell, Colour(w * scale));
        if (cell_titles) {
          absl::StrAppendFormat(&svg, "><title>%s -&gt; %s: %.4f</title></rect>\n",
                                Escape(Label(plot.query_labels, q)), Escape(Label(plot.key_labels, k)), w);
        } else {
          svg += "/>\n";
        }
      }
    }
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"none\" "
                          "stroke=\"#444\" stroke-width=\"0.5\"/>\n",
                          gx, gy, tk * cell, tq * cell);
    for (int64_t q = 0; q < tq; q += q_step) {
      absl::StrAppendFormat(&svg,
                            "<text class=\"query-label\" x=\"%.2f\" y=\"%.2f\" font-size=\"%.1f\" "
                            "text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
                            gx - 3, gy + (q + 0.5) * cell, font, Escape(Label(plot.query_labels, q)));
    }
    for (int64_t k = 0; k < tk; k += k_step) {
      const double x = gx + (k + 0.5) * cell, y = gy + tq * cell + 4;
      absl::StrAppendFormat(&svg,
                            "<text class=\"key-label\" x=\"%.2f\" y=\"%.2f\" font-size=\"%.1f\" "
                            "text-anchor=\"end\" dominant-baseline=\"middle\" "
                            "transform=\"rotate(-60 %.2f %.2f)\">%s</text>\n",
                            x, y, font, x, y, Escape(Label(plot.key_labels, k)));
    }
    svg += "</g>\n";
  }

  // Colour scale: 0 to the largest weight in the figure.
  const double ly = top + rows * panel_h + 8, lx = 8, lw = 240;
  svg += "<g class=\"legend\">\n";
  for (int i = 0; i < 48; ++i) {
    absl::StrAppendFormat(&svg, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"12\" fill=\"%s\"/>\n",
                          lx + i * lw / 48, ly, lw / 48 + 0.3, Colour((i + 0.5) / 48));
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">0</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%.3g</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">attention weight (rows: queries, "
                        "columns: keys)</text>\n",
                        lx, ly + 24, lx + lw, ly + 24, max_weight, lx + lw + 12, ly + 10);
  svg += "</g>\n</svg>\n";
  return svg;
}

}  // namespace mha
