#include "client/bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace mha {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Everything gRPC's completion callbacks touch. Shared with each call so that it outlives the last callback even
// if that callback runs after RunLoad's frame is gone.
struct LoadState {
  absl::Mutex mu;
  std::vector<CallSample> samples ABSL_GUARDED_BY(mu);
  int64_t started ABSL_GUARDED_BY(mu) = 0;    // measured calls started
  int64_t completed ABSL_GUARDED_BY(mu) = 0;  // measured calls completed
  int64_t errors ABSL_GUARDED_BY(mu) = 0;
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;  // all calls, warmup included
  int64_t live ABSL_GUARDED_BY(mu) = 0;       // Call objects not yet destroyed
  Clock::time_point last_done ABSL_GUARDED_BY(mu);
};

// Counts a Call as live from construction to the very end of its destruction.
class LiveToken {
 public:
  explicit LiveToken(std::shared_ptr<LoadState> state) : state_(std::move(state)) {
    absl::MutexLock lock(&state_->mu);
    ++state_->live;
  }
  ~LiveToken() {
    absl::MutexLock lock(&state_->mu);
    --state_->live;
  }
  LiveToken(const LiveToken&) = delete;
  LiveToken& operator=(const LiveToken&) = delete;

 private:
  std::shared_ptr<LoadState> state_;
};

// One call in flight. token is declared first so that it is destroyed last, after the ClientContext.
struct Call {
  explicit Call(std::shared_ptr<LoadState> state) : token(std::move(state)) {}
  LiveToken token;
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  Clock::time_point intended;
  Clock::time_point started;
  Clock::time_point sent;
};

class LoadRunner {
 public:
  LoadRunner(const LoadOptions& options, absl::Span<const std::shared_ptr<grpc::Channel>> channels,
             std::unique_ptr<BenchWire> wire)
      : options_(options), wire_(std::move(wire)), state_(std::make_shared<LoadState>()) {
    for (const auto& channel : channels) stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
  }

  ~LoadRunner() {
    // Wait until gRPC has released every call, so that no ClientContext outlives the channels.
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](LoadState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->live == 0; }, state_.get()));
  }

  LoadResult Run(const std::function<void(const LoadProgress&)>& on_progress) {
    if (options_.warmup > 0) RunClosed(options_.warmup, absl::ZeroDuration(), /*record=*/false);
    start_ = Clock::now();
    {
      absl::MutexLock lock(&state_->mu);
      state_->last_done = start_;
    }
    std::atomic<bool> finished{false};
    std::thread progress;
    if (on_progress) {
      progress = std::thread([&] {
        while (!finished.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(250));
          if (finished.load()) break;
          on_progress(Snapshot());
        }
      });
    }
    LoadResult result;
    if (options_.rps > 0) {
      result.in_flight_waits = RunOpen();
    } else {
      RunClosed(options_.total, options_.duration, /*record=*/true);
    }
    finished.store(true);
    if (progress.joinable()) progress.join();
    absl::MutexLock lock(&state_->mu);
    result.samples = std::move(state_->samples);
    result.elapsed = Seconds(state_->last_done - start_);
    return result;
  }

 private:
  LoadProgress Snapshot() {
    absl::MutexLock lock(&state_->mu);
    return LoadProgress{state_->started, state_->completed, state_->errors, Seconds(Clock::now() - start_)};
  }

  // `concurrency` streams, each one call at a time, until `total` calls (0 = no limit) have been started or, with a
  // non-zero duration, until the duration has passed. Returns when every call has completed.
  void RunClosed(int64_t total, absl::Duration duration, bool record) {
    const Clock::time_point deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(duration));
    std::atomic<int64_t> tickets{0};
    std::vector<std::thread> streams;
    for (int s = 0; s < options_.concurrency; ++s) {
      streams.emplace_back([&, s] {
        grpc::GenericStub* stub = stubs_[s % stubs_.size()].get();
        while (true) {
          if (total > 0 && tickets.fetch_add(1) >= total) break;
          if (duration > absl::ZeroDuration() && Clock::now() >= deadline) break;
          absl::Notification done;
          Start(stub, Clock::now(), record, [&done] { done.Notify(); });
          done.WaitForNotification();
        }
      });
    }
    for (std::thread& stream : streams) stream.join();
  }

  // Schedules call i at start_ + i / rps; returns how many due calls had to wait for a free in-flight slot.
  int64_t RunOpen() {
    int64_t count = options_.total;
    if (options_.duration > absl::ZeroDuration()) {
      const int64_t scheduled =
          std::max<int64_t>(1, std::llround(absl::ToDoubleSeconds(options_.duration) * options_.rps));
      count = count > 0 ? std::min(count, scheduled) : scheduled;
    }
    int64_t waits = 0;
    for (int64_t i = 0; i < count; ++i) {
      const Clock::time_point intended =
          start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(i / options_.rps));
      std::this_thread::sleep_until(intended);
      {
        absl::MutexLock lock(&state_->mu);
        auto slot_free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
          return state_->in_flight < options_.max_in_flight;
        };
        if (!slot_free()) {
          ++waits;
          state_->mu.Await(absl::Condition(&slot_free));
        }
      }
      Start(stubs_[i % stubs_.size()].get(), intended, /*record=*/true, nullptr);
    }
    absl::MutexLock lock(&state_->mu);
    auto all_done = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) { return state_->completed == count; };
    state_->mu.Await(absl::Condition(&all_done));
    return waits;
  }

  // Starts one call due at `intended`; records it (if `record`) when it completes, then runs `done` (on a gRPC
  // thread, or on this one if the request cannot be serialized).
  void Start(grpc::GenericStub* stub, Clock::time_point intended, bool record, std::function<void()> done) {
    auto call = std::make_shared<Call>(state_);
    {
      absl::MutexLock lock(&state_->mu);
      ++state_->in_flight;
      if (record) ++state_->started;
    }
    call->intended = intended;
    call->started = Clock::now();
    const absl::Status serialized = wire_->Encode(&call->request);
    call->sent = Clock::now();
    if (!serialized.ok()) {
      Finish(*call, grpc::Status(grpc::StatusCode::INTERNAL, std::string(serialized.message())), Clock::now(),
             record);
      if (done) done();
      return;
    }
    call->context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(options_.timeout));
    stub->UnaryCall(&call->context, wire_->method(), grpc::StubOptions(), &call->request, &call->response,
                    [this, call, record, done = std::move(done)](grpc::Status status) {
                      Finish(*call, status, Clock::now(), record);
                      if (done) done();
                    });
  }

  // Decodes the response and records the sample. Runs before `call` is destroyed, so before ~LoadRunner returns.
  void Finish(Call& call, const grpc::Status& status, Clock::time_point returned, bool record) {
    CallSample sample;
    sample.code = status.error_code();
    if (status.ok()) {
      const absl::StatusOr<ServerTimes> times = wire_->Decode(call.response);
      if (times.ok()) {
        sample.server_queue = static_cast<double>(times->queue_us) * 1e-6;
        sample.server_compute = static_cast<double>(times->compute_us) * 1e-6;
        sample.server_handler = static_cast<double>(times->handler_us) * 1e-6;
      } else {
        sample.code = grpc::StatusCode::INTERNAL;
        sample.message = std::string(times.status().message());
      }
    } else {
      sample.message = status.error_message();
    }
    const Clock::time_point end = Clock::now();
    sample.latency = Seconds(end - call.intended);
    sample.send_delay = Seconds(call.started - call.intended);
    sample.serialize = Seconds(call.sent - call.started);
    sample.deserialize = sample.code == 0 ? Seconds(end - returned) : 0.0;
    absl::MutexLock lock(&state_->mu);
    --state_->in_flight;
    if (!record) return;
    ++state_->completed;
    if (sample.code != 0) ++state_->errors;
    state_->last_done = std::max(state_->last_done, end);
    state_->samples.push_back(std::move(sample));
  }

  const LoadOptions options_;
  const std::unique_ptr<BenchWire> wire_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::shared_ptr<LoadState> state_;
  Clock::time_point start_;
};

}  // namespace

