// mha_client call: one MultiHeadAttention request built from the flags; prints a summary line (shapes, backend,
// server queue and compute time, end-to-end latency, a checksum), writes the output and attention weights to .npy
// files on request, and with --check repeats the call on the reference backend and compares.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "client/cli.h"
#include "client/cli_request.h"
#include "client/npy.h"
#include "proto/mha/v1/attention_shape.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(bool, check, false, "call: repeat on the reference backend and fail unless the outputs agree");

namespace mha::cli {
namespace {

absl::Status WriteTensor(const std::string& path, const v1::Tensor& tensor, const char* what) {
  absl::Status written = WriteNpy(path, NpyFromTensor(tensor));
  if (written.ok()) std::printf("wrote %s %s to %s\n", what, ShapeString(tensor.shape()).c_str(), path.c_str());
  return written;
}

// The reference backend computes in plain loops, tens of times slower than the others: says so on stderr before it
// runs, with the time the server's rate for it predicts when it knows one. That rate comes from small calls, which
// run faster per FLOP than large ones (2.8 GFLOP/s at warm-up against 1.3 for an (8, 512, 512) layer on a Zen 4
// VM), so the prediction is a lower bound.
void AnnounceReferenceRun(AttentionClient& client, const AttentionShape& shape) {
  double gflops = 0;
  if (absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo(); info.ok()) {
    for (const v1::BackendInfo& backend : info->backends()) {
      if (backend.name() == "reference") gflops = backend.gflops();
    }
  }
  const double seconds = gflops > 0 ? AttentionFlops(shape) / (gflops * 1e9) : 0;
  if (seconds >= 1) {
    std::fprintf(stderr, "checking against the reference backend (plain loops): %.0f s or more\n", seconds);
  } else {
    std::fprintf(stderr, "checking against the reference backend (plain loops)\n");
  }
}

}  // namespace

int RunCall(const ClientOptions& options) {
  absl::StatusOr<RequestFlags> flags = RequestFlagsFromCommandLine();
  if (!flags.ok()) return UsageError(flags.status());
  const std::string output_path = absl::GetFlag(FLAGS_output);
  const std::string weights_path = absl::GetFlag(FLAGS_weights_output);

  AttentionClient client(options);
  absl::StatusOr<PreparedRequest> prepared = PrepareRequest(*flags, client);
  if (!prepared.ok()) return Fail(prepared.status());
  v1::MultiHeadAttentionRequest& request = prepared->request;

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::MultiHeadAttentionResponse> response = client.MultiHeadAttention(request);
  const double latency_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!response.ok()) return Fail(response.status());
  const std::vector<float> out = TensorToFloats(response->output());
  double sum = 0, abs_sum = 0;
  for (float x : out) {
    sum += x;
    abs_sum += std::abs(x);
  }
  std::printf("output %s %s, backend %s, queue %lld us, compute %lld us, end-to-end %.2f ms, checksum %.6g "
              "(abs %.6g)\n",
              ShapeString(response->output().shape()).c_str(), DTypeName(response->output().dtype()).c_str(),
              response->backend().c_str(), static_cast<long long>(response->timing().queue_us()),
              static_cast<long long>(response->timing().compute_us()), latency_ms, sum, abs_sum);
  if (response->has_attention_weights()) {
    std::printf("attention_weights %s\n", ShapeString(response->attention_weights().shape()).c_str());
  }
  if (!output_path.empty()) {
    if (absl::Status s = WriteTensor(output_path, response->output(), "output"); !s.ok()) return Fail(s);
  }
  if (!weights_path.empty()) {
    if (absl::Status s = WriteTensor(weights_path, response->attention_weights(), "attention_weights"); !s.ok()) {
      return Fail(s);
    }
  }
  if (absl::GetFlag(FLAGS_check)) {
    AnnounceReferenceRun(client, prepared->shape);
    request.set_backend(v1::BACKEND_REFERENCE);
    absl::StatusOr<v1::MultiHeadAttentionResponse> want = client.MultiHeadAttention(request);
    if (!want.ok()) return Fail(want.status());
    const std::vector<float> ref = TensorToFloats(want->output());
    double worst = 0;
    for (size_t i = 0; i < out.size() && i < ref.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(out[i]) - ref[i]));
    }
    if (ref.size() != out.size()) worst = INFINITY;
    // The proto's tolerances (DataType), as absolute bounds on outputs of order one: fp32 throughout; a 16-bit
    // input or output (rounded, or computed in 16 bits on the GPU or the CPU's bf16 path); bf16 the widest.
    const v1::DataType in = request.query().dtype(), out_dtype = response->output().dtype();
    const double tolerance = in == v1::FP32 && out_dtype == v1::FP32 ? 1e-4
                             : in == v1::BF16 || out_dtype == v1::BF16 ? 3e-2
                                                                        : 2e-2;
    std::printf("check against reference: max |diff| %.3g (tolerance %.0e) %s\n", worst, tolerance,
                worst <= tolerance ? "OK" : "MISMATCH");
    if (!(worst <= tolerance)) return kExitFailure;
  }
  return kExitOk;
}

}  // namespace mha::cli
