// A KV-cache session on the server as a handle (mha.v1 CreateSession and the calls after it): create it, then per
// layer and step Extend it with the new tokens' inputs, fork, truncate, close. fp32 arrays in and out. Every call
// sends the session's id as "mha-session-id" metadata (AttentionClient does), for proxies that route by it. Extend
// goes over the client's ExtendStreams where the server has them (ClientOptions::max_extend_streams).
//
// CreateRecovering makes a handle that records what the session is fed and rebuilds it when it is lost (NOT_FOUND
// or UNAVAILABLE: a restarted server, an eviction, a dead replica behind a proxy), then retries the call, so that
// its outputs are what they would have been (client/session_recovery.h).
//
// Thread-compatible: one thread at a time per handle (the server orders a session's calls anyway). The client must
// outlive its sessions; destroying a handle does not close the session (it expires when idle).
#ifndef MHA_CLIENT_SESSION_H_
#define MHA_CLIENT_SESSION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "client/attention_client.h"
#include "client/session_recovery.h"

namespace mha {

struct ExtendOptions {
  v1::DataType wire_dtype = v1::FP32;  // how the inputs travel; outputs come back fp32
  bool return_attention_weights = false;
  // The cache's length before the call, checked by the server (FAILED_PRECONDITION when it differs). Unset: the
  // length this handle last saw, so that a step retried after an error that hid its commit (a DEADLINE_EXCEEDED
  // can) is refused instead of appended twice; check_length = false sends none.
  std::optional<int64_t> expected_length;
  bool check_length = true;
  v1::Backend backend = v1::BACKEND_AUTO;
};

struct ExtendOutputs {
  Array output;             // layer session [n, d_model]; head session [n, H, d_k]
  Array attention_weights;  // [H, n, length]; empty unless asked for
  int64_t length = 0;       // the cache's tokens after the call
  std::string backend;
};

class Session {
 public:
  // CreateSession's errors unchanged.
  static absl::StatusOr<Session> Create(AttentionClient* client, const v1::CreateSessionRequest& request);
  // The same, recording: Extend, Fork and Truncate recover the session when it is lost, as `recovery` says. The
  // record keeps the id the server answered with (choose one in `request` when a proxy routes by it).
  // INVALID_ARGUMENT for a request with prefix_keys: attached tokens are never sent, so no record could rebuild them.
  static absl::StatusOr<Session> CreateRecovering(AttentionClient* client, const v1::CreateSessionRequest& request,
                                                  const RecoveryOptions& recovery = {});

  const std::string& id() const { return info_.session_id(); }
  // As the server last described it (CreateSession, ForkSession, TruncateSession), lengths kept up to date by Extend.
  const v1::SessionInfo& info() const { return info_; }
  // Times the session was rebuilt (0 for a handle that does not record); a fork starts at 0.
  int64_t recoveries() const { return recoveries_; }
  // Whether the handle records and can still recover (see SessionRecord::recoverable).
  bool recovering() const { return record_.has_value() && record_->recoverable(); }

  // A layer session's step: x [n, d_model] appended to cache `layer_index`.
  absl::StatusOr<ExtendOutputs> Extend(int layer_index, const Array& x, const ExtendOptions& options = {});
  // A head session's step: q [n, H, d_k], k and v [n, Hkv, d_k].
  absl::StatusOr<ExtendOutputs> Extend(int layer_index, const Array& q, const Array& k, const Array& v,
                                       const ExtendOptions& options = {});
  // A copy sharing every cached token (copy-on-write on the server); new_id empty: the server picks one. A recording
  // handle's fork records too, from the same tokens.
  absl::StatusOr<Session> Fork(const std::string& new_id = "");
  // Every cache cut to at most `length` tokens.
  absl::Status Truncate(int64_t length);
  absl::Status Close();

 private:
  Session(AttentionClient* client, v1::SessionInfo info) : client_(client), info_(std::move(info)) {}
  absl::StatusOr<ExtendOutputs> Run(int layer_index, v1::ExtendItem item, const ExtendOptions& options);
  // `call`, recovered as the record says when there is one.
  absl::Status Call(const std::function<absl::Status()>& call);

  AttentionClient* client_;
  v1::SessionInfo info_;
  std::optional<SessionRecord> record_;  // recording handles only
  RecoveryOptions recovery_;
  int64_t recoveries_ = 0;
};

}  // namespace mha

#endif  // MHA_CLIENT_SESSION_H_
