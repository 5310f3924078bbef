#include "server/execute_session.h"

#include <vector>

#include "proto/mha/v1/tensor_codec.h"

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
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const ExtendPlan::Item& item = plan.items[i];
    const ExtendReservation::Item& reserved = reservation.items()[i];
    const v1::ExtendItem& request = *item.request;
    PagedSequence& seq = sequences[i];
    seq.blocks = reserved.blocks;
    seq.length = item.length;
    seq.new_tokens = item.new_tokens;
    if (p.d_model > 0) {
      seq.x = View(request.x());
    } else {
      seq.q = View(request.q());
      seq.k = View(request.k());
      seq.v = View(request.v());
    }
    v1::ExtendResult* result = response->add_results();
    result->set_length(item.length + item.new_tokens);
    seq.out = p.d_model > 0 ? Allocate({item.new_tokens, p.d_model}, p.output_dtype, result->mutable_output())
                            : Allocate({item.new_tokens, h.num_heads, h.head_dim}, p.output_dtype,
                                       result->mutable_output());
    if (p.return_weights) {
      seq.weights = Allocate({h.num_heads, item.new_tokens, item.length + item.new_tokens}, p.output_dtype,
                             result->mutable_attention_weights());
    }
  }
  PagedArgs args;
  args.problem = p;
  args.stop = stop;
  if (plan.layer != nullptr) args.weights = plan.layer->Weights();
  args.sequences = sequences;
  response->set_backend(std::string(plan.backend->name()));
  return plan.backend->PagedAttention(args);
}

}  // namespace mha
