// mha_client plot: one MultiHeadAttention call with return_attention_weights and return_head_stats, drawn as an SVG
// grid of heatmaps, one per head ("head i / KV group g") annotated with its entropy, distance and contribution, with
// token indices or --tokens labels on the axes.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli.h"
#include "client/cli_request.h"
#include "client/npy.h"
#include "client/svg_plot.h"
#include "proto/mha/v1/tensor_codec.h"

ABSL_FLAG(std::string, tokens, "",
          "plot: comma-separated labels of the query tokens (and of the keys in self-attention); sets --seq for a "
          "random query");
ABSL_FLAG(std::string, key_tokens, "", "plot: comma-separated labels of the key tokens (cross-attention)");
ABSL_FLAG(int64_t, plot_batch, 0, "plot: which batch item to draw");
ABSL_FLAG(int64_t, columns, 0, "plot: panels per row; 0 = about square");

namespace mha::cli {
namespace {

std::vector<std::string> Labels(const std::string& text) {
  if (text.empty()) return {};
  return absl::StrSplit(text, ',');
}

absl::Status Usage(absl::string_view message) { return absl::InvalidArgumentError(message); }

// Item `item`'s entropy, distance and contribution per head from the B x H values of `stats`; empty (no annotation)
// if the server sent another count.
std::vector<PanelStats> ItemStats(const v1::HeadStats& stats, int64_t item, int64_t batch, int64_t num_heads) {
  const int64_t n = batch * num_heads;
  if (stats.entropy_size() != n || stats.distance_size() != n || stats.contribution_size() != n) return {};
  std::vector<PanelStats> heads(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t at = item * num_heads + h;
    heads[h] = {stats.entropy(at), stats.distance(at), stats.contribution(at)};
  }
  return heads;
}

// The call, with head statistics; a backend without them (CUDA answers UNIMPLEMENTED) gets the call without.
absl::StatusOr<v1::MultiHeadAttentionResponse> CallWithStats(AttentionClient& client,
                                                             v1::MultiHeadAttentionRequest& request) {
  request.set_return_head_stats(true);
  absl::StatusOr<v1::MultiHeadAttentionResponse> response = client.MultiHeadAttention(request);
  if (response.ok() || response.status().code() != absl::StatusCode::kUnimplemented) return response;
  std::fprintf(stderr, "no head statistics (%s); plotting without them\n",
               std::string(response.status().message()).c_str());
  request.set_return_head_stats(false);
  return client.MultiHeadAttention(request);
}

}  // namespace

int RunPlot(const ClientOptions& options) {
  absl::StatusOr<RequestFlags> flags = RequestFlagsFromCommandLine();
  if (!flags.ok()) return UsageError(flags.status());
  flags->return_weights = true;
  const std::string svg_path = absl::GetFlag(FLAGS_output);
  if (svg_path.empty()) return UsageError(Usage("plot needs --output FILE.svg"));
  const std::vector<std::string> query_labels = Labels(absl::GetFlag(FLAGS_tokens));
  std::vector<std::string> key_labels = Labels(absl::GetFlag(FLAGS_key_tokens));
  const int64_t plot_batch = absl::GetFlag(FLAGS_plot_batch);
  const int64_t columns = absl::GetFlag(FLAGS_columns);
  if (plot_batch < 0) return UsageError(Usage(absl::StrCat("--plot_batch must be >= 0; got ", plot_batch)));
  if (columns < 0) return UsageError(Usage(absl::StrCat("--columns must be >= 0; got ", columns)));
  if (!query_labels.empty() && flags->query_path.empty()) {
    const int64_t n = static_cast<int64_t>(query_labels.size());
    if (flags->seq != 0 && flags->seq != n) {
      return UsageError(Usage(absl::StrCat("--tokens has ", n, " labels but --seq is ", flags->seq)));
    }
    flags->seq = n;
  }
  if (!key_labels.empty() && flags->key_path.empty() && flags->kv_seq == 0) {
    flags->kv_seq = static_cast<int64_t>(key_labels.size());
  }

  AttentionClient client(options);
  absl::StatusOr<PreparedRequest> prepared = PrepareRequest(*flags, client);
  if (!prepared.ok()) return Fail(prepared.status());
  const AttentionShape& shape = prepared->shape;
  const bool self_attention = !prepared->request.has_key();
  if (key_labels.empty() && self_attention) key_labels = query_labels;
  if (!query_labels.empty() && static_cast<int64_t>(query_labels.size()) != shape.q_len) {
    return UsageError(Usage(absl::StrCat("--tokens has ", query_labels.size(), " labels for ", shape.q_len,
                                         " query tokens")));
  }
  if (!key_labels.empty() && static_cast<int64_t>(key_labels.size()) != shape.kv_len) {
    return UsageError(Usage(absl::StrCat(self_attention ? "--tokens" : "--key_tokens", " has ", key_labels.size(),
                                         " labels for ", shape.kv_len, " key tokens")));
  }
  if (plot_batch >= shape.batch) {
    return UsageError(Usage(absl::StrCat("--plot_batch ", plot_batch, " is not below B = ", shape.batch)));
  }

  absl::StatusOr<v1::MultiHeadAttentionResponse> response = CallWithStats(client, prepared->request);
  if (!response.ok()) return Fail(response.status());
  const v1::Tensor& weights = response->attention_weights();
  if (weights.shape_size() != 4 || weights.shape(0) != shape.batch) {
    return Fail(absl::InternalError(absl::StrCat("the server returned attention weights of shape ",
                                                 ShapeString(weights.shape()), "; expected [B, H, Tq, Tk]")));
  }
  const std::vector<float> all = TensorToFloats(weights);
  HeadsPlot plot;
  plot.num_heads = weights.shape(1);
  plot.num_kv_heads = shape.heads.num_kv_heads;
  plot.query_len = weights.shape(2);
  plot.key_len = weights.shape(3);
  const int64_t per_item = plot.num_heads * plot.query_len * plot.key_len;
  plot.weights.assign(all.begin() + plot_batch * per_item, all.begin() + (plot_batch + 1) * per_item);
  plot.query_labels = query_labels;
  plot.key_labels = key_labels;
  plot.columns = columns;
  plot.head_stats = ItemStats(response->head_stats(), plot_batch, weights.shape(0), plot.num_heads);
  plot.title = absl::StrCat("Attention weights, ", prepared->weights, ", batch item ", plot_batch, " (",
                            AttentionShapeString(shape), ")");
  absl::StatusOr<std::string> svg = RenderHeadsSvg(plot);
  if (!svg.ok()) return Fail(svg.status());
  std::ofstream file(svg_path, std::ios::binary | std::ios::trunc);
  file << *svg;
  file.close();
  if (!file) return Fail(absl::InternalError(absl::StrCat("cannot write ", svg_path)));
  const std::string groups = plot.num_kv_heads < plot.num_heads
                                 ? absl::StrCat(" in ", plot.num_kv_heads, " KV groups")
                                 : std::string();
  std::printf("wrote %s: %lld heads%s, Tq %lld x Tk %lld, batch item %lld, backend %s\n", svg_path.c_str(),
              static_cast<long long>(plot.num_heads), groups.c_str(), static_cast<long long>(plot.query_len),
              static_cast<long long>(plot.key_len), static_cast<long long>(plot_batch), response->backend().c_str());

  const std::string weights_path = absl::GetFlag(FLAGS_weights_output);
  if (!weights_path.empty()) {
    if (absl::Status s = WriteNpy(weights_path, NpyFromTensor(weights)); !s.ok()) return Fail(s);
    std::printf("wrote attention_weights %s to %s\n", ShapeString(weights.shape()).c_str(), weights_path.c_str());
  }
  return kExitOk;
}

}  // namespace mha::cli
