#include "server/sessions/execute_session.h"

#include <algorithm>
#include <cmath>

#include "proto/mha/v1/tensor_codec.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

// The depth at which a step of max_step_rows rows reaches its work bound; past it a prefill's steps take fewer
// rows. Every step pays its hand-off and a read of the cache it sees: a bound at depth 0 cut a long prompt into
// hundreds of steps of a few tokens, each far below the kernels' rate. At 512 a step stays a fraction of a decode
// step of a batch of long sessions (docs/DESIGN.md has the numbers).
constexpr double kStepDepth = 512;

ConstTensor View(const v1::Tensor& t) { return {t.data().data(), t.dtype()}; }

// Makes `tensor` shaped `shape` in `dtype` with zeroed bytes; returns the view the backend writes into.
MutableTensor Allocate(std::initializer_list<int64_t> shape, v1::DataType dtype, v1::Tensor* tensor) {
  int64_t count = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    count *= d;
  }
  tensor->set_dtype(dtype);
  std::string* data = tensor->mutable_data();
  data->resize(count * DTypeSize(dtype));
  return {data->data(), dtype};
}

// `t` advanced by `rows` rows of `width` elements (a null view stays null).
ConstTensor Skip(ConstTensor t, int64_t rows, int64_t width) {
  if (t.data != nullptr) t.data = static_cast<const char*>(t.data) + rows * width * DTypeSize(t.dtype);
  return t;
}
MutableTensor Skip(MutableTensor t, int64_t rows, int64_t width) {
  if (t.data != nullptr) t.data = static_cast<char*>(t.data) + rows * width * DTypeSize(t.dtype);
  return t;
}

}  // namespace

ExtendSteps::ExtendSteps(const ExtendPlan& plan, const ExtendReservation& reservation, int64_t max_step_rows,
                         v1::ExtendResponse* response)
    : plan_(plan), response_(response),
      max_step_rows_(plan.paged.return_weights || plan.paged.return_stats ||
                             std::any_of(plan.items.begin(), plan.items.end(),
                                         [](const ExtendPlan::Item& item) { return !item.append; })
                         ? 0
                         : max_step_rows) {
  const PagedProblem& p = plan.paged;
  whole_.resize(plan.items.size());
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const ExtendPlan::Item& item = plan.items[i];
    const v1::ExtendItem& request = *item.request;
    PagedSequence& seq = whole_[i];
    seq.blocks = reservation.items()[i].blocks;
    seq.length = item.length;
    seq.new_tokens = item.new_tokens;
    seq.append = item.append;
    if (p.d_model > 0) {
      seq.x = View(request.x());
    } else {
      seq.q = View(request.q());
      if (item.append) {
        seq.k = View(request.k());
        seq.v = View(request.v());
      }
    }
  }
  response->set_backend(std::string(plan.backend->name()));
}

void ExtendSteps::AllocateOutputs() {
  const PagedProblem& p = plan_.paged;
  const HeadSpec& h = p.heads;
  stats_.reserve(plan_.items.size());
  for (size_t i = 0; i < plan_.items.size(); ++i) {
    const ExtendPlan::Item& item = plan_.items[i];
    PagedSequence& seq = whole_[i];
    stats_.emplace_back(plan_.stats, 1, h.num_heads, item.new_tokens, /*has_w_o=*/p.d_model > 0);
    seq.stats = stats_.back().View();
    v1::ExtendResult* result = response_->add_results();
    result->set_length(item.length + (item.append ? item.new_tokens : 0));
    seq.out = p.d_model > 0 ? Allocate({item.new_tokens, p.d_model}, p.output_dtype, result->mutable_output())
                            : Allocate({item.new_tokens, h.num_heads, h.head_dim}, p.output_dtype,
                                       result->mutable_output());
    if (p.return_weights) {
      seq.weights = Allocate({h.num_heads, item.new_tokens, seq.Keys()}, p.output_dtype,
                             result->mutable_attention_weights());
    }
  }
  allocated_ = true;
}

