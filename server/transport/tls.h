// TLS for the gRPC port from PEM files (--tls_cert, --tls_key, and --tls_client_ca for mutual TLS), re-read when
// the operator asks (SIGHUP) without dropping connections.
//
// gRPC's file-watching certificate provider re-reads files on a timer. So that the files change only on request,
// it watches private copies in a directory of our own (mode 0700), which Reload() replaces after checking that
// the operator's files parse and that the key matches the certificate; handshakes after that (within about a
// second) use the new files, open connections keep theirs.
#ifndef MHA_SERVER_TRANSPORT_TLS_H_
#define MHA_SERVER_TRANSPORT_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/server_credentials.h"

namespace mha {

struct TlsFiles {
  std::string cert;       // PEM certificate chain of the server
  std::string key;        // PEM private key of that certificate
  std::string client_ca;  // PEM CA bundle; non-empty = clients must present a certificate it signed
};

class TlsServer {
 public:
  // Checks the files and makes the private copies. INVALID_ARGUMENT naming the flag and the file for an unreadable
  // or unparsable file, or a key that does not match the certificate.
  static absl::StatusOr<std::unique_ptr<TlsServer>> Create(const TlsFiles& files);
  ~TlsServer();  // removes the private copies (RemoveCopies)

  // Removes the private copies now, for a process that ends without destructors (mha_server after draining): no
  // copy of the key outlives the server. Reload then fails. Thread-safe.
  void RemoveCopies();

  std::shared_ptr<grpc::ServerCredentials> credentials() const { return credentials_; }
  bool mutual() const { return !files_.client_ca.empty(); }

  // Checks the operator's files again and, when they are good, replaces the copies. On error the server keeps
  // serving with the files it had. Thread-safe.
  absl::Status Reload();

 private:
  explicit TlsServer(TlsFiles files) : files_(std::move(files)) {}

  const TlsFiles files_;
  std::string dir_;  // the private copies: cert.pem, key.pem, ca.pem
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  absl::Mutex reload_mu_;
};

}  // namespace mha

#endif  // MHA_SERVER_TRANSPORT_TLS_H_
