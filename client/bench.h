// Load generation against the Attention service: the same MultiHeadAttention request sent many times, either in a
// closed loop (a fixed number of calls in flight, each sent when the previous one of its stream returns) or in an
// open loop (calls scheduled at fixed intended times, i / rps after the start, whatever the server does).
//
// In the open loop every latency is measured from the call's intended send time, not from when it was actually
// sent, so a server that stalls cannot hide the queueing it causes (no "coordinated omission"): if the client had
// to hold a call back (all --max_in_flight slots busy, or the previous send still serializing) that wait counts.
//
// Every call carries a deadline, the number of calls and threads is bounded, and RunLoad returns only after every
// call it started has completed.
#ifndef MHA_CLIENT_BENCH_H_
#define MHA_CLIENT_BENCH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/bench_wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

struct LoadOptions {
  // Closed loop: calls in flight at once (one thread per stream), 1..kMaxConcurrency. Also the concurrency of the
  // warmup calls in either mode.
  int concurrency = 1;
  // > 0 selects the open loop: call i is due at start + i / rps seconds.
  double rps = 0;
  // Open loop: calls outstanding at most, 1..kMaxInFlight. A due call waits for a free slot (and that wait is part of
  // its latency).
  int max_in_flight = 256;
  // Measured calls at most; 0 = no count limit (then duration must be set).
  int64_t total = 0;
  // Closed loop: no call starts after this much time. Open loop: calls are scheduled for this long (rps * duration
  // calls, fewer if total is smaller). Zero = no time limit (then total must be set).
  absl::Duration duration = absl::ZeroDuration();
  // Calls made before the measurement starts and not recorded (closed loop at `concurrency`).
  int64_t warmup = 0;
  // Deadline of every call.
  absl::Duration timeout = absl::Seconds(60);
  // Which front door the calls go through (bench_wire.h).
  BenchProtocol protocol = BenchProtocol::kNative;
};

inline constexpr int kMaxConcurrency = 1024;
inline constexpr int kMaxInFlight = 10000;

// INVALID_ARGUMENT naming the option if `options` is out of range or unbounded.
absl::Status ValidateLoadOptions(const LoadOptions& options);

// What happened to one measured call. Times are seconds.
struct CallSample {
  int code = 0;         // absl::StatusCode / grpc::StatusCode value (0 = OK)
  std::string message;  // the error message; empty when OK
  double latency = 0;   // intended send time (open loop) or start of the call (closed loop) -> response decoded
  double send_delay = 0;   // intended send time -> the client started the call (0 in the closed loop)
  double serialize = 0;    // protobuf encoding of the request into a gRPC byte buffer
  double deserialize = 0;  // protobuf decoding of the response (0 for an error)
  double server_queue = 0;    // response.timing().queue_us (0 for an error)
  double server_compute = 0;  // response.timing().compute_us (0 for an error)
  double server_handler = 0;  // response.timing().handler_us: validation + queue + compute (0 for an error, and
                              // from servers that predate the field)
};

struct LoadResult {
  std::vector<CallSample> samples;  // one per measured call, in completion order; every started call completed
  double elapsed = 0;               // measurement start -> last measured call completed, seconds
  int64_t in_flight_waits = 0;      // open loop: due calls that had to wait for a free slot
};

// A snapshot for a progress line: measured calls started and completed so far, errors among them, seconds since the
// measurement started (warmup calls are not included).
struct LoadProgress {
  int64_t started = 0;
  int64_t completed = 0;
  int64_t errors = 0;
  double elapsed = 0;
};

// The concurrency levels of a sweep "start:end:step" (start, start + step, ... up to end) or "start:end:xF" (start,
// start * F, ... up to end); e.g. "1:64:x2" is 1, 2, 4, ..., 64 and "4:16:4" is 4, 8, 12, 16. Levels are in
// [1, kMaxConcurrency]. INVALID_ARGUMENT for anything else.
absl::StatusOr<std::vector<int>> ParseConcurrencyRange(absl::string_view spec);

// Runs the load: warmup calls, then the measured ones. Call i (and closed-loop stream i) goes through
// channels[i % channels.size()]. `on_progress`, if set, is called about four times a second from a helper thread
// while the measured calls run. INVALID_ARGUMENT if the options are invalid, no channel is given, or the request
// cannot go through options.protocol's front door.
absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options,
                                   absl::Span<const std::shared_ptr<grpc::Channel>> channels,
                                   const v1::MultiHeadAttentionRequest& request,
                                   const std::function<void(const LoadProgress&)>& on_progress = nullptr);

}  // namespace mha

#endif  // MHA_CLIENT_BENCH_H_
