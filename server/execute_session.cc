#include "server/execute_session.h"

#include <vector>

#include "proto/mha/v1/tensor_codec.h"
#include "server/head_stats.h"
#include "server/status_macros.h"

namespace mha {
namespace {

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

}  // namespace

absl::Status ExecuteExtend(const ExtendPlan& plan, const ExtendReservation& reservation, const StopSignal* stop,
                           v1::ExtendResponse* response) {
  const PagedProblem& p = plan.paged;
  const HeadSpec& h = p.heads;
  std::vector<PagedSequence> sequences(plan.items.size());
  std::vector<StatsBuffers> stats;
  stats.reserve(plan.items.size());
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const ExtendPlan::Item& item = plan.items[i];
    const ExtendReservation::Item& reserved = reservation.items()[i];
    const v1::ExtendItem& request = *item.request;
    PagedSequence& seq = sequences[i];
    seq.blocks = reserved.blocks;
    seq.length = item.length;
    seq.new_tokens = item.new_tokens;
    seq.append = item.append;
    stats.emplace_back(plan.stats, 1, h.num_heads, item.new_tokens, /*has_w_o=*/p.d_model > 0);
    seq.stats = stats.back().View();
    if (p.d_model > 0) {
      seq.x = View(request.x());
    } else {
      seq.q = View(request.q());
      if (item.append) {
        seq.k = View(request.k());
        seq.v = View(request.v());
      }
    }
    v1::ExtendResult* result = response->add_results();
    result->set_length(item.length + (item.append ? item.new_tokens : 0));
    seq.out = p.d_model > 0 ? Allocate({item.new_tokens, p.d_model}, p.output_dtype, result->mutable_output())
                            : Allocate({item.new_tokens, h.num_heads, h.head_dim}, p.output_dtype,
                                       result->mutable_output());
    if (p.return_weights) {
      seq.weights = Allocate({h.num_heads, item.new_tokens, seq.Keys()}, p.output_dtype,
                             result->mutable_attention_weights());
    }
  }
  PagedArgs args;
  args.problem = p;
  args.stop = stop;
  if (plan.layer != nullptr) args.weights = plan.layer->Weights();
  args.sequences = sequences;
  response->set_backend(std::string(plan.backend->name()));
  RETURN_IF_ERROR(plan.backend->PagedAttention(args));
  for (size_t i = 0; i < sequences.size(); ++i) {
    const PagedSequence& seq = sequences[i];
    v1::ExtendResult* result = response->mutable_results(static_cast<int>(i));
    stats[i].FillInto([&seq](int64_t, int64_t row) { return PagedVisibleKeys(seq, row); }, /*batched=*/false,
                      result);
  }
  return absl::OkStatus();
}

}  // namespace mha
