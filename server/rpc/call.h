// One RPC at the edge, from its arrival to its end, the same for every front door (the native service, its session
// RPCs, KServe's): who calls and when (request id, trace id, the token's principal, arrival, deadline, request
// bytes), admission (the token's role, then the parse), and the one way a call ends (a log line within
// --log_max_calls_per_s, the metrics, the status converted once by ToGrpcStatus, the reactor finished).
#ifndef MHA_SERVER_RPC_CALL_H_
#define MHA_SERVER_RPC_CALL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/base/log_budget.h"
#include "server/calls/request_reader.h"
#include "server/metrics/metrics.h"
#include "server/scheduling/inflight_hold.h"
#include "server/sessions/session_store.h"
#include "server/transport/auth.h"

namespace mha {

// What every call at the edge shares: the tokens, the metrics, the log budget, the server's instance id and the
// default deadline. Thread-safe; borrows `auth` (null: no token needed) and `metrics`, which must outlive it.
class CallEdge {
 public:
  CallEdge(const TokenAuth* auth, ServerMetrics* metrics, int log_max_calls_per_s, absl::Duration default_deadline);
  CallEdge(const CallEdge&) = delete;
  CallEdge& operator=(const CallEdge&) = delete;

  // "<host name>/<random per process>": GetServerInfo's instance_id and every response's mha-instance-id metadata.
  const std::string& instance_id() const { return instance_id_; }
  // Calls begun and not yet done with: from a Call's construction until gRPC has sent its status (or the call
  // ended unsent), so that a shutdown knows when nothing is left to wait for but idle connections.
  int64_t calls_in_progress() const { return calls_in_progress_->load(std::memory_order_acquire); }
  // The request id of a call on `context`: the client's x-request-id when it is 1..128 of [A-Za-z0-9._:/-], else a
  // new one. Thread-safe.
  std::string RequestId(const grpc::CallbackServerContext& context);
  // A shared count of calls in progress, for a reactor that counts itself (a stream while a step is in flight).
  const std::shared_ptr<std::atomic<int64_t>>& in_progress_counter() const { return calls_in_progress_; }

 private:
  friend class Call;

  const TokenAuth* const auth_;
  ServerMetrics* const metrics_;
  LogBudget log_budget_;
  const absl::Duration default_deadline_;
  const std::string id_prefix_;  // random per process, so that ids of restarted replicas do not collide
  const std::string instance_id_;
  std::atomic<uint64_t> next_request_id_{1};
  // Shared with every call's reactor, which may be done after the edge is gone.
  const std::shared_ptr<std::atomic<int64_t>> calls_in_progress_ = std::make_shared<std::atomic<int64_t>>(0);
};

// Where a call that is not unary ends: one step of a stream (server/rpc/extend_stream.h) takes its status, and on OK
// the response the call serialized into its response buffer. Called once per call, from any thread.
class CallEnd {
 public:
  virtual ~CallEnd() = default;
  virtual void End(const grpc::Status& status) = 0;
};

// What a finished call did, for its log line and its metrics.
struct CallOutcome {
  absl::string_view detail = "-";  // what the call was about: shapes, names or session ids, log-safe
  absl::string_view backend;       // the backend that computed; empty when none did
  double compute_seconds = 0;
  double flops = 0;  // of a call that computed and ended OK
};

// One call. Move-only, and it ends exactly once (Finish). One owner at a time (the gRPC handler, then the
// sequencer, then a compute thread), so not thread-safe itself; IsCancelled and StillWanted may be asked anywhere.
class Call {
 public:
  // The call's start on the handler's thread: its request id (the client's x-request-id when it is 1..128 of
  // [A-Za-z0-9._:/-], else a new one; returned in the x-request-id and mha-instance-id initial metadata), its
  // trace id (a W3C traceparent's), arrival, deadline (the client's, or --default_deadline_s) and request size.
  // `rpc` is static; `context`, `request` and `response` are gRPC's and live until the reactor finishes.
  Call(CallEdge* edge, const char* rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
       grpc::ByteBuffer* response);
  // One step of a stream on `context`: request id `request_id` (the stream's, with the step's number), no initial
  // metadata of its own (the stream sent it), a deadline at the stream's or --default_deadline_s from now,
  // whichever comes first, and its end at `end` (borrowed; it must outlive the call) instead of a unary reactor.
  Call(CallEdge* edge, const char* rpc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
       grpc::ByteBuffer* response, CallEnd* end, absl::string_view request_id);
  Call(Call&& other) noexcept;
  Call& operator=(Call&&) = delete;
  Call(const Call&) = delete;
  // A call dropped without Finish (a bug) still answers: INTERNAL, so that its client is not left waiting.
  ~Call();

