#include "server/rpc/extend_stream.h"

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"

namespace mha {
namespace {

// States, in order, for each step: reading (StartRead) -> running (OnReadDone made the step's Call) -> writing
// (End with OK started the write) -> reading again (OnWriteDone). A step that fails, a client that half-closes or
// cancels, or a write that fails, ends the stream (Finish). Only one of gRPC's reactions and the step's end is ever
// under way at once, each starting the operation whose completion runs the next, so the reactor needs no lock.
class ExtendStreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                  private CallEnd {
 public:
  ExtendStreamReactor(grpc::CallbackServerContext* context, CallEdge* edge, const StepRunner* run)
      : context_(context), edge_(edge), run_(run), request_id_(edge->RequestId(*context)) {
    context->AddInitialMetadata("x-request-id", request_id_);
    context->AddInitialMetadata("mha-instance-id", edge->instance_id());
    StartSendInitialMetadata();
    Handing();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    Handed();
    if (!ok) {  // the client half-closed (or the stream is gone): every step it sent is answered
      Handing();
      Finish(grpc::Status::OK);
      return;
    }
    Count(+1);
    ++steps_;
    (*run_)(Call(edge_, "ExtendStream", context_, &request_, &response_, this, absl::StrCat(request_id_, ".", steps_)));
  }

  void OnWriteDone(bool ok) override {
    Handed();
    Count(-1);
    response_.Clear();
    Handing();
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away before a step's answer was sent"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    Handed();
    Count(-counted_);
    delete this;
  }

  // gRPC runs these reactions inline on the thread that completes an operation: each only starts the next
  // operation or hands the step to the sequencer, which is what a unary handler does on that thread too.
  bool InternalInlineable() override { return true; }

 private:
  // The step's end (CallEnd), on whichever thread ended it: an OK step's answer is written, a failed step ends the
  // stream with its status.
  void End(const grpc::Status& status) override {
    Handing();
    if (status.ok()) {
      StartWrite(&response_);
    } else {
      Finish(status);
    }
  }
  // The reactor's fields pass from the thread that starts an operation (Handing, just before) to the gRPC thread
  // whose reaction its completion runs (Handed, first thing). gRPC's core orders the two already, through code
  // ThreadSanitizer cannot see; this states the order in code it can.
  void Handing() { handoffs_.fetch_add(1, std::memory_order_release); }
  void Handed() { handoffs_.load(std::memory_order_acquire); }
  // Counts the stream in progress while a step is in flight (CallEdge::calls_in_progress), so that a shutdown
  // waits for steps under way but not for idle streams.
  void Count(int delta) {
    counted_ += delta;
    edge_->in_progress_counter()->fetch_add(delta, std::memory_order_acq_rel);
  }

  grpc::CallbackServerContext* const context_;
  CallEdge* const edge_;
  const StepRunner* const run_;
  const std::string request_id_;
  grpc::ByteBuffer request_, response_;
  int64_t steps_ = 0;
  int counted_ = 0;
  std::atomic<int64_t> handoffs_{0};  // Handing and Handed
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartExtendStream(grpc::CallbackServerContext* context,
                                                                               CallEdge* edge, const StepRunner* run) {
  return new ExtendStreamReactor(context, edge, run);
}

}  // namespace mha
