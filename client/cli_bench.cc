// mha_client bench: a load test of MultiHeadAttention with the request the call flags describe. Closed loop
// (-c streams, -n calls or -z time), open loop (--rps, latency from each call's intended send time), a concurrency
// sweep (--concurrency_range), several connections (--connections); report as text, JSON or CSV on stdout and a
// progress line on stderr. The report is printed whatever the calls' statuses (errors are part of it); the exit code
// is 0 once a report is printed.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/attention_client.h"
#include "client/bench.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "client/bench_report.h"
#include "client/cli.h"
#include "client/cli_request.h"
#include "client/shared_memory.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(int, c, 1, "bench: concurrency, calls in flight at once (closed loop)");
ABSL_FLAG(int64_t, n, 0, "bench: measured calls (default 200 when -z is not given)");
ABSL_FLAG(absl::Duration, z, absl::ZeroDuration(), "bench: duration, e.g. 10s; with -n, whichever ends first");
ABSL_FLAG(double, rps, 0,
          "bench: open loop at this many calls per second, latency measured from each call's intended send time");
ABSL_FLAG(int, max_in_flight, 256, "bench: open loop, calls outstanding at most (a due call waits, and that counts)");
ABSL_FLAG(int, connections, 1, "bench: channels (TCP connections) to spread the calls over");
ABSL_FLAG(int64_t, warmup, 0, "bench: calls before each measured run, not counted");
ABSL_FLAG(std::string, concurrency_range, "", "bench: sweep of closed-loop runs, start:end:step or start:end:xF");
ABSL_FLAG(std::string, O, "pretty", "bench, heads: report format, pretty, json or csv");
ABSL_FLAG(int, health_baseline, 0,
          "bench: after each run, this many sequential health checks on the first connection, reported as the "
          "round-trip floor of any call");
ABSL_FLAG(bool, shared_memory, false,
          "bench: tensors and output through a POSIX shared-memory region registered with the server instead of "
          "in the messages (same host; the server needs --max_shared_memory_regions > 0); every call writes the "
          "same output bytes to one output area");
ABSL_FLAG(std::string, protocol, "native",
          "bench: the front door, native (mha.v1.Attention) or kserve (KServe v2 ModelInfer on the layer's model, as "
          "Triton's clients call it)");
ABSL_FLAG(bool, progress, false, "bench: progress line on stderr even when stderr is not a terminal");

namespace mha::cli {
namespace {

constexpr int kMaxHealthCalls = 1000000;

// `calls` sequential grpc.health.v1 Check calls over `channel`, each timed from call to decoded response.
absl::StatusOr<LatencySummary> MeasureHealthRoundTrip(const std::shared_ptr<grpc::Channel>& channel, int calls,
                                                      absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  std::vector<double> seconds;
  seconds.reserve(calls);
  for (int i = 0; i < calls; ++i) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::health::v1::HealthCheckResponse response;
    const auto start = std::chrono::steady_clock::now();
    const grpc::Status status = stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (!status.ok()) return FromGrpcStatus(status);
  }
  return SummarizeLatencies(std::move(seconds));
}

constexpr int64_t kDefaultTotal = 200;
constexpr int kMaxConnections = 256;
constexpr absl::Duration kMaxConnectWait = absl::Seconds(10);

// Rewrites one stderr line in place on a terminal; prints a line a second otherwise.
class ProgressPrinter {
 public:
  ProgressPrinter(bool tty, std::string label, int64_t total)
      : tty_(tty), label_(std::move(label)), total_(total) {}

  void operator()(const LoadProgress& p) {
    if (!tty_ && p.elapsed - last_printed_ < 1.0) return;
    last_printed_ = p.elapsed;
    const std::string line = absl::StrFormat(
        "[bench %s] %d%s calls done, %d in flight, %d errors, %.1f s, %.1f calls/s", label_, p.completed,
        total_ > 0 ? absl::StrCat("/", total_) : "", p.started - p.completed, p.errors, p.elapsed,
        p.elapsed > 0 ? static_cast<double>(p.completed) / p.elapsed : 0.0);
    std::fprintf(stderr, tty_ ? "\r%-100s" : "%s\n", line.c_str());
    std::fflush(stderr);
  }

  void Clear() {
    if (tty_) std::fprintf(stderr, "\r%100s\r", "");
  }

