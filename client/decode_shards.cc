#include "client/decode_shards.h"

#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/merge_attention.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

Array FromTensor(const v1::Tensor& tensor) {
  return {std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()), TensorToFloats(tensor)};
}

// Item j of every shard's response merged: outputs [n, H, d_k] and lses [H, n].
absl::StatusOr<ShardedResult> MergeItem(const std::vector<v1::ExtendResponse>& responses, int j) {
  std::vector<Array> outputs, lses;
  ShardedResult result;
  for (size_t s = 0; s < responses.size(); ++s) {
    if (j >= responses[s].results_size() || !responses[s].results(j).has_lse()) {
      return absl::InternalError(absl::StrCat("shard ", s, "'s response has no output and lse for item ", j));
    }
    const v1::ExtendResult& item = responses[s].results(j);
    outputs.push_back(FromTensor(item.output()));
    lses.push_back(FromTensor(item.lse()));
    result.lengths.push_back(item.length());
  }
  absl::StatusOr<MergedAttention> merged = MergeAttention(outputs, lses);
  if (!merged.ok()) return absl::InternalError(absl::StrCat("item ", j, ": ", merged.status().message()));
  result.output = std::move(merged->output);
  return result;
}

}  // namespace

int64_t ShardBegin(int64_t context, int shards, int shard) { return context * shard / shards; }

absl::StatusOr<std::vector<ShardedResult>> ExtendShards(absl::Span<AttentionClient* const> clients,
                                                        absl::Span<const v1::ExtendRequest> requests) {
  if (clients.size() != requests.size() || requests.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExtendShards needs one client per request; got ", clients.size(), " and ", requests.size()));
  }
  std::vector<std::optional<absl::StatusOr<v1::ExtendResponse>>> answers(requests.size());
  std::vector<std::thread> senders;
  for (size_t s = 0; s + 1 < requests.size(); ++s) {
    senders.emplace_back([&, s] { answers[s] = clients[s]->Extend(requests[s]); });
  }
  answers.back() = clients.back()->Extend(requests.back());
  for (std::thread& sender : senders) sender.join();
  std::vector<v1::ExtendResponse> responses;
  for (size_t s = 0; s < answers.size(); ++s) {
    absl::StatusOr<v1::ExtendResponse>& answer = *answers[s];
    if (!answer.ok()) {
      return absl::Status(answer.status().code(), absl::StrCat("shard ", s, ": ", answer.status().message()));
    }
    responses.push_back(*std::move(answer));
  }
  std::vector<ShardedResult> results;
  for (int j = 0; j < requests.front().items_size(); ++j) {
    absl::StatusOr<ShardedResult> merged = MergeItem(responses, j);
    if (!merged.ok()) return merged.status();
    results.push_back(*std::move(merged));
  }
  return results;
}

}  // namespace mha
