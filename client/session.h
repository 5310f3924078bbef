// A KV-cache session on the server as a handle (mha.v1 CreateSession and the calls after it): create it, then per
// layer and step Extend it with the new tokens' inputs, fork, truncate, close. fp32 arrays in and out. Every call
// sends the session's id as "mha-session-id" metadata (AttentionClient does), for proxies that route by it.
//
// Thread-compatible: one thread at a time per handle (the server orders a session's calls anyway). The client must
// outlive its sessions; destroying a handle does not close the session (it expires when idle).
#ifndef MHA_CLIENT_SESSION_H_
#define MHA_CLIENT_SESSION_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace mha {

struct ExtendOptions {
  v1::DataType wire_dtype = v1::FP32;  // how the inputs travel; outputs come back fp32
  bool return_attention_weights = false;
  std::optional<int64_t> expected_length;  // the cache's length before the call, when the caller wants it checked
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

  const std::string& id() const { return info_.session_id(); }
  // As the server last described it (CreateSession, ForkSession, TruncateSession), lengths kept up to date by Extend.
  const v1::SessionInfo& info() const { return info_; }

  // A layer session's step: x [n, d_model] appended to cache `layer_index`.
  absl::StatusOr<ExtendOutputs> Extend(int layer_index, const Array& x, const ExtendOptions& options = {});
  // A head session's step: q [n, H, d_k], k and v [n, Hkv, d_k].
  absl::StatusOr<ExtendOutputs> Extend(int layer_index, const Array& q, const Array& k, const Array& v,
                                       const ExtendOptions& options = {});
  // A copy sharing every cached token (copy-on-write on the server); new_id empty: the server picks one.
  absl::StatusOr<Session> Fork(const std::string& new_id = "") const;
  // Every cache cut to at most `length` tokens.
  absl::Status Truncate(int64_t length);
  absl::Status Close();

 private:
  Session(AttentionClient* client, v1::SessionInfo info) : client_(client), info_(std::move(info)) {}
  absl::StatusOr<ExtendOutputs> Run(int layer_index, v1::ExtendItem item, const ExtendOptions& options);

  AttentionClient* client_;
  v1::SessionInfo info_;
};

}  // namespace mha

#endif  // MHA_CLIENT_SESSION_H_
