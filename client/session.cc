#include "client/session.h"

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

void ToTensor(const Array& array, v1::DataType dtype, v1::Tensor* tensor) {
  FloatsToTensor(array.values, array.shape, dtype, tensor);
}

Array FromTensor(const v1::Tensor& tensor) {
  return {std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()), TensorToFloats(tensor)};
}

}  // namespace

absl::StatusOr<Session> Session::Create(AttentionClient* client, const v1::CreateSessionRequest& request) {
  absl::StatusOr<v1::CreateSessionResponse> response = client->CreateSession(request);
  if (!response.ok()) return response.status();
  return Session(client, response->session());
}

absl::StatusOr<Session> Session::CreateRecovering(AttentionClient* client, const v1::CreateSessionRequest& request,
                                                  const RecoveryOptions& recovery) {
  if (request.prefix_keys_size() > 0) {
    return absl::InvalidArgumentError(
        "prefix_keys: a recording session keeps what this client sends, and tokens attached from the prefix cache are "
        "never sent, so it could not be rebuilt; record or attach, not both");
  }
  absl::StatusOr<Session> session = Create(client, request);
  if (!session.ok()) return session;
  v1::CreateSessionRequest named = request;
  named.set_session_id(session->id());
  session->record_.emplace(std::move(named), recovery.max_record_bytes);
  session->recovery_ = recovery;
  return session;
}

absl::Status Session::Call(const std::function<absl::Status()>& call) {
  if (!record_.has_value()) return call();
  const SessionRecord* record = &*record_;
  return CallRecovering(*client_, call, absl::MakeConstSpan(&record, 1), recovery_, &recoveries_);
}

absl::StatusOr<ExtendOutputs> Session::Run(int layer_index, v1::ExtendItem item, const ExtendOptions& options) {
  item.set_session_id(id());
  if (options.expected_length.has_value()) {
    item.set_expected_length(*options.expected_length);
  } else if (options.check_length && layer_index >= 0 && layer_index < info_.lengths_size()) {
    item.set_expected_length(info_.lengths(layer_index));
  }
  v1::ExtendRequest request;
  request.set_layer_index(layer_index);
  *request.add_items() = std::move(item);
  request.set_return_attention_weights(options.return_attention_weights);
  request.set_output_dtype(v1::FP32);
  request.set_backend(options.backend);
  absl::StatusOr<v1::ExtendResponse> response;
  if (absl::Status status = Call([&] { return (response = client_->Extend(request)).status(); }); !status.ok()) {
    return status;
  }
  if (record_.has_value()) record_->Append(layer_index, request.items(0), request.backend());
  if (response->results_size() != 1) {
    return absl::InternalError(absl::StrCat("the server returned ", response->results_size(), " results for 1 item"));
  }
  const v1::ExtendResult& result = response->results(0);
  ExtendOutputs outputs;
  outputs.output = FromTensor(result.output());
  if (result.has_attention_weights()) outputs.attention_weights = FromTensor(result.attention_weights());
  outputs.length = result.length();
  outputs.backend = response->backend();
  if (layer_index >= 0 && layer_index < info_.lengths_size()) info_.set_lengths(layer_index, result.length());
  return outputs;
}

absl::StatusOr<ExtendOutputs> Session::Extend(int layer_index, const Array& x, const ExtendOptions& options) {
  v1::ExtendItem item;
  ToTensor(x, options.wire_dtype, item.mutable_x());
  return Run(layer_index, std::move(item), options);
}

absl::StatusOr<ExtendOutputs> Session::Extend(int layer_index, const Array& q, const Array& k, const Array& v,
                                              const ExtendOptions& options) {
  v1::ExtendItem item;
  ToTensor(q, options.wire_dtype, item.mutable_q());
  ToTensor(k, options.wire_dtype, item.mutable_k());
  ToTensor(v, options.wire_dtype, item.mutable_v());
  return Run(layer_index, std::move(item), options);
}

absl::StatusOr<Session> Session::Fork(const std::string& new_id) {
  v1::ForkSessionRequest request;
  request.set_session_id(id());
  request.set_new_session_id(new_id);
  absl::StatusOr<v1::ForkSessionResponse> response;
  if (absl::Status status = Call([&] { return (response = client_->ForkSession(request)).status(); });
      !status.ok()) {
    return status;
  }
  Session fork(client_, response->session());
  if (record_.has_value()) {
    fork.record_ = record_->Fork(fork.id());
    fork.recovery_ = recovery_;
  }
  return fork;
}

absl::Status Session::Truncate(int64_t length) {
  v1::TruncateSessionRequest request;
  request.set_session_id(id());
  request.set_length(length);
  absl::StatusOr<v1::TruncateSessionResponse> response;
  if (absl::Status status = Call([&] { return (response = client_->TruncateSession(request)).status(); });
      !status.ok()) {
    return status;
  }
  if (record_.has_value()) record_->Truncate(length);
  info_ = response->session();
  return absl::OkStatus();
}

absl::Status Session::Close() { return client_->CloseSession(id()); }

}  // namespace mha
