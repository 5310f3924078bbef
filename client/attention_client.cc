#include "client/attention_client.h"

#include "absl/time/clock.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

// Adds "authorization: <value>" to the metadata of every call on the channel.
class AuthorizationInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit AuthorizationInterceptor(const std::string& value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", value_});
    }
    methods->Proceed();
  }

 private:
  const std::string& value_;  // the factory's, which the channel keeps
};

class AuthorizationFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthorizationFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new AuthorizationInterceptor(value_);
  }

 private:
  const std::string value_;
};

}  // namespace

std::shared_ptr<grpc::Channel> CreateAttentionChannel(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_mb << 20);
  args.SetMaxSendMessageSize(options.max_message_mb << 20);
  if (!options.lb_policy.empty()) args.SetLoadBalancingPolicyName(options.lb_policy);
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_roots_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  if (options.token.empty()) return grpc::CreateCustomChannel(options.target, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<AuthorizationFactory>("Bearer " + options.token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(options.target, credentials, args,
                                                                  std::move(interceptors));
}

AttentionClient::AttentionClient(const ClientOptions& options)
    : options_(options), channel_(CreateAttentionChannel(options)), stub_(v1::Attention::NewStub(channel_)) {}

namespace {

// One unary call through a stub method, with the client's deadline.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(
    v1::Attention::Stub* stub,
    grpc::Status (v1::Attention::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Response response;
  const grpc::Status status = (stub->*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace

absl::StatusOr<v1::MultiHeadAttentionResponse> AttentionClient::MultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::MultiHeadAttention, request, options_.timeout);
}

absl::StatusOr<MhaOutputs> AttentionClient::MultiHeadAttention(const MhaInputs& inputs) {
  if (inputs.query == nullptr) return absl::InvalidArgumentError("query is required");
  v1::MultiHeadAttentionRequest request;
  // Outputs in fp32 whatever the wire dtype of the inputs, so MhaOutputs holds exactly what the server computed.
  FloatsToTensor(inputs.query->values, inputs.query->shape, inputs.wire_dtype, request.mutable_query());
  if (inputs.key != nullptr) {
    FloatsToTensor(inputs.key->values, inputs.key->shape, inputs.wire_dtype, request.mutable_key());
  }
  if (inputs.value != nullptr) {
    FloatsToTensor(inputs.value->values, inputs.value->shape, inputs.wire_dtype, request.mutable_value());
  }
  request.set_layer(inputs.layer);
  if (inputs.causal) request.mutable_heads()->set_causal(true);
  for (int32_t length : inputs.key_lengths) request.add_key_lengths(length);
  for (float factor : inputs.head_mask) request.add_head_mask(factor);
  request.set_return_attention_weights(inputs.return_attention_weights);
  request.set_output_dtype(v1::FP32);
  request.set_backend(inputs.backend);
  absl::StatusOr<v1::MultiHeadAttentionResponse> response = MultiHeadAttention(request);
  if (!response.ok()) return response.status();
  MhaOutputs outputs;
  outputs.output.shape.assign(response->output().shape().begin(), response->output().shape().end());
  outputs.output.values = TensorToFloats(response->output());
  if (response->has_attention_weights()) {
    const v1::Tensor& weights = response->attention_weights();
    outputs.attention_weights.shape.assign(weights.shape().begin(), weights.shape().end());
    outputs.attention_weights.values = TensorToFloats(weights);
  }
  outputs.backend = response->backend();
  outputs.timing = response->timing();
  return outputs;
}

absl::StatusOr<v1::ScaledDotProductAttentionResponse> AttentionClient::ScaledDotProductAttention(
    const v1::ScaledDotProductAttentionRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::ScaledDotProductAttention, request, options_.timeout);
}

absl::StatusOr<v1::LoadLayerResponse> AttentionClient::LoadLayer(const v1::LoadLayerRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::LoadLayer, request, options_.timeout);
}

absl::Status AttentionClient::UnloadLayer(const std::string& name) {
  v1::UnloadLayerRequest request;
  request.set_name(name);
  return Unary(stub_.get(), &v1::Attention::Stub::UnloadLayer, request, options_.timeout).status();
}

absl::StatusOr<v1::ListLayersResponse> AttentionClient::ListLayers() {
  return Unary(stub_.get(), &v1::Attention::Stub::ListLayers, v1::ListLayersRequest(), options_.timeout);
}

absl::StatusOr<v1::GetServerInfoResponse> AttentionClient::GetServerInfo() {
  return Unary(stub_.get(), &v1::Attention::Stub::GetServerInfo, v1::GetServerInfoRequest(), options_.timeout);
}

absl::StatusOr<bool> AttentionClient::Serving() {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace mha
