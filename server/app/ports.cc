#include "server/app/ports.h"

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/resource_quota.h"

namespace mha {
namespace {

// The health-only port's bounds: streams one connection may hold open, and gRPC's memory on the port.
constexpr int kHealthStreamsPerConnection = 16;
constexpr size_t kHealthMemoryBytes = size_t{64} << 20;

// Leaves gRPC's server reflection (registered for every builder by InitProtoReflectionServerBuilderPlugin) out of
// one server: the health-only port serves health alone, and where tokens are required reflection is not served,
// since gRPC 1.51 offers no hook that checks a token before the reflection service answers.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return dynamic_cast<grpc::reflection::ProtoServerReflectionPlugin*>(
                                               plugin.get()) != nullptr;
                                  }),
                   plugins->end());
  }
};

// Every method it is asked for: UNIMPLEMENTED. The health-only port registers it beside the health service, which
// gRPC does not count as a polled service of its own.
class UnimplementedService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const std::string& method) {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, method + " is not served on the health-only port"));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal(context->method());
  }
};

}  // namespace

bool IsLoopback(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const size_t colon = listen.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? listen : listen.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

void ConfigureMainPort(const ServerOptions& options, bool tokens_required, grpc::ServerBuilder* builder) {
  const int max_bytes = options.max_message_mb << 20;
  builder->SetMaxReceiveMessageSize(max_bytes);
  builder->SetMaxSendMessageSize(max_bytes);
  if (options.keepalive_s > 0) {
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_s * 1000));
    builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  }
  if (options.max_connection_age_s > 0) {
    // Connections close gracefully (GOAWAY, then in-flight calls get this long) so that clients reconnect and
    // spread over the replicas that exist now (gRFC A9).
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(options.max_connection_age_s * 1000));
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                static_cast<int>(std::max(options.shutdown_grace_s, 1.0) * 1000));
  }
  if (options.max_streams_per_connection > 0) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  }
  if (options.grpc_memory_mb > 0) {
    grpc::ResourceQuota quota("mha_server");
    quota.Resize(static_cast<size_t>(options.grpc_memory_mb) << 20);
    builder->SetResourceQuota(quota);
  }
  // A port another process holds is an error, not a port to share (gRPC's default is SO_REUSEPORT).
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (tokens_required) builder->SetOption(std::make_unique<WithoutReflection>());
  if (!options.accept_compressed) {
    // gRPC checks a message's algorithm against these before inflating it, and fails the call (UNIMPLEMENTED).
    builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
    builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  }
}

absl::StatusOr<std::unique_ptr<HealthOnlyPort>> HealthOnlyPort::Start(const std::string& address) {
  std::unique_ptr<HealthOnlyPort> health(new HealthOnlyPort());
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Probes need a stream or two; the port is plaintext and asks no token, so what one peer may hold open (Watch
  // streams) is bounded per connection, and gRPC's memory on this port as a whole.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kHealthStreamsPerConnection);
  grpc::ResourceQuota quota("mha_health");
  quota.Resize(kHealthMemoryBytes);
  builder.SetResourceQuota(quota);
  builder.SetOption(std::make_unique<WithoutReflection>());
  health->unimplemented_ = std::make_unique<UnimplementedService>();
  builder.RegisterCallbackGenericService(health->unimplemented_.get());
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &health->port_);
  health->server_ = builder.BuildAndStart();
  if (health->server_ == nullptr || health->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen: cannot listen on ", address));
  }
  return health;
}

}  // namespace mha
