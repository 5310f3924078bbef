#include "server/rpc/session_service.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"
#include "server/scheduling/work_item.h"
#include "server/sessions/execute_session.h"
#include "server/sessions/validate_session.h"

namespace mha {
namespace {

constexpr char kWaited[] = "waited for its session";

std::string SessionDetail(const std::vector<std::string>& ids) {
  if (ids.empty()) return "-";
  return ids.size() == 1 ? absl::StrCat("session=", ids[0])
                         : absl::StrCat("session=", ids[0], " and ", ids.size() - 1, " more");
}

// The sequencer's keys of `ids` in `owner`'s scope (SessionKey): calls wait only behind calls on their own
// principal's sessions.
std::vector<std::string> Keys(absl::string_view owner, const std::vector<std::string>& ids) {
  std::vector<std::string> keys;
  keys.reserve(ids.size());
  for (const std::string& id : ids) keys.push_back(SessionKey(owner, id));
  return keys;
}

// Ends a call that never held its sessions (refused at arrival, abandoned while waiting).
void FinishUnheld(Call& call, const std::vector<std::string>& ids, const absl::Status& status) {
  const std::string detail = SessionDetail(ids);
  CallOutcome outcome;
  outcome.detail = detail;
  call.Finish(status, outcome);
}

// A session RPC that answers at its turn with what Handle computes: handle(request, caller, &response) -> Status.
template <typename Request, typename Response, typename Handle>
class SequencedCall final : public SessionSequencer::Call {
 public:
  // `keys`: the sequencer's keys of `ids`.
  SequencedCall(::mha::Call call, Request request, std::vector<std::string> ids, std::vector<std::string> keys,
                SessionStore* sessions, Handle handle)
      : call_(std::move(call)), request_(std::move(request)), ids_(std::move(ids)), keys_(std::move(keys)),
        sessions_(sessions), handle_(std::move(handle)) {}

  void Start() override {
    SessionHold hold(&sessions_->sequencer(), keys_);
    Response response;
    absl::Status status = call_.StillWanted(kWaited);
    if (status.ok()) status = handle_(request_, call_.caller(), &response);
    if (status.ok()) status = Serialize(response, call_.response());
    sessions_->Touch(keys_);
    hold.Release();
    FinishUnheld(call_, ids_, status);
  }
  void Abandon(const absl::Status& status) override { FinishUnheld(call_, ids_, status); }
  absl::Status StillWanted() const override { return call_.StillWanted(kWaited); }

 private:
  ::mha::Call call_;
  const Request request_;
  const std::vector<std::string> ids_;
  const std::vector<std::string> keys_;
  SessionStore* const sessions_;
  Handle handle_;
};

// Admits `call`, asks `ids` for the session ids the request names (their errors answer at once), then waits at the
// sequencer, behind the calls on those ids of the caller's own scope (of `owner` when not empty: an admin's
// Close); at its turn the call answers with what `handle` returns.
template <typename Request, typename Response, typename Ids, typename Handle>
grpc::ServerUnaryReactor* Sequenced(Call call, SessionStore* sessions, Ids ids, Handle handle,
                                    const std::string& (*owner)(const Request&) = nullptr) {
  grpc::ServerUnaryReactor* reactor = call.reactor();
  Request request;
  const absl::Status status = call.Admit(Role::kCompute, &request);
  absl::StatusOr<std::vector<std::string>> names = status.ok() ? ids(request) : status;
  if (!names.ok()) return call.Finish(names.status());
  const int64_t bytes = call.request_bytes();
  const std::string& scope = owner != nullptr && !owner(request).empty() ? owner(request) : call.caller().owner;
  if (scope != call.caller().owner && !call.caller().admin) {  // before it waits behind another's calls
    return call.Finish(absl::PermissionDeniedError("owner: only an admin token may name another token's session"));
  }
  std::vector<std::string> keys = Keys(scope, *names);
  std::vector<std::string> held = keys;
  const std::string caller = call.caller().owner;
  sessions->sequencer().Submit(std::move(held), bytes,
                               std::make_unique<SequencedCall<Request, Response, Handle>>(
                                   std::move(call), std::move(request), *std::move(names), std::move(keys),
                                   sessions, std::move(handle)),
                               caller);
  return reactor;
}

// The one session id a request names, checked; `field` names it in errors.
absl::StatusOr<std::vector<std::string>> OneId(const std::string& id, absl::string_view field) {
  RETURN_IF_ERROR(CheckName(id, field));
  return std::vector<std::string>{id};
}

// An Extend in the compute queue and computing: holds its sessions and its blocks, commits on success. It computes
// in steps of at most --max_prefill_chunk rows (ExtendSteps), each step alone or batched with other Extends' steps
// of its batch key, and goes back in the queue between steps; its sessions stay held throughout, so that the calls
// on them keep their order. A step alone, with nothing queued and no other call arrived for --prefill_quiet_ms, is
// bounded in rows only: small steps protect other callers' latency, and cost the prefill more where nobody waits.
class ExtendWork final : public WorkItem {
 public:
  ExtendWork(Call call, std::unique_ptr<v1::ExtendRequest> request, ExtendPlan plan, ExtendReservation reservation,
             SessionHold hold, const ServiceParts& parts)
      : WorkItem(call.request_bytes(), call.received(), call.deadline()), call_(std::move(call)),
        request_(std::move(request)), plan_(std::move(plan)), reservation_(std::move(reservation)),
        hold_(std::move(hold)), parts_(parts),
        steps_(plan_, reservation_, parts.options->max_prefill_chunk, &response_) {}

