// Recovery of a lost KV-cache session (its server restarted, the session was evicted or closed, its replica died).
// A SessionRecord keeps what a session was fed, enough to rebuild its caches exactly: its CreateSessionRequest
// (with its id) and, per cache, the tensors that joined it, in order, as they travelled. On a call that fails as a
// lost session does (NOT_FOUND, or UNAVAILABLE), ExtendRecovering re-creates the session under the same id (so a
// proxy that hashes on mha-session-id sends it where the hash now points), replays the record in chunks, and sends
// the call again: its outputs are what they would have been, since the rebuilt caches hold the same values (for a
// layer session whose calls also carried other sessions' rows, within rounding: the server projected their rows
// together, and the CPU backend's rounding depends on the row count).
//
// What the record keeps per appended item: x for a layer session (its keys and values are the layer's projections,
// recomputed on replay by the backend the original call asked for), k and v for a head session (q is not needed:
// the replay sends zeros in its place and drops the outputs). Items with append = false add nothing. A tensor in
// shared memory cannot be kept: the record is then dropped, as it is past max_bytes, and the session no longer
// recovers (recoverable() is false; the failed call's error is returned as it came).
//
// Thread-compatible: a record belongs to one session and is used by one thread at a time, as the session is.
#ifndef MHA_CLIENT_SESSION_RECOVERY_H_
#define MHA_CLIENT_SESSION_RECOVERY_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/attention_client.h"

namespace mha {

struct RecoveryOptions {
  // Rebuilds tried for one failed call before its last error is returned.
  int max_attempts = 5;
  // The wait before a retry after UNAVAILABLE, doubled each time up to max_backoff; then the channel is given up to
  // reconnect_timeout to connect again (a restarting server, a proxy's next replica) before the rebuild is sent.
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  absl::Duration reconnect_timeout = absl::Seconds(10);
  // Tokens per replayed Extend at most (but for one more rather than a one-row tail): a head session's consecutive
  // calls of one dtype and backend are merged, then cut to this size; a layer session's are replayed call by call,
  // each with the rows it had, so that the server projects them as it did.
  int64_t replay_chunk_tokens = 1024;
  // Bytes of tensors a record keeps at most; past them the session stops recording and no longer recovers.
  int64_t max_record_bytes = std::numeric_limits<int64_t>::max();
};

class SessionRecord {
 public:
  // `create` must name the session (a non-empty session_id): the rebuild asks for that id again.
  explicit SessionRecord(v1::CreateSessionRequest create,
                         int64_t max_bytes = std::numeric_limits<int64_t>::max());

  const std::string& id() const { return create_.session_id(); }
  const v1::CreateSessionRequest& create() const { return create_; }
  // False once the record was dropped (past max_bytes, or a tensor it could not keep).
  bool recoverable() const { return recoverable_; }
  // Tokens recorded for cache `layer_index` (0 for a cache never extended).
  int64_t length(int layer_index) const;
  // Bytes of tensors kept.
  int64_t bytes() const { return bytes_; }

  // `item` joined cache `layer_index` by a call that asked for `backend` and succeeded. An item with append = false
  // changes nothing.
  void Append(int layer_index, const v1::ExtendItem& item, v1::Backend backend);
  // Every cache cut to at most `length` tokens, as TruncateSession does.
  void Truncate(int64_t length);
  // The record of a fork of this session named new_id: the same tokens.
  SessionRecord Fork(const std::string& new_id) const;

  // The Extend calls that rebuild the caches of a freshly created session: per cache, in order, items of about
  // chunk_tokens tokens at most (see RecoveryOptions) with append set and expected_length at the tokens' first
  // position, each request with the backend the recorded calls asked for. Empty for a session that holds no tokens.
  std::vector<v1::ExtendRequest> ReplayRequests(int64_t chunk_tokens) const;

 private:
  // Consecutive tokens of one cache that travelled alike: tensors[0] is x (layer session: one call's) or tensors[0],
  // [1] are k and v (head session: calls' rows appended as they succeed), each [tokens, ...].
  struct Segment {
    v1::Backend backend = v1::BACKEND_AUTO;
    std::vector<v1::Tensor> tensors;
    int64_t tokens = 0;
  };
  void Drop();

  v1::CreateSessionRequest create_;
  int64_t max_bytes_;
  bool recoverable_ = true;
  int64_t bytes_ = 0;
  std::vector<std::vector<Segment>> caches_;  // [layer_index][segment]
};

// What a lost session answers: NOT_FOUND (the server does not hold it) or UNAVAILABLE (no server answered).
bool IsSessionLost(const absl::Status& status);

// Rebuilds each session of `records` after a call on them failed with `failure`: CreateSession under its id, then
// its replay. A session that is still there (ALREADY_EXISTS) is left as it is after NOT_FOUND (a failed call
// changes no session) and closed and rebuilt after UNAVAILABLE (whether the call reached it is unknown). Adds the
// sessions rebuilt to *rebuilt. Returns the first error (the caller decides whether to try again).
absl::Status RebuildSessions(AttentionClient& client, absl::Span<const SessionRecord* const> records,
                             const absl::Status& failure, int64_t chunk_tokens, int64_t* rebuilt);

// An Extend on recorded sessions (records[i] is the record of request.items(i)'s session). When it succeeds, each
// appended item joins its record. When it fails as a lost session would and every record is recoverable, the
// sessions are rebuilt (RebuildSessions) and the call sent again, up to options.max_attempts times, waiting as
// RecoveryOptions says after UNAVAILABLE; *recoveries grows by the sessions rebuilt. Any other error, and the last
// one when the attempts run out, is returned unchanged. INVALID_ARGUMENT if records and items differ in number.
// `unary`: the Extend goes as a unary call even where the client streams Extends.
absl::StatusOr<v1::ExtendResponse> ExtendRecovering(AttentionClient& client, const v1::ExtendRequest& request,
                                                    absl::Span<SessionRecord* const> records,
                                                    const RecoveryOptions& options, int64_t* recoveries,
                                                    bool unary = false);

// Any other session call (fork, truncate) with the same recovery: `call` runs, and after a lost-session failure the
// sessions of `records` are rebuilt and `call` runs again, as ExtendRecovering does.
absl::Status CallRecovering(AttentionClient& client, const std::function<absl::Status()>& call,
                            absl::Span<const SessionRecord* const> records, const RecoveryOptions& options,
                            int64_t* recoveries);

}  // namespace mha

#endif  // MHA_CLIENT_SESSION_RECOVERY_H_
