#include "client/session_recovery.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

// Rows [begin, end) of a tensor laid out [rows, ...] with its bytes inline.
v1::Tensor Rows(const v1::Tensor& tensor, int64_t begin, int64_t end) {
  const int64_t row_bytes = static_cast<int64_t>(tensor.data().size()) / tensor.shape(0);
  v1::Tensor rows;
  rows.set_dtype(tensor.dtype());
  *rows.mutable_shape() = tensor.shape();
  rows.set_shape(0, end - begin);
  rows.set_data(tensor.data().substr(begin * row_bytes, (end - begin) * row_bytes));
  return rows;
}

// Whether b's rows may follow a's in one tensor: the same dtype and the same shape past the rows.
bool SameRows(const v1::Tensor& a, const v1::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape_size() == b.shape_size() &&
         std::equal(a.shape().begin() + 1, a.shape().end(), b.shape().begin() + 1);
}

// A tensor the record can keep: its bytes inline, laid out [rows >= 1, ...].
bool Keepable(const v1::Tensor& tensor) {
  return !tensor.has_shared_memory() && tensor.shape_size() >= 1 && tensor.shape(0) >= 1 &&
         tensor.data().size() % tensor.shape(0) == 0;
}

}  // namespace

SessionRecord::SessionRecord(v1::CreateSessionRequest create, int64_t max_bytes)
    : create_(std::move(create)), max_bytes_(max_bytes) {}

int64_t SessionRecord::length(int layer_index) const {
  if (layer_index < 0 || layer_index >= static_cast<int>(caches_.size())) return 0;
  int64_t tokens = 0;
  for (const Segment& segment : caches_[layer_index]) tokens += segment.tokens;
  return tokens;
}

void SessionRecord::Drop() {
  recoverable_ = false;
  caches_.clear();
  bytes_ = 0;
}

void SessionRecord::Append(int layer_index, const v1::ExtendItem& item, v1::Backend backend) {
  if (!recoverable_ || (item.has_append() && !item.append()) || layer_index < 0) return;
  std::vector<const v1::Tensor*> tensors;
  if (create_.layers_size() > 0) {
    tensors = {&item.x()};
  } else {
    tensors = {&item.k(), &item.v()};
  }
  int64_t added = 0;
  for (const v1::Tensor* tensor : tensors) {
    if (!Keepable(*tensor) || tensor->shape(0) != tensors.front()->shape(0)) return Drop();
    added += static_cast<int64_t>(tensor->data().size());
  }
  if (added > max_bytes_ - bytes_) return Drop();
  bytes_ += added;
  if (layer_index >= static_cast<int>(caches_.size())) caches_.resize(layer_index + 1);
  std::vector<Segment>& cache = caches_[layer_index];
  // A layer session's calls stay apart: its keys and values are the projections of x, recomputed on replay, and a
  // projection's rounding may depend on how many rows it had (the CPU backend's one-row path differs by an ulp).
  const bool extends_last =
      create_.layers_size() == 0 && !cache.empty() && cache.back().backend == backend &&
      std::equal(tensors.begin(), tensors.end(), cache.back().tensors.begin(),
                 [](const v1::Tensor* t, const v1::Tensor& kept) { return SameRows(kept, *t); });
  if (!extends_last) {
    Segment segment;
    segment.backend = backend;
    for (const v1::Tensor* tensor : tensors) segment.tensors.push_back(Rows(*tensor, 0, 0));
    cache.push_back(std::move(segment));
  }
  Segment& last = cache.back();
  const int64_t n = tensors.front()->shape(0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    last.tensors[i].set_shape(0, last.tensors[i].shape(0) + n);
    last.tensors[i].mutable_data()->append(tensors[i]->data());
  }
  last.tokens += n;
}

void SessionRecord::Truncate(int64_t length) {
  for (std::vector<Segment>& cache : caches_) {
    int64_t kept = 0;
    size_t i = 0;
    for (; i < cache.size() && kept < length; ++i) {
      Segment& segment = cache[i];
      const int64_t keep = std::min(segment.tokens, length - kept);
      if (keep < segment.tokens) {
        for (v1::Tensor& tensor : segment.tensors) {
          bytes_ -= static_cast<int64_t>(tensor.data().size());
          tensor = Rows(tensor, 0, keep);
          bytes_ += static_cast<int64_t>(tensor.data().size());
        }
        segment.tokens = keep;
      }
      kept += keep;
    }
    for (size_t j = i; j < cache.size(); ++j) {
      for (const v1::Tensor& tensor : cache[j].tensors) bytes_ -= static_cast<int64_t>(tensor.data().size());
    }
    cache.resize(i);
  }
}

SessionRecord SessionRecord::Fork(const std::string& new_id) const {
  SessionRecord fork = *this;
  fork.create_.set_session_id(new_id);
  return fork;
}

