#include "client/merge_attention.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mha {
namespace {

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::Status CheckShapes(const std::vector<Array>& outputs, const std::vector<Array>& lses) {
  if (outputs.empty() || outputs.size() != lses.size()) {
    return absl::InvalidArgumentError(absl::StrCat("MergeAttention needs one lse per output and at least one of each (got ",
                                                   outputs.size(), " outputs, ", lses.size(), " lses)"));
  }
  const std::vector<int64_t>& shape = outputs[0].shape;
  if (shape.size() < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("outputs must be laid out [..., T, H, d_k]; got shape ", ShapeText(shape)));
  }
  std::vector<int64_t> lse_shape(shape.begin(), shape.end() - 3);
  lse_shape.push_back(shape[shape.size() - 2]);
  lse_shape.push_back(shape[shape.size() - 3]);
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "] has shape ", ShapeText(outputs[i].shape),
                                                     ", outputs[0] ", ShapeText(shape)));
    }
    if (lses[i].shape != lse_shape) {
      return absl::InvalidArgumentError(absl::StrCat("lses[", i, "] has shape ", ShapeText(lses[i].shape),
                                                     "; outputs of shape ", ShapeText(shape),
                                                     " need [..., H, T] = ", ShapeText(lse_shape)));
    }
    if (static_cast<int64_t>(outputs[i].values.size()) != Elements(shape) ||
        static_cast<int64_t>(lses[i].values.size()) != Elements(lse_shape)) {
      return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "] or lses[", i, "] has ",
                                                     outputs[i].values.size(), " and ", lses[i].values.size(),
                                                     " values for shapes ", ShapeText(shape), " and ",
                                                     ShapeText(lse_shape)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MergedAttention> MergeAttention(const std::vector<Array>& outputs, const std::vector<Array>& lses) {
  if (absl::Status shapes = CheckShapes(outputs, lses); !shapes.ok()) return shapes;
  const std::vector<int64_t>& shape = outputs[0].shape;
  const size_t rank = shape.size();
  const int64_t T = shape[rank - 3], H = shape[rank - 2], dk = shape[rank - 1];
  const int64_t prefix = Elements(std::vector<int64_t>(shape.begin(), shape.end() - 3));
  MergedAttention merged{{shape, std::vector<float>(Elements(shape), 0.0f)}, {lses[0].shape, {}}};
  merged.lse.values.resize(lses[0].values.size());
  std::vector<double> row(dk);
  for (int64_t p = 0; p < prefix; ++p) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (p * H + h) * T + t;
        double peak = -INFINITY;
        for (const Array& lse : lses) peak = std::max(peak, static_cast<double>(lse.values[at]));
        if (!std::isfinite(peak)) peak = 0;  // every shard -inf: the sum below is 0 and lse -inf
        double sum = 0;
        for (const Array& lse : lses) sum += std::exp(lse.values[at] - peak);
        const double total = peak + std::log(sum);
        merged.lse.values[at] = static_cast<float>(total);
        if (!std::isfinite(total)) continue;  // no visible key in any shard: the row stays zero
        std::fill(row.begin(), row.end(), 0.0);
        const int64_t base = ((p * T + t) * H + h) * dk;
        for (size_t s = 0; s < outputs.size(); ++s) {
          const double weight = std::exp(lses[s].values[at] - total);
          if (!(weight > 0)) continue;  // a shard that sees no key here adds nothing
          for (int64_t d = 0; d < dk; ++d) row[d] += weight * outputs[s].values[base + d];
        }
        for (int64_t d = 0; d < dk; ++d) merged.output.values[base + d] = static_cast<float>(row[d]);
      }
    }
  }
  return merged;
}

}  // namespace mha
