#include "client/extend_stepper.h"

#include <utility>

#include "absl/time/clock.h"

namespace mha {

struct ExtendStepper::Open {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ExtendRequest, v1::ExtendResponse>> stream;
  absl::Time deadline;
};

ExtendStepper::ExtendStepper(AttentionClient* client) : client_(client) {}
ExtendStepper::ExtendStepper(ExtendStepper&&) noexcept = default;
ExtendStepper& ExtendStepper::operator=(ExtendStepper&&) noexcept = default;

ExtendStepper::~ExtendStepper() {
  if (open_ != nullptr) Close();
}

void ExtendStepper::OpenFor(const v1::ExtendRequest& request) {
  open_ = std::make_unique<Open>();
  open_->deadline = absl::Now() + 2 * client_->options().timeout;
  open_->context.set_deadline(absl::ToChronoTime(open_->deadline));
  if (request.items_size() > 0) open_->context.AddMetadata("mha-session-id", request.items(0).session_id());
  open_->stream = client_->stub()->ExtendStream(&open_->context);
}

void ExtendStepper::Close() {
  // No step is under way, so cancelling loses nothing and, unlike a half-close, waits for no answer.
  std::unique_ptr<Open> open = std::move(open_);
  open->context.TryCancel();
  open->stream->Finish();
}

absl::StatusOr<v1::ExtendResponse> ExtendStepper::Step(const v1::ExtendRequest& request) {
  if (!streaming_) return client_->ExtendUnary(request);
  // A stream with less than a timeout left is ended between steps, where that costs nothing.
  if (open_ != nullptr && open_->deadline - absl::Now() < client_->options().timeout) Close();
  if (open_ == nullptr) OpenFor(request);
  v1::ExtendResponse response;
  if (open_->stream->Write(request) && open_->stream->Read(&response)) return response;
  // The stream ended: its status is the step's.
  std::unique_ptr<Open> ended = std::move(open_);
  const absl::Status status = FromGrpcStatus(ended->stream->Finish());
  // (Finish has received the initial metadata, which may be asked for only then.)
  const bool answered_before = !ended->context.GetServerInitialMetadata().empty();
  if (status.code() == absl::StatusCode::kUnimplemented && !answered_before) {
    streaming_ = false;  // a server without ExtendStream, which answers before sending any metadata
    return client_->ExtendUnary(request);
  }
  if (status.ok()) return absl::InternalError("the server ended the stream without answering the step");
  return status;
}

absl::StatusOr<v1::ExtendResponse> ExtendStreams::Extend(const v1::ExtendRequest& request) {
  if (!streaming()) return client_->ExtendUnary(request);
  std::unique_ptr<ExtendStepper> stepper;
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      stepper = std::move(idle_.back());
      idle_.pop_back();
    } else if (opened_ < max_streams_) {
      stepper = std::make_unique<ExtendStepper>(client_);
      ++opened_;
    }
  }
  if (stepper == nullptr) return client_->ExtendUnary(request);  // every stream is stepping
  absl::StatusOr<v1::ExtendResponse> response = stepper->Step(request);
  if (!stepper->streaming()) streaming_.store(false, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  idle_.push_back(std::move(stepper));
  return response;
}

}  // namespace mha
