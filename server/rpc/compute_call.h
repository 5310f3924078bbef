// A stateless compute call (MultiHeadAttention, ScaledDotProductAttention, and KServe's ModelInfer translated into
// one of them) from its admitted request to its end: validated on the handler's thread, handed to the scheduler as
// a WorkItem, computed alone or batched, and answered through its ReplyEncoder and its Call.
#ifndef MHA_SERVER_RPC_COMPUTE_CALL_H_
#define MHA_SERVER_RPC_COMPUTE_CALL_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/mha/v1/attention.pb.h"
#include "server/calls/execute.h"
#include "server/calls/validate.h"
#include "server/rpc/call.h"
#include "server/scheduling/scheduler.h"
#include "server/scheduling/work_item.h"

namespace mha {

// How a computed call's reply becomes its response: the native RPCs encode the reply as it is, KServe translates it.
template <typename Response>
class ReplyEncoder {
 public:
  virtual ~ReplyEncoder() = default;
  // Given the status the call reached and its reply (empty when it never computed), writes the response into `out`
  // when the status is OK, and returns the status the call ends with.
  virtual absl::Status Encode(absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out) = 0;
};

// The native encoding: the reply's message with its tensors' bytes as the backend wrote them.
template <typename Response>
class NativeReplyEncoder final : public ReplyEncoder<Response> {
 public:
  absl::Status Encode(absl::Status status, Reply<Response>* reply, grpc::ByteBuffer* out) override {
    return status.ok() ? reply->Encode(out) : status;
  }
};

// A request type's validation and execution.
template <typename Request, typename Response, typename Plan>
struct ComputeRoute {
  using Encoder = ReplyEncoder<Response>;
  absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&);
  absl::Status (*execute)(const Plan&, const StopSignal*, Reply<Response>*);
  // Null when calls of this route are never batched.
  absl::Status (*execute_batch)(absl::Span<const Plan* const>, const StopSignal*, absl::Span<Reply<Response>* const>);
};
using MhaRoute = ComputeRoute<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionResponse, MhaPlan>;
using SdpaRoute = ComputeRoute<v1::ScaledDotProductAttentionRequest, v1::ScaledDotProductAttentionResponse, SdpaPlan>;
inline constexpr MhaRoute kMhaRoute = {&ValidateMultiHeadAttention, &ExecuteMultiHeadAttention,
                                       &ExecuteMultiHeadAttentionBatch};
inline constexpr SdpaRoute kSdpaRoute = {&ValidateScaledDotProductAttention, &ExecuteScaledDotProductAttention,
                                         nullptr};

// One compute call as the scheduler sees it. Owns its Call, the request, the validated plan (which may point into
// the request), the reply and its encoder; the Call's context and response buffer are gRPC's until it finishes.
template <typename Request, typename Response, typename Plan>
class ComputeCall final : public WorkItem {
 public:
  using Route = ComputeRoute<Request, Response, Plan>;

