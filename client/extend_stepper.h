// Extend steps over ExtendStream (a decoder's per-layer round trips without a new HTTP/2 stream each), with the
// unary Extend as the fallback: a server without ExtendStream (UNIMPLEMENTED before it sent any metadata) is asked
// by unary calls from then on.
//
// ExtendStepper is one stream. Each step has the client's timeout at least: the stream is opened with a deadline of
// twice the timeout and reopened between steps once less than one timeout is left. A failed step ends the stream
// (the server's contract); the next step opens a new one, so that a caller's retry or recovery works as with unary
// calls. A stream that ended while idle (a server restarted, a connection lost) does not fail the step it would
// have carried: that step, unsent, goes on a new stream. Thread-compatible: one step at a time.
//
// ExtendStreams is what AttentionClient::Extend uses: steppers shared by the client's threads, keyed by the session
// a step names first (a routing proxy sends a whole stream where its mha-session-id hashes, so a stream carries
// the steps of the session it was opened for). A step takes an idle stepper of its session, or opens one while
// fewer than the cap are open, or takes the place of one idle for kStaleAfter (a session no longer stepping);
// else it goes unary. So a client holds at most the cap of streams (a server caps the streams of a connection,
// --max_streams_per_connection, and every call needs one), and a decoder stepping more sessions than that sends
// the rest unary. Thread-safe.
#ifndef MHA_CLIENT_EXTEND_STEPPER_H_
#define MHA_CLIENT_EXTEND_STEPPER_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/attention_client.h"

namespace mha {

class ExtendStepper {
 public:
  // Borrows `client`, which must outlive the stepper.
  explicit ExtendStepper(AttentionClient* client);
  // Ends an open stream (between steps: nothing is lost).
  ~ExtendStepper();

  // One Extend on the stream, or unary once the server showed it has none. Its errors are the server's.
  absl::StatusOr<v1::ExtendResponse> Step(const v1::ExtendRequest& request);
  // False once the server showed it has no ExtendStream.
  bool streaming() const { return streaming_; }

 private:
  struct Open;
  // Opens a stream for `request` (its first item's session id as mha-session-id, for proxies that route by it).
  void OpenFor(const v1::ExtendRequest& request);
  // Ends the open stream, between steps.
  void Close();

  AttentionClient* client_;
  bool streaming_ = true;
  std::unique_ptr<Open> open_;
};

class ExtendStreams {
 public:
  // An idle stream this old gives its place to another session's.
  static constexpr absl::Duration kStaleAfter = absl::Seconds(1);

  // At most `max_streams` streams at once; borrows `client`.
  ExtendStreams(AttentionClient* client, int max_streams) : client_(client), max_streams_(max_streams) {}

  absl::StatusOr<v1::ExtendResponse> Extend(const v1::ExtendRequest& request);
  // False once the server showed it has no ExtendStream.
  bool streaming() const { return streaming_.load(std::memory_order_relaxed); }
  // Streams open (idle or stepping). For tests.
  int open_streams() const;

 private:
  struct Idle {
    std::unique_ptr<ExtendStepper> stepper;
    absl::Time since;
  };
  // A stepper for `key`'s step: its idle one, a new one, or one in a stale one's place (that one in *stale, to
  // close outside the lock); null when the cap is reached.
  std::unique_ptr<ExtendStepper> Take(const std::string& key, std::unique_ptr<ExtendStepper>* stale);

  AttentionClient* const client_;
  const int max_streams_;
  std::atomic<bool> streaming_{true};
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<Idle>> idle_ ABSL_GUARDED_BY(mu_);  // by session id
  int opened_ ABSL_GUARDED_BY(mu_) = 0;  // steppers made: idle or stepping
};

}  // namespace mha

#endif  // MHA_CLIENT_EXTEND_STEPPER_H_
