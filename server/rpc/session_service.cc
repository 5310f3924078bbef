// The session RPCs of AttentionService (service.h). Each call waits at the sessions' sequencer for the sessions it
// names, then runs: CreateSession, ForkSession, TruncateSession, CloseSession and ListSessions answer at once (on
// the thread that started them); an Extend is validated against its held sessions, reserves its blocks and goes to
// the scheduler as a WorkItem that computes, commits, answers and lets its sessions go.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"
#include "server/rpc/service.h"
#include "server/sessions/execute_session.h"
#include "server/sessions/validate_session.h"

namespace mha {

namespace {

// How a call that waited for its sessions stands when its turn comes: CANCELLED once its client gave up,
// DEADLINE_EXCEEDED past its deadline.
absl::Status StillWanted(const grpc::CallbackServerContext& context, absl::Time deadline) {
  if (context.IsCancelled()) return absl::CancelledError("the client cancelled the call while it waited for its session");
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError("the call's deadline passed while it waited for its session");
  }
  return absl::OkStatus();
}

std::string SessionDetail(const std::vector<std::string>& ids) {
  if (ids.empty()) return "-";
  return ids.size() == 1 ? absl::StrCat("session=", ids[0])
                         : absl::StrCat("session=", ids[0], " and ", ids.size() - 1, " more");
}

}  // namespace

// A session RPC that answers at its turn with what Handle computes: handle(request, caller, &response) -> Status.
template <typename Request, typename Response, typename Handle>
class SequencedCall final : public SessionSequencer::Call {
 public:
  SequencedCall(AttentionService* service, std::string rid, const char* rpc, grpc::CallbackServerContext* context,
                grpc::ServerUnaryReactor* reactor, grpc::ByteBuffer* out, Request request, SessionCaller caller,
                std::vector<std::string> ids, absl::Time received, Handle handle)
      : service_(service), rid_(std::move(rid)), rpc_(rpc), context_(context), reactor_(reactor), out_(out),
        request_(std::move(request)), caller_(std::move(caller)), ids_(std::move(ids)), received_(received),
        deadline_(service->DeadlineOf(*context, received)), handle_(std::move(handle)) {}

  void Start() override {
    SessionHold hold(&service_->sessions_->sequencer(), ids_);
    Response response;
    absl::Status status = StillWanted(*context_, deadline_);
    if (status.ok()) status = handle_(request_, caller_, &response);
    if (status.ok()) status = Serialize(response, out_);
    service_->sessions_->Touch(ids_);
    hold.Release();
    Finish(status);
  }
  void Abandon(const absl::Status& status) override { Finish(status); }

 private:
  void Finish(const absl::Status& status) {
    service_->CallDone(rid_, rpc_, SessionDetail(ids_), "", status, received_);
    reactor_->Finish(ToGrpcStatus(status));
  }

  AttentionService* const service_;
  const std::string rid_;
  const char* const rpc_;
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer* const out_;
  const Request request_;
  const SessionCaller caller_;
  const std::vector<std::string> ids_;
  const absl::Time received_, deadline_;
  Handle handle_;
};

template <typename Request, typename Response, typename Ids, typename Handle>
grpc::ServerUnaryReactor* AttentionService::Sequenced(const char* rpc, grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out, Ids ids,
                                                      Handle handle) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time received = absl::Now();
  std::string rid = Identify(context);
  Request request;
  SessionCaller caller;
  absl::Status status = Admit(rpc, Role::kCompute, *context, bytes, &request, nullptr, &caller);
  absl::StatusOr<std::vector<std::string>> names = status.ok() ? ids(request) : status;
  if (!names.ok()) {
    CallDone(rid, rpc, "-", "", names.status(), received);
    reactor->Finish(ToGrpcStatus(names.status()));
    return reactor;
  }
  std::vector<std::string> held = *names;
  sessions_->sequencer().Submit(
      std::move(held), static_cast<int64_t>(bytes->Length()),
      std::make_unique<SequencedCall<Request, Response, Handle>>(this, std::move(rid), rpc, context, reactor, out,
                                                                 std::move(request), std::move(caller),
                                                                 *std::move(names), received, std::move(handle)));
  return reactor;
}