 private:
  const bool tty_;
  const std::string label_;
  const int64_t total_;
  double last_printed_ = -1;
};

// The request's tensors moved into a shared-memory object registered on the server (their data replaced by
// references), with room for the output after them; unregistered and removed when it goes.
class SharedRequest {
 public:
  static absl::StatusOr<std::unique_ptr<SharedRequest>> Place(AttentionClient* client,
                                                              v1::MultiHeadAttentionRequest* request) {
    v1::Tensor* tensors[] = {request->has_query() ? request->mutable_query() : nullptr,
                             request->has_key() ? request->mutable_key() : nullptr,
                             request->has_value() ? request->mutable_value() : nullptr};
    const v1::Tensor& query = request->query();
    const v1::DataType out_dtype =
        request->output_dtype() == v1::DATA_TYPE_UNSPECIFIED ? query.dtype() : request->output_dtype();
    if (query.shape_size() != 3) return absl::InvalidArgumentError("--shared_memory needs a [B, Tq, d_model] query");
    const uint64_t out_bytes = static_cast<uint64_t>(query.shape(0) * query.shape(1) * query.shape(2)) *
                               DTypeSize(out_dtype);
    const auto padded = [](const v1::Tensor* t) -> uint64_t { return (t->data().size() + 63) / 64 * 64; };
    uint64_t total = out_bytes;
    for (const v1::Tensor* t : tensors) {
      if (t != nullptr) total += padded(t);
    }
    const std::string suffix = std::to_string(getpid());
    auto placed = std::unique_ptr<SharedRequest>(new SharedRequest(client, "mha-bench-" + suffix));
    absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
        SharedMemoryObject::Create("/mha_bench_" + suffix, total);
    if (!object.ok()) return object.status();
    placed->object_ = *std::move(object);
    uint64_t at = 0;
    for (v1::Tensor* t : tensors) {
      if (t == nullptr) continue;
      std::memcpy(placed->object_->data() + at, t->data().data(), t->data().size());
      t->mutable_shared_memory()->set_region(placed->name_);
      t->mutable_shared_memory()->set_offset(at);
      at += padded(t);
      t->clear_data();
    }
    request->mutable_output_shared_memory()->set_region(placed->name_);
    request->mutable_output_shared_memory()->set_offset(at);
    if (absl::Status registered = client->RegisterSharedMemory(placed->name_, placed->object_->key(), total);
        !registered.ok()) {
      return absl::Status(registered.code(), absl::StrCat("RegisterSharedMemory: ", registered.message()));
    }
    placed->registered_ = true;
    return placed;
  }

  ~SharedRequest() {
    if (registered_) client_->UnregisterSharedMemory(name_).IgnoreError();
  }

 private:
  SharedRequest(AttentionClient* client, std::string name) : client_(client), name_(std::move(name)) {}
  AttentionClient* const client_;
  const std::string name_;
  std::unique_ptr<SharedMemoryObject> object_;
  bool registered_ = false;
};

}  // namespace

absl::StatusOr<std::string> ReportFormatFromFlags() {
  const std::string format = absl::GetFlag(FLAGS_O);
  if (format != "pretty" && format != "json" && format != "csv") {
    return absl::InvalidArgumentError(absl::StrCat("-O must be pretty, json or csv; got '", format, "'"));
  }
  return format;
}

namespace {

// What bench's flags ask for beyond the request: the load, the connections, the health baseline, the report's
// format and the concurrency levels to sweep.
struct BenchPlan {
  LoadOptions load;
  std::string protocol;
  int connections = 1;
  int health_calls = 0;
  std::string format;
  std::vector<int> levels;
};

// The flags checked; INVALID_ARGUMENT naming the flag.
absl::StatusOr<BenchPlan> BenchPlanFromFlags(const ClientOptions& options) {
  BenchPlan plan;
  LoadOptions& load = plan.load;
  load.concurrency = absl::GetFlag(FLAGS_c);
  load.total = absl::GetFlag(FLAGS_n);
  load.duration = absl::GetFlag(FLAGS_z);
  load.rps = absl::GetFlag(FLAGS_rps);
  load.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  load.warmup = absl::GetFlag(FLAGS_warmup);
  load.timeout = options.timeout;
  plan.protocol = absl::GetFlag(FLAGS_protocol);
  if (plan.protocol != "native" && plan.protocol != "kserve") {
    return absl::InvalidArgumentError(absl::StrCat("--protocol must be native or kserve; got '", plan.protocol, "'"));
  }
  load.protocol = plan.protocol == "kserve" ? BenchProtocol::kKServe : BenchProtocol::kNative;
  if (load.total == 0 && load.duration == absl::ZeroDuration()) load.total = kDefaultTotal;
  if (absl::Status valid = ValidateLoadOptions(load); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bench: ", valid.message()));
  }
  plan.connections = absl::GetFlag(FLAGS_connections);
  if (plan.connections < 1 || plan.connections > kMaxConnections) {
    return absl::InvalidArgumentError(
        absl::StrCat("--connections must be in [1, ", kMaxConnections, "]; got ", plan.connections));
  }
  plan.health_calls = absl::GetFlag(FLAGS_health_baseline);
  if (plan.health_calls < 0 || plan.health_calls > kMaxHealthCalls) {
    return absl::InvalidArgumentError(
        absl::StrCat("--health_baseline must be in [0, ", kMaxHealthCalls, "]; got ", plan.health_calls));
  }
  absl::StatusOr<std::string> format = ReportFormatFromFlags();
  if (!format.ok()) return format.status();
  plan.format = *format;
  plan.levels = {load.concurrency};
  const std::string range = absl::GetFlag(FLAGS_concurrency_range);
  if (!range.empty()) {
    if (load.rps > 0) return absl::InvalidArgumentError("--concurrency_range sweeps the closed loop; drop --rps");
    absl::StatusOr<std::vector<int>> parsed = ParseConcurrencyRange(range);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--concurrency_range ", parsed.status().message()));
    }
    plan.levels = *parsed;
  }
  return plan;
}