  const AttentionPlan& plan() const override { return plan_; }
  bool IsCancelled() const override { return call_.IsCancelled(); }
  const std::string& owner() const override { return call_.caller().owner; }
  bool Unfinished() const override { return !finished_; }
  int64_t NextRows() const override { return steps_.NextRows(); }
  double NextFlops() const override { return steps_.NextFlops(); }

  absl::Status Run(absl::Duration waited) override { return RunBatch({}, {waited}); }

  // The batch key covers what PagedArgs shares, so `others` are Extends whose steps compute together.
  absl::Status RunBatch(absl::Span<WorkItem* const> others, absl::Span<const absl::Duration> waited) override {
    std::vector<WorkItem*> items = {this};
    items.insert(items.end(), others.begin(), others.end());
    std::vector<PagedSequence> sequences;
    const int quiet_ms = parts_.options->prefill_quiet_ms;
    const bool alone = quiet_ms > 0 && others.empty() && parts_.scheduler->QueueDepth() == 0 &&
                       parts_.scheduler->SinceLastSubmit() > absl::Milliseconds(quiet_ms);
    for (size_t i = 0; i < items.size(); ++i) {
      ExtendWork& work = *static_cast<ExtendWork*>(items[i]);
      work.queued_ += waited[i];
      work.steps_.set_relaxed(alone);
      work.steps_.TakeNext(&sequences);
    }
    const BatchStop stop(items);
    const absl::Time started = absl::Now();
    const absl::Status status = ComputeExtendStep(plan_, sequences, &stop);
    const absl::Duration computed = absl::Now() - started;
    for (WorkItem* item : items) {
      ExtendWork& work = *static_cast<ExtendWork*>(item);
      work.computing_ += computed;
      if (!status.ok()) {
        const absl::Status own = work.Check();  // a call that was stopped says so, not the batch's first
        work.Finish(own.ok() ? status : own);
      } else if (work.steps_.done()) {
        work.Complete();
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
    parts_.metrics->RecordExtendItems(static_cast<int>(plan_.items.size()));
    v1::Timing* timing = response_.mutable_timing();
    timing->set_queue_us(absl::ToInt64Microseconds(queued_));
    timing->set_compute_us(absl::ToInt64Microseconds(computing_));
    timing->set_handler_us(absl::ToInt64Microseconds(absl::Now() - received()));
    Finish(status);
  }
  void Finish(absl::Status status) {
    finished_ = true;
    reservation_ = ExtendReservation();  // gives back what was not committed, before the sessions go
    parts_.sessions->Touch(hold_.ids());
    hold_.Release();
    if (status.ok()) status = SerializeHolding(response_, TakeResponseHold(), call_.response());
    CallOutcome outcome;
    outcome.detail = plan_.shapes;
    outcome.backend = plan_.backend->name();
    outcome.compute_seconds = absl::ToDoubleSeconds(computing_);
    outcome.flops = status.ok() ? plan_.flops : 0;
    call_.Finish(status, outcome);
  }

  Call call_;
  const std::unique_ptr<v1::ExtendRequest> request_;  // the plan borrows its tensors
  const ExtendPlan plan_;
  ExtendReservation reservation_;
  SessionHold hold_;
  const ServiceParts& parts_;
  v1::ExtendResponse response_;
  ExtendSteps steps_;  // borrows plan_, reservation_ and response_
  absl::Duration queued_, computing_;  // over the steps
  bool finished_ = false;
};

// An Extend waiting for its sessions; at its turn, validated against them, its blocks reserved, handed to the
// scheduler.
class ExtendCall final : public SessionSequencer::Call {
 public:
  // `keys`: the sequencer's keys of `ids`.
  ExtendCall(::mha::Call call, std::unique_ptr<v1::ExtendRequest> request, std::vector<std::string> ids,
             std::vector<std::string> keys, const ServiceParts& parts)
      : call_(std::move(call)), request_(std::move(request)), ids_(std::move(ids)), keys_(std::move(keys)),
        parts_(parts) {}

  void Start() override {
    SessionStore& sessions = *parts_.sessions;
    SessionHold hold(&sessions.sequencer(), keys_);
    const absl::Status wanted = call_.StillWanted(kWaited);
    absl::StatusOr<ExtendPlan> plan =
        wanted.ok() ? ValidateExtendHeld(*request_, sessions, call_.caller(), *parts_.validation)
                    : absl::StatusOr<ExtendPlan>(wanted);
    absl::StatusOr<ExtendReservation> reservation =
        plan.ok() ? sessions.Reserve(plan->reserve) : absl::StatusOr<ExtendReservation>(plan.status());
    if (!reservation.ok()) {
      sessions.Touch(keys_);
      hold.Release();
      Abandon(reservation.status());
      return;
    }
    parts_.scheduler->Submit(std::make_unique<ExtendWork>(std::move(call_), std::move(request_), *std::move(plan),
                                                          *std::move(reservation), std::move(hold), parts_));
  }
  void Abandon(const absl::Status& status) override { FinishUnheld(call_, ids_, status); }
  absl::Status StillWanted() const override { return call_.StillWanted(kWaited); }

 private:
  ::mha::Call call_;
  std::unique_ptr<v1::ExtendRequest> request_;
  const std::vector<std::string> ids_;
  const std::vector<std::string> keys_;
  const ServiceParts& parts_;
};

}  // namespace

grpc::ServerUnaryReactor* SessionService::Extend(Call call) {
  grpc::ServerUnaryReactor* reactor = call.reactor();
  ExtendStep(std::move(call));
  return reactor;
}

void SessionService::ExtendStep(Call call) {
  auto request = std::make_unique<v1::ExtendRequest>();
  const absl::Status status = call.Admit(Role::kCompute, request.get());
  absl::StatusOr<std::vector<std::string>> ids =
      status.ok() ? ValidateExtendRequest(*request, parts_.sessions->options().max_sessions)
                  : absl::StatusOr<std::vector<std::string>>(status);
  if (!ids.ok()) {
    call.Finish(ids.status());
    return;
  }
  const int64_t bytes = call.request_bytes();
  std::vector<std::string> keys = Keys(call.caller().owner, *ids);
  std::vector<std::string> held = keys;
  const std::string caller = call.caller().owner;
  parts_.sessions->sequencer().Submit(
      std::move(held), bytes,
      std::make_unique<ExtendCall>(std::move(call), std::move(request), *std::move(ids), std::move(keys), parts_),
      caller);
}

grpc::ServerUnaryReactor* SessionService::CreateSession(Call call) {
  // A client-chosen id is ordered with the other calls on it (a close before a create of the same id); the
  // server's own ids are fresh.
  return Sequenced<v1::CreateSessionRequest, v1::CreateSessionResponse>(
      std::move(call), parts_.sessions,
      [](const v1::CreateSessionRequest& request) -> absl::StatusOr<std::vector<std::string>> {
        if (request.session_id().empty()) return std::vector<std::string>();
        return OneId(request.session_id(), "session_id");
      },
      [this](const v1::CreateSessionRequest& request, const SessionCaller& caller,
             v1::CreateSessionResponse* response) -> absl::Status {
        ASSIGN_OR_RETURN(const SessionConfig config, ValidateCreateSession(request, *parts_.validation));
        ASSIGN_OR_RETURN(*response->mutable_session(), parts_.sessions->Create(config, request.session_id(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* SessionService::ForkSession(Call call) {
  return Sequenced<v1::ForkSessionRequest, v1::ForkSessionResponse>(
      std::move(call), parts_.sessions,
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
                         parts_.sessions->Fork(request.session_id(), request.new_session_id(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* SessionService::TruncateSession(Call call) {
  return Sequenced<v1::TruncateSessionRequest, v1::TruncateSessionResponse>(
      std::move(call), parts_.sessions,
      [](const v1::TruncateSessionRequest& request) { return OneId(request.session_id(), "session_id"); },
      [this](const v1::TruncateSessionRequest& request, const SessionCaller& caller,
             v1::TruncateSessionResponse* response) -> absl::Status {
        ASSIGN_OR_RETURN(*response->mutable_session(),
                         parts_.sessions->Truncate(request.session_id(), request.length(), caller));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* SessionService::CloseSession(Call call) {
  return Sequenced<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      std::move(call), parts_.sessions,
      [](const v1::CloseSessionRequest& request) { return OneId(request.session_id(), "session_id"); },
      [this](const v1::CloseSessionRequest& request, const SessionCaller& caller, v1::CloseSessionResponse*) {
        return parts_.sessions->Close(request.session_id(), caller, request.owner());
      },
      +[](const v1::CloseSessionRequest& request) -> const std::string& { return request.owner(); });
}

grpc::ServerUnaryReactor* SessionService::ListSessions(Call call) {
  return Sequenced<v1::ListSessionsRequest, v1::ListSessionsResponse>(
      std::move(call), parts_.sessions,
      [](const v1::ListSessionsRequest&) -> absl::StatusOr<std::vector<std::string>> {
        return std::vector<std::string>();
      },
      [this](const v1::ListSessionsRequest&, const SessionCaller& caller, v1::ListSessionsResponse* response) {
        for (v1::SessionInfo& info : parts_.sessions->List(caller)) *response->add_sessions() = std::move(info);
        return absl::OkStatus();
      });
}

}  // namespace mha