// An Extend in the compute queue and computing: holds its sessions and its blocks, commits on success. It computes
// in steps of at most --max_prefill_chunk rows (ExtendSteps), each step alone or batched with other Extends' steps
// of its batch key, and goes back in the queue between steps; its sessions stay held throughout, so that the calls
// on them keep their order. A step alone, with nothing queued and no other call arrived for --prefill_quiet_ms, is
// bounded in rows only: small steps protect other callers' latency, and cost the prefill more where nobody is waiting.
class ExtendWork final : public WorkItem {
 public:
  ExtendWork(AttentionService* service, std::string rid, grpc::CallbackServerContext* context,
             grpc::ServerUnaryReactor* reactor, grpc::ByteBuffer* out, std::unique_ptr<v1::ExtendRequest> request,
             ExtendPlan plan, ExtendReservation reservation, SessionHold hold, int64_t request_bytes,
             absl::Time received, absl::Time deadline)
      : WorkItem(request_bytes, received, deadline), service_(service), rid_(std::move(rid)), context_(context),
        reactor_(reactor), out_(out), request_(std::move(request)), plan_(std::move(plan)),
        reservation_(std::move(reservation)), hold_(std::move(hold)),
        steps_(plan_, reservation_, service->options_.max_prefill_chunk, &response_) {}

  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return context_->IsCancelled(); }
  bool Unfinished() const override { return !finished_; }
  int64_t NextRows() const override { return steps_.NextRows(); }
  double NextFlops() const override { return steps_.NextFlops(); }

  absl::Status Run(absl::Duration waited) override { return RunBatch({}, {waited}); }

  // The batch key covers what PagedArgs shares, so `others` are Extends whose steps compute together.
  absl::Status RunBatch(absl::Span<WorkItem* const> others, absl::Span<const absl::Duration> waited) override {
    std::vector<WorkItem*> items = {this};
    items.insert(items.end(), others.begin(), others.end());
    std::vector<PagedSequence> sequences;
    const int quiet_ms = service_->options_.prefill_quiet_ms;
    const bool alone = quiet_ms > 0 && others.empty() && service_->scheduler_->QueueDepth() == 0 &&
                       service_->scheduler_->SinceLastSubmit() > absl::Milliseconds(quiet_ms);
    for (size_t i = 0; i < items.size(); ++i) {
      ExtendWork& call = *static_cast<ExtendWork*>(items[i]);
      call.queued_ += waited[i];
      call.steps_.set_relaxed(alone);
      call.steps_.TakeNext(&sequences);
    }
    const BatchStop stop(items);
    const absl::Time started = absl::Now();
    const absl::Status status = ComputeExtendStep(plan_, sequences, &stop);
    const absl::Duration computed = absl::Now() - started;
    for (WorkItem* item : items) {
      ExtendWork& call = *static_cast<ExtendWork*>(item);
      call.computing_ += computed;
      if (!status.ok()) {
        const absl::Status own = call.Check();  // a call that was stopped says so, not the batch's first
        call.Finish(own.ok() ? status : own);
      } else if (call.steps_.done()) {
        call.Complete();
      }
    }
    return status;
  }
  void Reject(const absl::Status& status) override { Finish(status); }

 private:
  // Every step computed: commits unless the client gave up or the deadline passed meanwhile, and answers.
  void Complete() {
    absl::Status status = Check();
    if (status.ok()) {
      steps_.FillStats();
      reservation_.Commit();
    }
    service_->metrics_->RecordExtendItems(static_cast<int>(plan_.items.size()));
    v1::Timing* timing = response_.mutable_timing();
    timing->set_queue_us(absl::ToInt64Microseconds(queued_));
    timing->set_compute_us(absl::ToInt64Microseconds(computing_));
    timing->set_handler_us(absl::ToInt64Microseconds(absl::Now() - received()));
    Finish(status);
  }
  void Finish(absl::Status status) {
    finished_ = true;
    reservation_ = ExtendReservation();  // gives back what was not committed, before the sessions go
    service_->sessions_->Touch(hold_.ids());
    hold_.Release();
    if (status.ok()) status = Serialize(response_, out_);
    service_->CallDone(rid_, "Extend", plan_.shapes, plan_.backend->name(), status, received(),
                       absl::ToDoubleSeconds(computing_), status.ok() ? plan_.flops : 0);
    reactor_->Finish(ToGrpcStatus(status));
  }

  AttentionService* const service_;
  const std::string rid_;
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer* const out_;
  const std::unique_ptr<v1::ExtendRequest> request_;  // the plan borrows its tensors
  const ExtendPlan plan_;
  ExtendReservation reservation_;
  SessionHold hold_;
  v1::ExtendResponse response_;
  ExtendSteps steps_;  // borrows plan_, reservation_ and response_
  absl::Duration queued_, computing_;  // over the steps
  bool finished_ = false;
};