template <typename Visit>
void ExtendSteps::ForNext(Visit visit) const {
  if (max_step_rows_ <= 0) {
    for (size_t i = next_item_; i < whole_.size(); ++i) visit(i, int64_t{0}, whole_[i].new_tokens);
    return;
  }
  // Rows and (query, key) pairs per head: a step does at most the attention of max_step_rows tokens after
  // kStepDepth cached ones, so that a chunk deep into a long prefill (whose rows each see the whole cache) takes no
  // longer than that (unless relaxed); every step takes at least one token.
  int64_t rows = max_step_rows_;
  const double most = static_cast<double>(max_step_rows_);
  double pairs = most * (kStepDepth + 0.5 * (most + 1));
  int64_t first = next_token_;
  for (size_t i = next_item_; i < whole_.size() && rows > 0; ++i, first = 0) {
    const double seen = static_cast<double>(whole_[i].length + first) + 0.5;  // a row sees seen + r / 2 keys, mean
    const int64_t fits =
        relaxed_ ? rows : static_cast<int64_t>(std::floor(std::sqrt(std::max(0.0, seen * seen + 2 * pairs)) - seen));
    const int64_t tokens = std::min({whole_[i].new_tokens - first, rows, std::max<int64_t>(fits, 0)});
    if (tokens <= 0 && i != next_item_) break;
    const int64_t taken = std::max<int64_t>(tokens, 1);
    visit(i, first, taken);
    rows -= taken;
    pairs -= static_cast<double>(taken) * (seen + 0.5 * static_cast<double>(taken));
    if (taken < whole_[i].new_tokens - first) break;  // the budget ends inside this item
  }
}

int64_t ExtendSteps::NextRows() const {
  int64_t rows = 0;
  ForNext([&rows](size_t, int64_t, int64_t tokens) { rows += tokens; });
  return rows;
}

double ExtendSteps::NextFlops() const {
  double flops = 0;
  ForNext([this, &flops](size_t i, int64_t first, int64_t tokens) {
    flops += ExtendFlops(plan_.paged.heads, plan_.paged.d_model, whole_[i].length + first, tokens, whole_[i].append);
  });
  return flops;
}

void ExtendSteps::TakeNext(std::vector<PagedSequence>* sequences) {
  if (!allocated_) AllocateOutputs();
  const PagedProblem& p = plan_.paged;
  const HeadSpec& h = p.heads;
  const int64_t out_width = p.d_model > 0 ? p.d_model : h.q_width();
  size_t last = next_item_;
  int64_t end = next_token_;
  ForNext([&](size_t i, int64_t first, int64_t tokens) {
    PagedSequence part = whole_[i];
    if (first > 0 || tokens < part.new_tokens) {  // a chunk: only ever of a call without weights or statistics
      part.length += first;
      part.new_tokens = tokens;
      part.x = Skip(part.x, first, p.d_model);
      part.q = Skip(part.q, first, h.q_width());
      part.k = Skip(part.k, first, h.kv_width());
      part.v = Skip(part.v, first, h.kv_width());
      part.out = Skip(part.out, first, out_width);
    }
    sequences->push_back(part);
    last = i;
    end = first + tokens;
  });
  if (end == whole_[last].new_tokens) {
    next_item_ = last + 1;
    next_token_ = 0;
  } else {
    next_item_ = last;
    next_token_ = end;
  }
  ++steps_;
}

void ExtendSteps::FillStats() {
  for (size_t i = 0; i < whole_.size(); ++i) {
    const PagedSequence& seq = whole_[i];
    stats_[i].FillInto([&seq](int64_t, int64_t row) { return PagedVisibleKeys(seq, row); }, /*batched=*/false,
                       response_->mutable_results(static_cast<int>(i)));
  }
}

absl::Status ComputeExtendStep(const ExtendPlan& plan, absl::Span<const PagedSequence> sequences,
                               const StopSignal* stop) {
  PagedArgs args;
  args.problem = plan.paged;
  PagedProblem& p = args.problem;
  p.sequences = static_cast<int64_t>(sequences.size());
  p.new_tokens = p.max_new_tokens = p.max_length = 0;
  for (const PagedSequence& seq : sequences) {
    p.new_tokens += seq.new_tokens;
    p.max_new_tokens = std::max(p.max_new_tokens, seq.new_tokens);
    p.max_length = std::max(p.max_length, seq.Keys());
  }
  args.stop = stop;
  if (plan.layer != nullptr) args.weights = plan.layer->Weights();
  args.sequences = sequences;
  return plan.backend->PagedAttention(args);
}

absl::Status ExecuteExtend(const ExtendPlan& plan, const ExtendReservation& reservation, const StopSignal* stop,
                           v1::ExtendResponse* response) {
  ExtendSteps steps(plan, reservation, /*max_step_rows=*/0, response);
  std::vector<PagedSequence> sequences;
  steps.TakeNext(&sequences);
  RETURN_IF_ERROR(ComputeExtendStep(plan, sequences, stop));
  steps.FillStats();
  return absl::OkStatus();
}

}  // namespace mha