absl::Status ValidateLoadOptions(const LoadOptions& options) {
  if (options.concurrency < 1 || options.concurrency > kMaxConcurrency) {
    return absl::InvalidArgumentError(
        absl::StrCat("concurrency must be in [1, ", kMaxConcurrency, "]; got ", options.concurrency));
  }
  if (options.rps < 0 || !std::isfinite(options.rps)) {
    return absl::InvalidArgumentError(absl::StrCat("rps must be a finite number >= 0; got ", options.rps));
  }
  if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_in_flight must be in [1, ", kMaxInFlight, "]; got ", options.max_in_flight));
  }
  if (options.total < 0) return absl::InvalidArgumentError(absl::StrCat("total must be >= 0; got ", options.total));
  if (options.duration < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration must be >= 0; got ", absl::FormatDuration(options.duration)));
  }
  if (options.total == 0 && options.duration == absl::ZeroDuration()) {
    return absl::InvalidArgumentError("a run needs a call count or a duration");
  }
  if (options.warmup < 0) {
    return absl::InvalidArgumentError(absl::StrCat("warmup must be >= 0; got ", options.warmup));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout must be > 0; got ", absl::FormatDuration(options.timeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> ParseConcurrencyRange(absl::string_view spec) {
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  auto bad = [&]() {
    return absl::InvalidArgumentError(absl::StrCat("'", spec,
                                                   "' must be start:end:step or start:end:xFACTOR with 1 <= start "
                                                   "<= end <= ", kMaxConcurrency, ", e.g. 1:64:x2"));
  };
  int start = 0, end = 0, step = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &start) || !absl::SimpleAtoi(parts[1], &end)) return bad();
  absl::string_view step_text = parts[2];
  const bool multiply = absl::ConsumePrefix(&step_text, "x");
  if (!absl::SimpleAtoi(step_text, &step) || start < 1 || end < start || end > kMaxConcurrency) return bad();
  if (multiply ? step < 2 : step < 1) return bad();
  std::vector<int> levels;
  for (int64_t c = start; c <= end; c = multiply ? c * step : c + step) levels.push_back(static_cast<int>(c));
  return levels;
}

absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options,
                                   absl::Span<const std::shared_ptr<grpc::Channel>> channels,
                                   const v1::MultiHeadAttentionRequest& request,
                                   const std::function<void(const LoadProgress&)>& on_progress) {
  if (absl::Status valid = ValidateLoadOptions(options); !valid.ok()) return valid;
  if (channels.empty()) return absl::InvalidArgumentError("no channel to send calls through");
  absl::StatusOr<std::unique_ptr<BenchWire>> wire = MakeBenchWire(options.protocol, request);
  if (!wire.ok()) return wire.status();
  LoadRunner runner(options, channels, *std::move(wire));
  return runner.Run(on_progress);
}

}  // namespace mha
