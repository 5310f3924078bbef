#include "client/attention_client.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/extend_stepper.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"
#include "proto/mha/v1/tensor_wire.h"

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
    : options_(options),
      channel_(CreateAttentionChannel(options)),
      stub_(v1::Attention::NewStub(channel_)),
      generic_stub_(std::make_unique<grpc::GenericStub>(channel_)),
      extend_streams_(options.max_extend_streams > 0
                          ? std::make_unique<ExtendStreams>(this, options.max_extend_streams)
                          : nullptr) {}

AttentionClient::~AttentionClient() = default;  // the streams end first (members go in reverse)

namespace {

// One unary call through a stub method, with the client's deadline, and for a session call its id as metadata.
template <typename Request, typename Response>
absl::StatusOr<Response> Unary(
    v1::Attention::Stub* stub,
    grpc::Status (v1::Attention::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, absl::Duration timeout, const std::string& session_id = "") {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!session_id.empty()) context.AddMetadata("mha-session-id", session_id);
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

namespace {

constexpr char kMultiHeadAttentionMethod[] = "/mha.v1.Attention/MultiHeadAttention";
constexpr int kQueryField = 1, kKeyField = 2, kValueField = 3;     // MultiHeadAttentionRequest
constexpr int kOutputField = 1, kWeightsField = 2;                 // MultiHeadAttentionResponse

// `array` as Tensor field `field` in `dtype`: its values borrowed as they lie when the wire is fp32 (the caller keeps
// them alive through the call), else encoded once into a slice of their own.
TensorBytes WireTensor(int field, const Array& array, v1::DataType dtype) {
  TensorBytes tensor;
  tensor.field = field;
  for (int64_t d : array.shape) tensor.header.add_shape(d);
  tensor.header.set_dtype(dtype);
  const size_t count = array.values.size();
  if (dtype == v1::FP32) {
    tensor.data = BorrowedSlice(array.values.data(), count * sizeof(float));
  } else {
    char* bytes = nullptr;
    tensor.data = NewTensorSlice(count * DTypeSize(dtype), &bytes);
    EncodeFromFloat(dtype, array.values.data(), count, bytes);
  }
  return tensor;
}

// Checks that the server's fp32 tensor `header` fills `array`, whose values hold its data, and gives it its shape.
absl::Status TakeTensor(const v1::Tensor& header, const char* name, Array* array) {
  int64_t count = 1;
  for (int64_t d : header.shape()) count *= d;
  if (header.dtype() != v1::FP32 || static_cast<int64_t>(array->values.size()) != count) {
    return absl::InternalError(absl::StrCat("the server's ", name, " is ", DTypeName(header.dtype()), " ",
                                            ShapeString(header.shape()), " with ", array->values.size(),
                                            " fp32 values; expected fp32 filling its shape"));
  }
  array->shape.assign(header.shape().begin(), header.shape().end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MhaOutputs> AttentionClient::MultiHeadAttention(const MhaInputs& inputs) {
  if (inputs.query == nullptr) return absl::InvalidArgumentError("query is required");
  // The tensors travel outside the message (proto/mha/v1/tensor_wire.h): the arrays' bytes go to gRPC as they are,
  // and the response's come straight from gRPC's buffers into MhaOutputs.
  std::vector<TensorBytes> tensors;
  tensors.push_back(WireTensor(kQueryField, *inputs.query, inputs.wire_dtype));
  if (inputs.key != nullptr) tensors.push_back(WireTensor(kKeyField, *inputs.key, inputs.wire_dtype));
  if (inputs.value != nullptr) tensors.push_back(WireTensor(kValueField, *inputs.value, inputs.wire_dtype));
  v1::MultiHeadAttentionRequest rest;
  rest.set_layer(inputs.layer);
  if (inputs.causal) rest.mutable_heads()->set_causal(true);
  for (int32_t length : inputs.key_lengths) rest.add_key_lengths(length);
  for (float factor : inputs.head_mask) rest.add_head_mask(factor);
  rest.set_return_attention_weights(inputs.return_attention_weights);
  // Outputs in fp32 whatever the wire dtype of the inputs, so MhaOutputs holds exactly what the server computed.
  rest.set_output_dtype(v1::FP32);
  rest.set_backend(inputs.backend);
  std::vector<const TensorBytes*> tensor_list;
  for (const TensorBytes& tensor : tensors) tensor_list.push_back(&tensor);
  grpc::ByteBuffer request, response;
  if (absl::Status status = EncodeWithTensors(tensor_list, rest, &request); !status.ok()) return status;

  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  absl::Notification done;
  grpc::Status status;
  generic_stub_->UnaryCall(&context, kMultiHeadAttentionMethod, grpc::StubOptions(), &request, &response,
                           [&](grpc::Status result) {
                             status = std::move(result);
                             done.Notify();
                           });
  done.WaitForNotification();
  if (!status.ok()) return FromGrpcStatus(status);

  MhaOutputs outputs;
  v1::MultiHeadAttentionResponse message;
  const int tensor_fields[] = {kOutputField, kWeightsField};
  CopyingSink sink([&outputs](int field, size_t bytes) -> char* {
    if (bytes % sizeof(float) != 0) return nullptr;
    std::vector<float>& values = field == kOutputField ? outputs.output.values : outputs.attention_weights.values;
    values.resize(bytes / sizeof(float));
    return reinterpret_cast<char*>(values.data());
  });
  const absl::Status decoded = DecodeWithTensors(response, tensor_fields, &sink, &message);
  if (!decoded.ok()) return absl::InternalError(absl::StrCat("cannot decode the response: ", decoded.message()));
  if (absl::Status taken = TakeTensor(message.output(), "output", &outputs.output); !taken.ok()) return taken;
  if (message.has_attention_weights()) {
    absl::Status taken = TakeTensor(message.attention_weights(), "attention_weights", &outputs.attention_weights);
    if (!taken.ok()) return taken;
  }
  outputs.backend = message.backend();
  outputs.timing = message.timing();
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

absl::Status AttentionClient::RegisterSharedMemory(const std::string& name, const std::string& key,
                                                   uint64_t byte_size) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(byte_size);
  return Unary(stub_.get(), &v1::Attention::Stub::RegisterSharedMemory, request, options_.timeout).status();
}

absl::Status AttentionClient::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  return Unary(stub_.get(), &v1::Attention::Stub::UnregisterSharedMemory, request, options_.timeout).status();
}

absl::StatusOr<v1::GetSharedMemoryStatusResponse> AttentionClient::GetSharedMemoryStatus(const std::string& name) {
  v1::GetSharedMemoryStatusRequest request;
  request.set_name(name);
  return Unary(stub_.get(), &v1::Attention::Stub::GetSharedMemoryStatus, request, options_.timeout);
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

absl::StatusOr<v1::CreateSessionResponse> AttentionClient::CreateSession(const v1::CreateSessionRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::CreateSession, request, options_.timeout, request.session_id());
}

absl::StatusOr<v1::ExtendResponse> AttentionClient::Extend(const v1::ExtendRequest& request) {
  if (extend_streams_ != nullptr) return extend_streams_->Extend(request);
  return ExtendUnary(request);
}

bool AttentionClient::streams_extends() const { return extend_streams_ != nullptr && extend_streams_->streaming(); }

absl::StatusOr<v1::ExtendResponse> AttentionClient::ExtendUnary(const v1::ExtendRequest& request) {
  const std::string id = request.items_size() > 0 ? request.items(0).session_id() : "";
  return Unary(stub_.get(), &v1::Attention::Stub::Extend, request, options_.timeout, id);
}

absl::StatusOr<v1::ForkSessionResponse> AttentionClient::ForkSession(const v1::ForkSessionRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::ForkSession, request, options_.timeout, request.session_id());
}

absl::StatusOr<v1::TruncateSessionResponse> AttentionClient::TruncateSession(
    const v1::TruncateSessionRequest& request) {
  return Unary(stub_.get(), &v1::Attention::Stub::TruncateSession, request, options_.timeout, request.session_id());
}

absl::Status AttentionClient::CloseSession(const std::string& session_id) {
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  return Unary(stub_.get(), &v1::Attention::Stub::CloseSession, request, options_.timeout, session_id).status();
}

absl::StatusOr<v1::ListSessionsResponse> AttentionClient::ListSessions() {
  return Unary(stub_.get(), &v1::Attention::Stub::ListSessions, v1::ListSessionsRequest(), options_.timeout);
}

}  // namespace mha