  // The token check for `role` (UNAUTHENTICATED or PERMISSION_DENIED; the caller's principal is kept), then the
  // parse of the request's bytes into `request` (INVALID_ARGUMENT naming the message type; CANCELLED or
  // DEADLINE_EXCEEDED for a call that ended before its message arrived). With `scans`, `request` is a compute
  // request, read in one pass that scans its activations for inf and NaN when it is large (ReadComputeRequest).
  // The wire bytes are released once parsed.
  absl::Status Admit(Role role, google::protobuf::Message* request, std::vector<FiniteScan>* scans = nullptr);

  const char* rpc() const { return rpc_; }
  // Who calls (Admit sets it): the token's identity, and whether its role is admin.
  const SessionCaller& caller() const { return caller_; }
  absl::Time received() const { return received_; }
  absl::Time deadline() const { return deadline_; }
  // What the call holds while it waits: its request's bytes on the wire, unless a front door says otherwise.
  int64_t request_bytes() const { return request_bytes_; }
  void set_request_bytes(int64_t bytes) { request_bytes_ = bytes; }
  grpc::ByteBuffer* response() const { return response_; }

  // True once the client cancelled (or gRPC cancelled the call). Thread-safe.
  bool IsCancelled() const { return context_->IsCancelled(); }
  // OK while the client still waits and the deadline has not passed; else CANCELLED or DEADLINE_EXCEEDED, saying
  // that it happened while the call was `doing` (e.g. "waited for its session"). Thread-safe.
  absl::Status StillWanted(absl::string_view doing) const;

  // Ends the call with `status`: its log line, its metrics, the status converted once, the reactor finished.
  // Returns the reactor, for a handler that ends the call at once to return. Once: a second call is logged as an
  // error and changes nothing.
  grpc::ServerUnaryReactor* Finish(const absl::Status& status, const CallOutcome& outcome = CallOutcome());
  // The unary call's reactor; null for a stream's step.
  grpc::ServerUnaryReactor* reactor() const { return reactor_; }

 private:
  // Sets ids_ from the request id and the context's traceparent.
  void SetIds(absl::string_view request_id);

  CallEdge* edge_;
  const char* rpc_;
  grpc::CallbackServerContext* context_;
  grpc::ServerUnaryReactor* reactor_;  // a unary call's; null for a step
  CallEnd* end_ = nullptr;             // a step's; null for a unary call
  const grpc::ByteBuffer* request_;
  grpc::ByteBuffer* response_;
  std::string ids_;  // "rid=<id>[ trace=<trace id>]", for the log line
  SessionCaller caller_;
  absl::Time received_, deadline_;
  int64_t request_bytes_ = 0;
  bool finished_ = false;
};

// Serializes an OK call's response into `out`; INTERNAL should serialization fail.
absl::Status Serialize(const google::protobuf::Message& response, grpc::ByteBuffer* out);

// Serialize, with the serialized bytes keeping `hold` (the response's share of the in-flight memory) until gRPC lets
// go of them, once sent or once the call ends unsent: a client that never reads cannot make the server hold more
// than --max_inflight_mb.
absl::Status SerializeHolding(const google::protobuf::Message& response, InflightHold hold, grpc::ByteBuffer* out);

// A call that answers at once, on the handler's thread: admits `call` for `role`, then answers with what
// `handle(request, &response, &detail)` returns (Status; `detail` is the log line's, "-" unless set).
template <typename Request, typename Response, typename Handle>
grpc::ServerUnaryReactor* AnswerNow(Call call, Role role, Handle handle) {
  Request request;
  Response response;
  std::string detail = "-";
  absl::Status status = call.Admit(role, &request);
  if (status.ok()) status = handle(request, &response, &detail);
  if (status.ok()) status = Serialize(response, call.response());
  CallOutcome outcome;
  outcome.detail = detail;
  return call.Finish(status, outcome);
}

}  // namespace mha

#endif  // MHA_SERVER_RPC_CALL_H_