std::vector<v1::ExtendRequest> SessionRecord::ReplayRequests(int64_t chunk_tokens) const {
  chunk_tokens = std::max<int64_t>(chunk_tokens, 1);
  std::vector<v1::ExtendRequest> requests;
  for (size_t layer = 0; layer < caches_.size(); ++layer) {
    int64_t position = 0;
    for (const Segment& segment : caches_[layer]) {
      for (int64_t begin = 0, end = 0; begin < segment.tokens; begin = end) {
        end = std::min(segment.tokens, begin + chunk_tokens);
        if (segment.tokens - end == 1) end = segment.tokens;  // no one-row tail where the call had more rows
        v1::ExtendRequest request;
        request.set_layer_index(static_cast<int32_t>(layer));
        request.set_backend(segment.backend);
        request.set_output_dtype(v1::BF16);  // the outputs are dropped: half the bytes back
        v1::ExtendItem* item = request.add_items();
        item->set_session_id(id());
        item->set_expected_length(position + begin);
        item->set_append(true);
        if (create_.layers_size() > 0) {
          *item->mutable_x() = Rows(segment.tensors[0], begin, end);
        } else {
          *item->mutable_k() = Rows(segment.tensors[0], begin, end);
          *item->mutable_v() = Rows(segment.tensors[1], begin, end);
          // q [n, H, d_k] of zeros (all-zero bytes in every dtype): a head session's call needs one.
          v1::Tensor* q = item->mutable_q();
          q->set_dtype(item->k().dtype());
          q->add_shape(end - begin);
          q->add_shape(create_.heads().num_heads());
          q->add_shape(item->k().shape(2));
          q->set_data(std::string((end - begin) * create_.heads().num_heads() * item->k().shape(2) *
                                      DTypeSize(item->k().dtype()),
                                  '\0'));
        }
        requests.push_back(std::move(request));
      }
      position += segment.tokens;
    }
  }
  return requests;
}

bool IsSessionLost(const absl::Status& status) {
  return status.code() == absl::StatusCode::kNotFound || status.code() == absl::StatusCode::kUnavailable;
}

absl::Status RebuildSessions(AttentionClient& client, absl::Span<const SessionRecord* const> records,
                             const absl::Status& failure, int64_t chunk_tokens, int64_t* rebuilt) {
  for (const SessionRecord* record : records) {
    absl::StatusOr<v1::CreateSessionResponse> created = client.CreateSession(record->create());
    if (created.status().code() == absl::StatusCode::kAlreadyExists) {
      if (failure.code() == absl::StatusCode::kNotFound) continue;  // untouched by the failed call
      if (absl::Status closed = client.CloseSession(record->id());
          !closed.ok() && closed.code() != absl::StatusCode::kNotFound) {
        return closed;
      }
      created = client.CreateSession(record->create());
    }
    if (!created.ok()) return created.status();
    for (const v1::ExtendRequest& request : record->ReplayRequests(chunk_tokens)) {
      if (absl::StatusOr<v1::ExtendResponse> replayed = client.Extend(request); !replayed.ok()) {
        // Not left half rebuilt: a later call finds it gone (NOT_FOUND) and rebuilds it whole.
        client.CloseSession(record->id()).IgnoreError();
        return absl::Status(replayed.status().code(), absl::StrCat("replaying session ", record->id(), ": ",
                                                                    replayed.status().message()));
      }
    }
    ++*rebuilt;
  }
  return absl::OkStatus();
}

absl::Status CallRecovering(AttentionClient& client, const std::function<absl::Status()>& call,
                            absl::Span<const SessionRecord* const> records, const RecoveryOptions& options,
                            int64_t* recoveries) {
  absl::Status status = call();
  const bool recoverable = std::all_of(records.begin(), records.end(),
                                       [](const SessionRecord* record) { return record->recoverable(); });
  absl::Duration backoff = options.backoff;
  for (int attempt = 0; attempt < options.max_attempts && recoverable && IsSessionLost(status); ++attempt) {
    const absl::Status failure = status;
    if (failure.code() == absl::StatusCode::kUnavailable) {
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options.max_backoff);
      client.channel()->WaitForConnected(absl::ToChronoTime(absl::Now() + options.reconnect_timeout));
    }
    int64_t rebuilt = 0;
    status = RebuildSessions(client, records, failure, options.replay_chunk_tokens, &rebuilt);
    *recoveries += rebuilt;
    if (status.ok()) status = call();
  }
  return status;
}

absl::StatusOr<v1::ExtendResponse> ExtendRecovering(AttentionClient& client, const v1::ExtendRequest& request,
                                                    absl::Span<SessionRecord* const> records,
                                                    const RecoveryOptions& options, int64_t* recoveries,
                                                    bool unary) {
  if (static_cast<int>(records.size()) != request.items_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExtendRecovering needs one record per item; got ", records.size(), " for ",
                     request.items_size()));
  }
  absl::StatusOr<v1::ExtendResponse> response;
  const std::vector<const SessionRecord*> kept(records.begin(), records.end());
  const absl::Status status = CallRecovering(
      client, [&] { return (response = unary ? client.ExtendUnary(request) : client.Extend(request)).status(); },
      kept, options, recoveries);
  if (!status.ok()) return status;
  for (int i = 0; i < request.items_size(); ++i) {
    records[i]->Append(request.layer_index(), request.items(i), request.backend());
  }
  return response;
}

}  // namespace mha
