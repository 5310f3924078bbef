#include "server/transport/tls.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>  // std::rename, std::sscanf
#include <cstdlib>  // mkdtemp, getenv
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace mha {
namespace {

// How often gRPC looks at the private copies; Reload() takes effect within this.
constexpr unsigned kRefreshSeconds = 1;

// Reads at most 1 MiB and one byte, so that a huge or endless file (a path swapped for /dev/zero before a SIGHUP)
// costs nothing: reading it whole first took RSS to 1 GB for a 1 GiB file.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  constexpr std::streamsize kMaxBytes = 1 << 20;
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read it"));
  std::string text(kMaxBytes + 1, '\0');
  file.read(text.data(), kMaxBytes + 1);
  if (file.gcount() > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": over 1 MiB, not a PEM file"));
  }
  text.resize(file.gcount());
  return text;
}

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};

std::unique_ptr<BIO, BioDeleter> MemoryBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The files' contents after checking that they parse and that the key belongs to the certificate.
absl::StatusOr<TlsFiles> ReadChecked(const TlsFiles& paths) {
  TlsFiles pem;
  auto cert = ReadFile(paths.cert, "--tls_cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(paths.key, "--tls_key");
  if (!key.ok()) return key.status();
  pem.cert = *std::move(cert);
  pem.key = *std::move(key);
  std::unique_ptr<X509, X509Deleter> x509(PEM_read_bio_X509(MemoryBio(pem.cert).get(), nullptr, nullptr, nullptr));
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_cert ", paths.cert, ": no PEM certificate in it"));
  }
  std::unique_ptr<EVP_PKEY, KeyDeleter> private_key(
      PEM_read_bio_PrivateKey(MemoryBio(pem.key).get(), nullptr, nullptr, nullptr));
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", paths.key, ": no unencrypted PEM private key in it"));
  }
  if (X509_check_private_key(x509.get(), private_key.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_key ", paths.key, " does not match the certificate in ",
                                                   "--tls_cert ", paths.cert));
  }
  if (!paths.client_ca.empty()) {
    auto ca = ReadFile(paths.client_ca, "--tls_client_ca");
    if (!ca.ok()) return ca.status();
    pem.client_ca = *std::move(ca);
    std::unique_ptr<X509, X509Deleter> ca_cert(
        PEM_read_bio_X509(MemoryBio(pem.client_ca).get(), nullptr, nullptr, nullptr));
    if (ca_cert == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", paths.client_ca, ": no PEM certificate in it"));
    }
  }
  return pem;
}

// Writes `text` to dir/name through a temporary file and a rename, so that a reader sees the old or the new file.
absl::Status WriteAtomically(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(dir, "/", name), tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(absl::StrCat("cannot rename ", tmp));
  return absl::OkStatus();
}

absl::Status WriteCopies(const std::string& dir, const TlsFiles& pem) {
  // Two renames a few microseconds apart: gRPC re-reads a pair whose files changed while it read them, but a refresh
  // that falls between the renames can pair the new key with the old certificate until its next refresh (1 s),
  // when handshakes fail. Rare, short, and only right after a reload.
  if (absl::Status s = WriteAtomically(dir, "key.pem", pem.key); !s.ok()) return s;
  if (absl::Status s = WriteAtomically(dir, "cert.pem", pem.cert); !s.ok()) return s;
  if (!pem.client_ca.empty()) return WriteAtomically(dir, "ca.pem", pem.client_ca);
  return absl::OkStatus();
}

// Private copies left by servers that were killed (SIGKILL, a crash): mha-tls-PID-* folders of this user whose
// process no longer exists. A folder whose PID is alive (ours, or reused by another process) is left alone.
void RemoveStaleCopies(const std::string& parent) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(parent, error)) {
    const std::string name = entry.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "mha-tls-%d-", &pid) != 1 || pid <= 0) continue;
    struct stat info {};
    if (lstat(entry.path().c_str(), &info) != 0 || !S_ISDIR(info.st_mode) || info.st_uid != getuid()) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    std::filesystem::remove_all(entry.path(), ignored);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsServer>> TlsServer::Create(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (files.cert.empty()) return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  absl::StatusOr<TlsFiles> pem = ReadChecked(files);
  if (!pem.ok()) return pem.status();

  std::unique_ptr<TlsServer> server(new TlsServer(files));
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string parent = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  RemoveStaleCopies(parent);
  std::string pattern = absl::StrCat(parent, "/mha-tls-", getpid(), "-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot make a private directory for the TLS files: ", pattern));
  }
  server->dir_ = pattern;  // mkdtemp makes it 0700
  if (absl::Status s = WriteCopies(server->dir_, *pem); !s.ok()) return s;

  const std::string dir = server->dir_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  if (server->mutual()) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        dir + "/key.pem", dir + "/cert.pem", dir + "/ca.pem", kRefreshSeconds);
  } else {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        dir + "/key.pem", dir + "/cert.pem", kRefreshSeconds);
  }
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (server->mutual()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  server->credentials_ = grpc::experimental::TlsServerCredentials(options);
  if (server->credentials_ == nullptr) return absl::InternalError("gRPC refused the TLS options");
  return server;
}

TlsServer::~TlsServer() { RemoveCopies(); }

void TlsServer::RemoveCopies() {
  absl::MutexLock lock(&reload_mu_);
  if (dir_.empty()) return;
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
  dir_.clear();
}

absl::Status TlsServer::Reload() {
  absl::StatusOr<TlsFiles> pem = ReadChecked(files_);
  if (!pem.ok()) return pem.status();
  absl::MutexLock lock(&reload_mu_);
  if (dir_.empty()) return absl::FailedPreconditionError("the server has stopped serving TLS");
  return WriteCopies(dir_, *pem);
}

}  // namespace mha
