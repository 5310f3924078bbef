// Bearer tokens checked before a call's message is read, on TLS ports.
//
// The service checks a call's token in its handler, which gRPC starts only once the whole request message has
// arrived, so a client without a token could make gRPC buffer messages up to --max_message_mb before being refused.
// On a TLS port gRPC 1.51 runs an AuthMetadataProcessor on the call's initial metadata first: TokenGate refuses
// there a call with no valid token (of any role; the handler still checks the role), with the handler's own
// UNAUTHENTICATED status, and gRPC resets the stream without reading its message. The health service needs no
// token. gRPC has no such hook on plaintext ports (the manifests' server port, behind Envoy): there --grpc_memory_mb
// bounds what calls without a token can make it buffer.
#ifndef MHA_SERVER_TRANSPORT_TOKEN_GATE_H_
#define MHA_SERVER_TRANSPORT_TOKEN_GATE_H_

#include "grpcpp/security/auth_metadata_processor.h"
#include "server/base/log_budget.h"
#include "server/transport/auth.h"

namespace mha {

// Each refusal is logged (at most 100 lines a second, as the handler would have logged it); such calls never reach
// the service, so its metrics do not count them.
class TokenGate final : public grpc::AuthMetadataProcessor {
 public:
  // `auth` must outlive the gate (the server owns both).
  explicit TokenGate(const TokenAuth* auth) : auth_(auth), log_budget_(100) {}

  bool IsBlocking() const override { return false; }  // a hash and a comparison, on gRPC's thread
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* context, OutputMetadata* consumed,
                       OutputMetadata* response) override;

 private:
  const TokenAuth* const auth_;
  LogBudget log_budget_;
};

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_TOKEN_GATE_H_
