// The server's gRPC ports: the main port's arguments and options, and the port that serves health alone.
#ifndef MHA_SERVER_APP_PORTS_H_
#define MHA_SERVER_APP_PORTS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_builder.h"
#include "server/config/server_options.h"

namespace mha {

// Whether a gRPC listen address (host:port, [v6]:port, unix:path) is reachable from this machine only.
bool IsLoopback(absl::string_view listen);

// The main port's channel arguments and options: message sizes, keepalive, connection age, calls per connection,
// gRPC's memory quota, no port sharing, no reflection where tokens are required, no compressed requests unless
// accepted.
void ConfigureMainPort(const ServerOptions& options, bool tokens_required, grpc::ServerBuilder* builder);

// Health alone on `address` (--health_listen), plaintext and without reflection; every other method there is
// UNIMPLEMENTED. Sets *port to the bound port; UNAVAILABLE naming the flag when it cannot listen.
class HealthOnlyPort {
 public:
  static absl::StatusOr<std::unique_ptr<HealthOnlyPort>> Start(const std::string& address);
  grpc::Server* server() const { return server_.get(); }
  int port() const { return port_; }

 private:
  std::unique_ptr<grpc::CallbackGenericService> unimplemented_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace mha

#endif  // MHA_SERVER_APP_PORTS_H_
