// mha_client heads: one MultiHeadAttention call with return_head_stats on the request the call flags describe; prints
// every head's statistics (means over the batch items) ranked by contribution. --ablate K calls again with the K
// least contributing heads masked and reports the output's relative change beside the bound the contributions
// predict. Report as text, JSON or CSV (-O, as bench).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "client/cli_request.h"
#include "client/head_stats_report.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(int, ablate, 0,
          "heads: call again with the K least contributing heads masked (head_mask 0, the others as given or 1) and "
          "report the output's relative change beside the sum of their contributions, its predicted upper bound; "
          "0 = no second call; K must be below H");

namespace mha::cli {
namespace {

// Calls `request` again with the last `k` heads of `ranked` masked out of the factors it had (1 where it had none)
// and measures the output's change against `output`.
absl::StatusOr<Ablation> Ablate(AttentionClient& client, v1::MultiHeadAttentionRequest request,
                                const std::vector<HeadSummary>& ranked, int k, const v1::Tensor& output) {
  const int64_t num_heads = static_cast<int64_t>(ranked.size());
  if (request.head_mask_size() != num_heads) {
    request.clear_head_mask();
    for (int64_t h = 0; h < num_heads; ++h) request.add_head_mask(1.0f);
  }
  Ablation ablation;
  for (int i = 0; i < k; ++i) {
    const int64_t head = ranked[num_heads - 1 - i].head;
    ablation.heads.push_back(head);
    request.set_head_mask(static_cast<int>(head), 0.0f);
  }
  request.set_return_head_stats(false);
  request.set_return_attention_weights(false);
  absl::StatusOr<v1::MultiHeadAttentionResponse> ablated = client.MultiHeadAttention(request);
  if (!ablated.ok()) return ablated.status();
  const int64_t d_model = output.shape_size() == 3 ? output.shape(2) : 0;
  if (absl::Status s = MeasureAblation(TensorToFloats(output), TensorToFloats(ablated->output()), d_model, ranked,
                                       &ablation);
      !s.ok()) {
    return absl::InternalError(absl::StrCat("the server's outputs: ", s.message()));
  }
  return ablation;
}

}  // namespace

int RunHeads(const ClientOptions& options) {
  absl::StatusOr<RequestFlags> flags = RequestFlagsFromCommandLine();
  if (!flags.ok()) return UsageError(flags.status());
  absl::StatusOr<std::string> format = ReportFormatFromFlags();
  if (!format.ok()) return UsageError(format.status());
  const int ablate = absl::GetFlag(FLAGS_ablate);
  if (ablate < 0) return UsageError(absl::InvalidArgumentError(absl::StrCat("--ablate must be >= 0; got ", ablate)));

  AttentionClient client(options);
  absl::StatusOr<PreparedRequest> prepared = PrepareRequest(*flags, client);
  if (!prepared.ok()) return Fail(prepared.status());
  const AttentionShape& shape = prepared->shape;
  if (ablate >= shape.heads.num_heads) {
    return UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--ablate ", ablate, " must be below H = ", shape.heads.num_heads, " (at least one head stays)")));
  }
  v1::MultiHeadAttentionRequest& request = prepared->request;
  request.set_return_head_stats(true);
  absl::StatusOr<v1::MultiHeadAttentionResponse> response = client.MultiHeadAttention(request);
  if (!response.ok()) return Fail(response.status());

  HeadsReport report;
  report.weights = prepared->weights;
  report.shape = AttentionShapeString(shape);
  report.backend = response->backend();
  report.batch = shape.batch;
  absl::StatusOr<std::vector<HeadSummary>> ranked =
      RankHeads(response->head_stats(), shape.batch, shape.heads.num_heads, shape.heads.num_kv_heads);
  if (!ranked.ok()) return Fail(ranked.status());
  report.ranked = *std::move(ranked);
  if (ablate > 0) {
    absl::StatusOr<Ablation> ablation = Ablate(client, request, report.ranked, ablate, response->output());
    if (!ablation.ok()) return Fail(ablation.status());
    report.ablation = *std::move(ablation);
  }
  const std::string text = *format == "json"  ? FormatHeadsJson(report)
                           : *format == "csv" ? FormatHeadsCsv(report)
                                              : FormatHeadsPretty(report);
  std::fwrite(text.data(), 1, text.size(), stdout);
  // The CSV table has no room for the ablation's numbers: they go to stderr.
  if (*format == "csv" && report.ablation.has_value()) {
    std::fputs(FormatAblationLine(*report.ablation).c_str(), stderr);
  }
  return kExitOk;
}

}  // namespace mha::cli