// An Extend waiting for its sessions; at its turn, validated against them, its blocks reserved, handed to the
// scheduler.
class ExtendCall final : public SessionSequencer::Call {
 public:
  ExtendCall(AttentionService* service, std::string rid, grpc::CallbackServerContext* context,
             grpc::ServerUnaryReactor* reactor, grpc::ByteBuffer* out, std::unique_ptr<v1::ExtendRequest> request,
             SessionCaller caller, std::vector<std::string> ids, int64_t request_bytes, absl::Time received)
      : service_(service), rid_(std::move(rid)), context_(context), reactor_(reactor), out_(out),
        request_(std::move(request)), caller_(std::move(caller)), ids_(std::move(ids)), request_bytes_(request_bytes),
        received_(received), deadline_(service->DeadlineOf(*context, received)) {}

  void Start() override {
    SessionHold hold(&service_->sessions_->sequencer(), ids_);
    absl::Status status = StillWanted(*context_, deadline_);
    absl::StatusOr<ExtendPlan> plan =
        status.ok() ? ValidateExtendHeld(*request_, *service_->sessions_, caller_, service_->validation_)
                    : absl::StatusOr<ExtendPlan>(status);
    absl::StatusOr<ExtendReservation> reservation =
        plan.ok() ? service_->sessions_->Reserve(plan->reserve) : absl::StatusOr<ExtendReservation>(plan.status());
    if (!reservation.ok()) {
      service_->sessions_->Touch(ids_);
      hold.Release();
      Abandon(reservation.status());
      return;
    }
    service_->scheduler_->Submit(std::make_unique<ExtendWork>(
        service_, std::move(rid_), context_, reactor_, out_, std::move(request_), *std::move(plan),
        *std::move(reservation), std::move(hold), request_bytes_, received_, deadline_));
  }
  void Abandon(const absl::Status& status) override {
    service_->CallDone(rid_, "Extend", SessionDetail(ids_), "", status, received_);
    reactor_->Finish(ToGrpcStatus(status));
  }

 private:
  AttentionService* const service_;
  std::string rid_;
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer* const out_;
  std::unique_ptr<v1::ExtendRequest> request_;
  const SessionCaller caller_;
  const std::vector<std::string> ids_;
  const int64_t request_bytes_;
  const absl::Time received_, deadline_;
};

grpc::ServerUnaryReactor* AttentionService::Extend(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time received = absl::Now();
  std::string rid = Identify(context);
  const int64_t request_bytes = static_cast<int64_t>(bytes->Length());
  auto request = std::make_unique<v1::ExtendRequest>();
  SessionCaller caller;
  absl::Status status = Admit("Extend", Role::kCompute, *context, bytes, request.get(), nullptr, &caller);
  absl::StatusOr<std::vector<std::string>> ids =
      status.ok() ? ValidateExtendRequest(*request) : absl::StatusOr<std::vector<std::string>>(status);
  if (!ids.ok()) {
    CallDone(rid, "Extend", "-", "", ids.status(), received);
    reactor->Finish(ToGrpcStatus(ids.status()));
    return reactor;
  }
  std::vector<std::string> held = *ids;
  sessions_->sequencer().Submit(std::move(held), request_bytes,
                                std::make_unique<ExtendCall>(this, std::move(rid), context, reactor, out,
                                                             std::move(request), std::move(caller), *std::move(ids),
                                                             request_bytes, received));
  return reactor;
}

