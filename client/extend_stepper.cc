#include "client/extend_stepper.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mha {

struct ExtendStepper::Open {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ExtendRequest, v1::ExtendResponse>> stream;
  absl::Time deadline;
};

namespace {

// A stream reset on its way (an RST_STREAM, which gRPC reports as INTERNAL "Received RST_STREAM with error code N")
// was cut by a hop, not answered by the server, which never resets a stream: a proxy whose upstream died resets the
// streams it carried, where a unary call there would have got UNAVAILABLE. So it is UNAVAILABLE, as the unary call's
// would be, for callers' retries and session recovery alike (the step may or may not have reached the server).
absl::Status ReportedReset(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInternal || !absl::StartsWith(status.message(), "Received RST_STREAM")) {
    return status;
  }
  return absl::UnavailableError(absl::StrCat("the stream was reset on its way to the server (", status.message(), ")"));
}

}  // namespace

ExtendStepper::ExtendStepper(AttentionClient* client) : client_(client) {}

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
  const bool reused = open_ != nullptr;
  if (open_ == nullptr) OpenFor(request);
  bool written = open_->stream->Write(request);
  if (!written && reused) {
    // The stream ended while idle (its server restarted, its connection broke): the step was not sent, so it goes
    // on a new stream instead of failing as the old one did.
    Close();
    OpenFor(request);
    written = open_->stream->Write(request);
  }
  v1::ExtendResponse response;
  if (written && open_->stream->Read(&response)) return response;
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
  return ReportedReset(status);
}

std::unique_ptr<ExtendStepper> ExtendStreams::Take(const std::string& key, std::unique_ptr<ExtendStepper>* stale) {
  absl::MutexLock lock(&mu_);
  if (auto mine = idle_.find(key); mine != idle_.end()) {
    std::unique_ptr<ExtendStepper> stepper = std::move(mine->second.back().stepper);
    mine->second.pop_back();
    if (mine->second.empty()) idle_.erase(mine);
    return stepper;
  }
  if (opened_ < max_streams_) {
    ++opened_;
    return std::make_unique<ExtendStepper>(client_);
  }
  // The stream idle the longest, if it has been idle long enough to be a session's that no longer steps.
  auto oldest = idle_.end();
  for (auto it = idle_.begin(); it != idle_.end(); ++it) {
    if (oldest == idle_.end() || it->second.front().since < oldest->second.front().since) oldest = it;
  }
  if (oldest == idle_.end() || absl::Now() - oldest->second.front().since < kStaleAfter) return nullptr;
  *stale = std::move(oldest->second.front().stepper);
  oldest->second.erase(oldest->second.begin());
  if (oldest->second.empty()) idle_.erase(oldest);
  return std::make_unique<ExtendStepper>(client_);
}

int ExtendStreams::open_streams() const {
  absl::MutexLock lock(&mu_);
  return opened_;
}

absl::StatusOr<v1::ExtendResponse> ExtendStreams::Extend(const v1::ExtendRequest& request) {
  if (!streaming()) return client_->ExtendUnary(request);
  const std::string key = request.items_size() > 0 ? request.items(0).session_id() : "";
  std::unique_ptr<ExtendStepper> stale;
  std::unique_ptr<ExtendStepper> stepper = Take(key, &stale);
  stale.reset();  // ends its stream, outside the lock
  if (stepper == nullptr) return client_->ExtendUnary(request);  // as many streams open as may be
  absl::StatusOr<v1::ExtendResponse> response = stepper->Step(request);
  if (!stepper->streaming()) streaming_.store(false, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  idle_[key].push_back({std::move(stepper), absl::Now()});
  return response;
}

}  // namespace mha