// `count` channels of their own, connected before any call is timed (connection set-up is not part of any call's
// latency; a channel that cannot connect shows up as errors).
std::vector<std::shared_ptr<grpc::Channel>> ConnectChannels(const ClientOptions& options, int count) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  ClientOptions channel_options = options;
  channel_options.dedicated_connection = true;
  for (int i = 0; i < count; ++i) channels.push_back(CreateAttentionChannel(channel_options));
  const absl::Duration connect_wait = std::min(options.timeout, kMaxConnectWait);
  for (const auto& channel : channels) {
    if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + connect_wait))) {
      std::fprintf(stderr, "warning: a channel to %s is not connected after %s\n", options.target.c_str(),
                   absl::FormatDuration(connect_wait).c_str());
    }
  }
  return channels;
}

// One level of the sweep: its load run and its report (with the health baseline when asked for).
absl::StatusOr<BenchReport> RunLevel(const ClientOptions& options, const BenchPlan& plan, int level,
                                     const PreparedRequest& prepared,
                                     const std::vector<std::shared_ptr<grpc::Channel>>& channels) {
  LoadOptions load = plan.load;
  load.concurrency = level;
  RunConfig config;
  config.open_loop = load.rps > 0;
  config.concurrency = level;
  config.target_rps = load.rps;
  config.max_in_flight = load.max_in_flight;
  config.connections = plan.connections;
  config.warmup = load.warmup;
  config.target = options.target;
  config.weights = prepared.weights;
  config.protocol = plan.protocol;
  config.shape = prepared.shape;
  config.request_bytes = static_cast<int64_t>(prepared.request.ByteSizeLong());
  ProgressPrinter printer(isatty(fileno(stderr)),
                          config.open_loop ? absl::StrFormat("rps=%.6g", load.rps) : absl::StrCat("c=", level),
                          load.total);
  std::function<void(const LoadProgress&)> on_progress;
  if (isatty(fileno(stderr)) || absl::GetFlag(FLAGS_progress)) {
    on_progress = [&printer](const LoadProgress& p) { printer(p); };
  }
  absl::StatusOr<LoadResult> result = RunLoad(load, channels, prepared.request, on_progress);
  printer.Clear();
  if (!result.ok()) return result.status();
  BenchReport report = Summarize(config, *result);
  if (plan.health_calls > 0) {
    absl::StatusOr<LatencySummary> health =
        MeasureHealthRoundTrip(channels.front(), plan.health_calls, options.timeout);
    if (!health.ok()) return health.status();
    report.health_calls = plan.health_calls;
    report.health = *health;
  }
  return report;
}

}  // namespace

int RunBench(const ClientOptions& options) {
  absl::StatusOr<RequestFlags> flags = RequestFlagsFromCommandLine();
  if (!flags.ok()) return UsageError(flags.status());
  absl::StatusOr<BenchPlan> plan = BenchPlanFromFlags(options);
  if (!plan.ok()) return UsageError(plan.status());

  AttentionClient client(options);
  absl::StatusOr<PreparedRequest> prepared = PrepareRequest(*flags, client);
  if (!prepared.ok()) return Fail(prepared.status());
  std::unique_ptr<SharedRequest> shared;
  if (absl::GetFlag(FLAGS_shared_memory)) {
    absl::StatusOr<std::unique_ptr<SharedRequest>> placed = SharedRequest::Place(&client, &prepared->request);
    if (!placed.ok()) return Fail(placed.status());
    shared = *std::move(placed);
  }
  const std::vector<std::shared_ptr<grpc::Channel>> channels = ConnectChannels(options, plan->connections);
  std::vector<BenchReport> reports;
  for (int level : plan->levels) {
    absl::StatusOr<BenchReport> report = RunLevel(options, *plan, level, *prepared, channels);
    if (!report.ok()) return Fail(report.status());
    reports.push_back(*std::move(report));
  }
  const std::string& format = plan->format;
  const std::string text =
      format == "json" ? FormatJson(reports) : format == "csv" ? FormatCsv(reports) : FormatPretty(reports);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return kExitOk;
}

}  // namespace mha::cli
