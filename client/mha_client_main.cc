// mha_client: a command-line client for mha_server.
//   mha_client health            exit 0 only when the server reports SERVING (usable as a container probe)
//   mha_client info              server version, backends, limits and registered layers
//   mha_client call [flags]      one MultiHeadAttention call with a random query; prints a summary
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "gRPC target; a list like ipv4:a:1,b:2 with --lb round_robin");
ABSL_FLAG(std::string, lb, "", "load-balancing policy across the target's addresses: pick_first or round_robin");
ABSL_FLAG(double, timeout_s, 60, "deadline of each call, seconds");
ABSL_FLAG(int, max_message_mb, 256, "largest message, MiB (match the server's --max_message_mb)");
ABSL_FLAG(std::string, layer, "demo", "call: registered layer to use");
ABSL_FLAG(int, batch, 1, "call: B");
ABSL_FLAG(int, seq, 16, "call: Tq (and Tk for self-attention)");
ABSL_FLAG(bool, causal, false, "call: causal (bottom-right aligned) masking");
ABSL_FLAG(std::string, key_lengths, "", "call: comma-separated valid key count per batch item");
ABSL_FLAG(bool, weights, false, "call: also return the per-head attention weights");
ABSL_FLAG(std::string, backend, "auto", "call: auto, cpu, reference or cuda");
ABSL_FLAG(std::string, dtype, "fp32", "call: wire dtype of the query: fp32, fp16 or bf16");
ABSL_FLAG(int, seed, 1, "call: seed of the random query (uniform in [-1, 1])");
ABSL_FLAG(bool, check, false, "call: repeat on the reference backend and fail unless outputs agree");

namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

int Health(mha::AttentionClient& client) {
  absl::StatusOr<bool> serving = client.Serving();
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

int Info(mha::AttentionClient& client) {
  absl::StatusOr<mha::v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  std::printf("version %s, default backend %s\n", info->version().c_str(), info->default_backend().c_str());
  for (const auto& b : info->backends()) {
    std::printf("  backend %-9s %s %s\n", b.name().c_str(), b.available() ? "available  " : "unavailable",
                b.available() ? b.device().c_str() : b.detail().c_str());
  }
  const auto& l = info->limits();
  std::printf("limits: max_message %lld MiB, queue %d, compute threads %d, layers %lld MiB, scratch %lld MiB, "
              "%.0f GFLOP per request\n",
              static_cast<long long>(l.max_message_bytes() >> 20), l.max_queue_size(), l.compute_threads(),
              static_cast<long long>(l.max_layer_bytes() >> 20), static_cast<long long>(l.max_scratch_bytes() >> 20),
              l.max_request_gflop());
  absl::StatusOr<mha::v1::ListLayersResponse> layers = client.ListLayers();
  if (!layers.ok()) return Fail(layers.status());
  for (const auto& layer : layers->layers()) {
    std::printf("  layer %-16s d_model %lld, heads %d (kv %d, d_k %d)%s, %s\n", layer.name().c_str(),
                static_cast<long long>(layer.d_model()), layer.heads().num_heads(), layer.heads().num_kv_heads(),
                layer.heads().head_dim(), layer.heads().causal() ? ", causal" : "", layer.source().c_str());
  }
  return 0;
}

int Call(mha::AttentionClient& client) {
  using mha::v1::MultiHeadAttentionRequest;
  // Find the layer's d_model so the random query fits it.
  absl::StatusOr<mha::v1::ListLayersResponse> layers = client.ListLayers();
  if (!layers.ok()) return Fail(layers.status());
  int64_t d_model = 0;
  for (const auto& layer : layers->layers()) {
    if (layer.name() == absl::GetFlag(FLAGS_layer)) d_model = layer.d_model();
  }
  if (d_model == 0) return Fail(absl::NotFoundError("no layer named " + absl::GetFlag(FLAGS_layer)));

  MultiHeadAttentionRequest request;
  request.set_layer(absl::GetFlag(FLAGS_layer));
  const int64_t batch = absl::GetFlag(FLAGS_batch), seq = absl::GetFlag(FLAGS_seq);
  std::vector<float> query(batch * seq * d_model);
  uint32_t state = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed)) * 2654435761u + 1;
  for (float& x : query) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) / static_cast<float>(1 << 23) - 1.0f;
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  const mha::v1::DataType wire = dtype == "fp16" ? mha::v1::FP16 : dtype == "bf16" ? mha::v1::BF16 : mha::v1::FP32;
  mha::FloatsToTensor(query, {batch, seq, d_model}, wire, request.mutable_query());
  if (absl::GetFlag(FLAGS_causal)) request.mutable_heads()->set_causal(true);
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_key_lengths), ',', absl::SkipEmpty())) {
    int32_t n;
    if (!absl::SimpleAtoi(part, &n)) return Fail(absl::InvalidArgumentError("--key_lengths: not an integer"));
    request.add_key_lengths(n);
  }
  request.set_return_attention_weights(absl::GetFlag(FLAGS_weights));
  const std::string backend = absl::GetFlag(FLAGS_backend);
  request.set_backend(backend == "cpu"         ? mha::v1::BACKEND_CPU
                      : backend == "reference" ? mha::v1::BACKEND_REFERENCE
                      : backend == "cuda"      ? mha::v1::BACKEND_CUDA
                                               : mha::v1::BACKEND_AUTO);

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<mha::v1::MultiHeadAttentionResponse> response = client.MultiHeadAttention(request);
  const double latency_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!response.ok()) return Fail(response.status());
  const std::vector<float> out = mha::TensorToFloats(response->output());
  double sum = 0, abs_sum = 0;
  for (float x : out) {
    sum += x;
    abs_sum += std::abs(x);
  }
  std::printf("output %s %s, backend %s, queue %lld us, compute %lld us, end-to-end %.2f ms, checksum %.6g "
              "(abs %.6g)\n",
              mha::ShapeString(response->output().shape()).c_str(), mha::DTypeName(response->output().dtype()).c_str(),
              response->backend().c_str(), static_cast<long long>(response->timing().queue_us()),
              static_cast<long long>(response->timing().compute_us()), latency_ms, sum, abs_sum);
  if (response->has_attention_weights()) {
    std::printf("attention_weights %s\n", mha::ShapeString(response->attention_weights().shape()).c_str());
  }
  if (absl::GetFlag(FLAGS_check)) {
    request.set_backend(mha::v1::BACKEND_REFERENCE);
    absl::StatusOr<mha::v1::MultiHeadAttentionResponse> want = client.MultiHeadAttention(request);
    if (!want.ok()) return Fail(want.status());
    const std::vector<float> ref = mha::TensorToFloats(want->output());
    double worst = 0;
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(out[i]) - ref[i]));
    const double tolerance = response->output().dtype() == mha::v1::FP32 ? 1e-4 : 2e-2;
    std::printf("check against reference: max |diff| %.3g (tolerance %.0e) %s\n", worst, tolerance,
                worst <= tolerance ? "OK" : "MISMATCH");
    if (!(worst <= tolerance)) return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("mha_client health|info|call [--flags]: a client for mha_server");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "usage: mha_client health|info|call [--flags]  (--help for flags)\n");
    return 2;
  }
  mha::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.lb_policy = absl::GetFlag(FLAGS_lb);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  mha::AttentionClient client(options);
  const std::string command = args[1];
  if (command == "health") return Health(client);
  if (command == "info") return Info(client);
  if (command == "call") return Call(client);
  std::fprintf(stderr, "unknown command '%s'; expected health, info or call\n", command.c_str());
  return 2;
}
