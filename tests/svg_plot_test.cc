// The SVG heatmap grid: one titled panel per head with Tq * Tk cells, labels escaped, colours ordered by weight, the
// heads' statistics under their titles, and inconsistent inputs rejected. (tests/client_e2e parses a real plot with
// an XML parser.)
#include "client/svg_plot.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The fill colour of the first cell (q, k) in the document.
std::string FillOf(const std::string& svg, int q, int k) {
  const size_t cell = svg.find(absl::StrCat("data-q=\"", q, "\" data-k=\"", k, "\""));
  if (cell == std::string::npos) return "<no cell>";
  const size_t fill = svg.find("fill=\"", cell) + 6;
  return svg.substr(fill, svg.find('"', fill) - fill);
}

HeadsPlot Plot(int64_t h, int64_t hkv, int64_t tq, int64_t tk) {
  HeadsPlot plot;
  plot.num_heads = h;
  plot.num_kv_heads = hkv;
  plot.query_len = tq;
  plot.key_len = tk;
  plot.weights.assign(h * tq * tk, 1.0f / static_cast<float>(tk));
  return plot;
}

TEST(RenderHeadsSvg, OnePanelPerHeadLabelledWithItsKvGroup) {
  absl::StatusOr<std::string> svg = RenderHeadsSvg(Plot(8, 2, 3, 5));
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_TRUE(absl::StartsWith(*svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg "));
  EXPECT_TRUE(absl::EndsWith(*svg, "</svg>\n"));
  EXPECT_EQ(Count(*svg, "<g class=\"head\""), 8);
  EXPECT_EQ(Count(*svg, "<rect class=\"cell\""), 8 * 3 * 5);
  // Four query heads per KV head: heads 0-3 are group 0, 4-7 group 1.
  EXPECT_THAT(*svg, HasSubstr(">head 3 / KV group 0</text>"));
  EXPECT_THAT(*svg, HasSubstr(">head 4 / KV group 1</text>"));
  EXPECT_THAT(*svg, HasSubstr("data-head=\"7\" data-kv-group=\"1\""));
  EXPECT_EQ(Count(*svg, "class=\"query-label\""), 8 * 3);
  EXPECT_EQ(Count(*svg, "class=\"key-label\""), 8 * 5);
}

TEST(RenderHeadsSvg, TokenLabelsAreEscaped) {
  HeadsPlot plot = Plot(1, 1, 2, 2);
  plot.query_labels = {"<s>", "a&b"};
  plot.key_labels = {"\"q\"", "it's"};
  plot.title = "x < y";
  absl::StatusOr<std::string> svg = RenderHeadsSvg(plot);
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_THAT(*svg, HasSubstr(">&lt;s&gt;</text>"));
  EXPECT_THAT(*svg, HasSubstr(">a&amp;b</text>"));
  EXPECT_THAT(*svg, HasSubstr(">&quot;q&quot;</text>"));
  EXPECT_THAT(*svg, HasSubstr(">it&apos;s</text>"));
  EXPECT_THAT(*svg, HasSubstr(">x &lt; y</text>"));
  EXPECT_THAT(*svg, Not(HasSubstr("<s>")));
}

TEST(RenderHeadsSvg, LargestWeightGetsTheTopColourAndZeroTheBottom) {
  HeadsPlot plot = Plot(1, 1, 1, 2);
  plot.weights = {0.0f, 0.25f};  // the scale runs from 0 to the largest weight
  absl::StatusOr<std::string> svg = RenderHeadsSvg(plot);
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_EQ(FillOf(*svg, 0, 0), "#440154");  // viridis' dark end
  EXPECT_EQ(FillOf(*svg, 0, 1), "#fde725");  // viridis' bright end
}

TEST(RenderHeadsSvg, LongSequencesLabelEveryFewTokens) {
  absl::StatusOr<std::string> svg = RenderHeadsSvg(Plot(1, 1, 100, 64));
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_EQ(Count(*svg, "class=\"query-label\""), 25);  // every 4th of 100
  EXPECT_EQ(Count(*svg, "class=\"key-label\""), 32);    // every 2nd of 64
}

TEST(RenderHeadsSvg, HeadStatsAnnotateEachPanelUnderItsTitle) {
  HeadsPlot plot = Plot(2, 2, 2, 2);
  plot.head_stats = {{0.5f, 1.25f, 0.75f}, {2.0f, 0.0f, 0.125f}};
  absl::StatusOr<std::string> svg = RenderHeadsSvg(plot);
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_EQ(Count(*svg, "<text class=\"stats\""), 2);
  EXPECT_THAT(*svg, HasSubstr("data-entropy=\"0.5\" data-distance=\"1.25\" data-contribution=\"0.75\">"
                              "entropy 0.5, distance 1.25, contribution 0.75</text>"));
  EXPECT_THAT(*svg, HasSubstr(">entropy 2, distance 0, contribution 0.125</text>"));
  // The annotation sits between the panel's title and its cells.
  const size_t title = svg->find(">head 1</text>"), stats = svg->find("entropy 2,"),
               cell = svg->find("<rect class=\"cell\"", title);
  EXPECT_LT(title, stats);
  EXPECT_LT(stats, cell);
  EXPECT_THAT(*RenderHeadsSvg(Plot(2, 2, 2, 2)), Not(HasSubstr("class=\"stats\"")));
  plot.head_stats.pop_back();
  EXPECT_EQ(RenderHeadsSvg(plot).status().message(), "1 head statistics for 2 heads");
}

TEST(RenderHeadsSvg, RejectsInconsistentInputs) {
  HeadsPlot short_weights = Plot(2, 1, 3, 3);
  short_weights.weights.pop_back();
  EXPECT_EQ(RenderHeadsSvg(short_weights).status().message(),
            "plot weights hold 17 values; [H, Tq, Tk] = [2, 3, 3] needs 18");
  EXPECT_EQ(RenderHeadsSvg(Plot(6, 4, 2, 2)).status().message(), "Hkv 4 does not divide H 6");
  HeadsPlot labels = Plot(1, 1, 2, 2);
  labels.query_labels = {"a", "b", "c"};
  EXPECT_EQ(RenderHeadsSvg(labels).status().message(), "3 query labels for 2 queries");
  EXPECT_EQ(RenderHeadsSvg(Plot(0, 1, 2, 2)).status().code(), absl::StatusCode::kInvalidArgument);
  HeadsPlot huge;
  huge.num_heads = huge.num_kv_heads = 16;
  huge.query_len = huge.key_len = 512;
  EXPECT_EQ(RenderHeadsSvg(huge).status().message(),
            "plot of 16 heads of 512x512 cells exceeds 1048576 cells; use shorter sequences");
}

}  // namespace
}  // namespace mha