namespace {

// The one session id a request names, checked; `field` names it in errors.
absl::StatusOr<std::vector<std::string>> OneId(const std::string& id, absl::string_view field) {
  RETURN_IF_ERROR(CheckName(id, field));
  return std::vector<std::string>{id};
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::CreateSession(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  // A client-chosen id is ordered with the other calls on it (a close before a create of the same id); the
  // server's own ids are fresh.
  return Sequenced<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      "CreateSession", context, bytes, out,
      [](const v1::CreateSessionRequest& request) -> absl::StatusOr<std::vector<std::string>> {
        if (request.session_id().empty()) return std::vector<std::string>();
        return OneId(request.session_id(), "session_id");
      },
      [this](const v1::CreateSessionRequest& request, const SessionCaller& caller,
             v1::CreateSessionResponse* response) -> absl::Status {
        ASSIGN_OR_RETURN(const SessionConfig config, ValidateCreateSession(request, validation_));
        ASSIGN_OR_RETURN(*response->mutable_session(), sessions_->Create(config, request.session_id(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::ForkSession(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  return Sequenced<v1::ForkSessionRequest, v1::ForkSessionResponse>(
      "ForkSession", context, bytes, out,
      [](const v1::ForkSessionRequest& request) -> absl::StatusOr<std::vector<std::string>> {
        ASSIGN_OR_RETURN(std::vector<std::string> ids, OneId(request.session_id(), "session_id"));
        if (request.new_session_id().empty()) return ids;
        RETURN_IF_ERROR(CheckName(request.new_session_id(), "new_session_id"));
        if (request.new_session_id() == request.session_id()) {
          return absl::InvalidArgumentError("new_session_id must differ from session_id");
        }
        ids.push_back(request.new_session_id());
        return ids;
      },
      [this](const v1::ForkSessionRequest& request, const SessionCaller& caller,
             v1::ForkSessionResponse* response) -> absl::Status {
        ASSIGN_OR_RETURN(*response->mutable_session(),
                         sessions_->Fork(request.session_id(), request.new_session_id(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::TruncateSession(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  return Sequenced<v1::TruncateSessionRequest, v1::TruncateSessionResponse>(
      "TruncateSession", context, bytes, out,
      [](const v1::TruncateSessionRequest& request) { return OneId(request.session_id(), "session_id"); },
      [this](const v1::TruncateSessionRequest& request, const SessionCaller& caller,
             v1::TruncateSessionResponse* response) -> absl::Status {
        ASSIGN_OR_RETURN(*response->mutable_session(),
                         sessions_->Truncate(request.session_id(), request.length(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::CloseSession(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  return Sequenced<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      "CloseSession", context, bytes, out,
      [](const v1::CloseSessionRequest& request) { return OneId(request.session_id(), "session_id"); },
      [this](const v1::CloseSessionRequest& request, const SessionCaller& caller, v1::CloseSessionResponse*) {
        return sessions_->Close(request.session_id(), caller);
      });
}

grpc::ServerUnaryReactor* AttentionService::ListSessions(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* bytes, grpc::ByteBuffer* out) {
  return Sequenced<v1::ListSessionsRequest, v1::ListSessionsResponse>(
      "ListSessions", context, bytes, out,
      [](const v1::ListSessionsRequest&) { return absl::StatusOr<std::vector<std::string>>(std::vector<std::string>()); },
      [this](const v1::ListSessionsRequest&, const SessionCaller& caller, v1::ListSessionsResponse* response) {
        for (v1::SessionInfo& info : sessions_->List(caller)) *response->add_sessions() = std::move(info);
        return absl::OkStatus();
      });
}

}  // namespace mha