  ComputeCall(Call call, std::unique_ptr<Request> request, Plan plan, const Route& route,
              std::unique_ptr<ReplyEncoder<Response>> encoder)
      : WorkItem(call.request_bytes(), call.received(), call.deadline()),
        call_(std::move(call)),
        request_(std::move(request)),
        plan_(std::move(plan)),
        route_(route),
        encoder_(std::move(encoder)) {}

  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return call_.IsCancelled(); }
  const std::string& owner() const override { return call_.caller().owner; }

  absl::Status Run(absl::Duration waited) override {
    const absl::Time started = absl::Now();
    absl::Status status = route_.execute(plan_, this, &reply_);
    const absl::Time computed = absl::Now();
    // A call whose client gave up or whose deadline passed while it computed ended so, whatever the backend said.
    if (status.ok()) status = Check();
    SetTiming(waited, started, computed);
    Finish(status, absl::ToDoubleSeconds(computed - started));
    return status;
  }

  // The batch key names the rpc, so `others` are calls of this same type.
  absl::Status RunBatch(absl::Span<WorkItem* const> others, absl::Span<const absl::Duration> waited) override {
    std::vector<ComputeCall*> calls = {this};
    for (WorkItem* other : others) calls.push_back(static_cast<ComputeCall*>(other));
    std::vector<const Plan*> plans;
    std::vector<Reply<Response>*> replies;
    std::vector<WorkItem*> items;
    for (ComputeCall* call : calls) {
      plans.push_back(&call->plan_);
      replies.push_back(&call->reply_);
      items.push_back(call);
    }
    const BatchStop stop(items);
    const absl::Time started = absl::Now();
    const absl::Status status = route_.execute_batch(plans, &stop, replies);
    const absl::Time computed = absl::Now();
    for (size_t i = 0; i < calls.size(); ++i) {
      calls[i]->SetTiming(waited[i], started, computed);
      calls[i]->Finish(status.ok() ? calls[i]->Check() : status, absl::ToDoubleSeconds(computed - started));
    }
    return status;
  }

  void Reject(const absl::Status& status) override { Finish(status, 0); }

 private:
  void SetTiming(absl::Duration waited, absl::Time started, absl::Time computed) {
    v1::Timing* timing = reply_.message.mutable_timing();
    timing->set_queue_us(absl::ToInt64Microseconds(waited));
    timing->set_compute_us(absl::ToInt64Microseconds(computed - started));
    timing->set_handler_us(absl::ToInt64Microseconds(computed - received()));
  }

  void Finish(absl::Status status, double compute_seconds) {
    if (status.ok()) {
      // The response's tensors keep their share of the in-flight memory until gRPC lets go of them, once sent (or
      // once the call ends unsent): a client that never reads cannot make the server hold more than the limit.
      auto hold = std::make_shared<const InflightHold>(TakeResponseHold());
      for (TensorBytes* tensor : {&reply_.output, &reply_.attention_weights}) {
        if (hold->bytes() > 0 && tensor->field != 0 && tensor->data.size() > 0) {
          tensor->data = SliceKeeping(std::move(tensor->data), hold);
        }
      }
    }
    status = encoder_->Encode(std::move(status), &reply_, call_.response());
    CallOutcome outcome;
    outcome.detail = plan_.shapes;
    outcome.backend = plan_.backend->name();
    outcome.compute_seconds = compute_seconds;
    outcome.flops = status.ok() ? plan_.flops : 0;
    call_.Finish(status, outcome);
  }

  Call call_;
  const std::unique_ptr<Request> request_;
  const Plan plan_;
  const Route& route_;
  const std::unique_ptr<ReplyEncoder<Response>> encoder_;
  Reply<Response> reply_;
};

// A compute call's way from an admitted request to the scheduler: `admitted` (the status of Call::Admit and of
// whatever a front door did before) ends the call at once when it is not OK; else the request is validated with
// `validation` and `scans` (Admit's), and the call ends at once on a validation error or goes to `scheduler`.
// Errors go through `encoder` too. Returns the call's reactor.
template <typename Request, typename Response, typename Plan>
grpc::ServerUnaryReactor* SubmitCompute(
    Call call, const absl::Status& admitted, std::unique_ptr<Request> request, std::vector<FiniteScan> scans,
    const ComputeRoute<Request, Response, Plan>& route,
    std::unique_ptr<typename ComputeRoute<Request, Response, Plan>::Encoder> encoder,
    const ValidationContext& validation, Scheduler* scheduler) {
  grpc::ServerUnaryReactor* reactor = call.reactor();
  ValidationContext context = validation;
  context.finite_scans = scans;
  absl::StatusOr<Plan> plan = admitted.ok() ? route.validate(*request, context) : absl::StatusOr<Plan>(admitted);
  if (!plan.ok()) {
    Reply<Response> none;
    return call.Finish(encoder->Encode(plan.status(), &none, call.response()));
  }
  scheduler->Submit(std::make_unique<ComputeCall<Request, Response, Plan>>(
      std::move(call), std::move(request), *std::move(plan), route, std::move(encoder)));
  return reactor;
}

}  // namespace mha

#endif  // MHA_SERVER_RPC_COMPUTE_CALL_H_
