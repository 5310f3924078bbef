// Transport and identity: TLS and mutual TLS with certificates made at test time by openssl (a throwaway CA per
// suite), bearer tokens with roles, and reloading both. Servers listen on loopback TCP.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
#include "server/transport/auth.h"
#include "spdlog/spdlog.h"
#include "tests/service_fixture.h"

namespace mha {
namespace {

using ::mha::testing::kHeads;
using ::mha::testing::ValidRequest;
using ::testing::HasSubstr;

std::string ReadText(const std::string& path) {
  std::ifstream file(path);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// A directory of PEM files made once per suite: CAs "ca" and "ca2"; "server" (for localhost and 127.0.0.1) and
// "client" signed by ca; "server2" and "client2" signed by ca2. Each NAME has NAME.pem and NAME.key.
class Pki {
 public:
  Pki() {
    std::string pattern = (std::filesystem::temp_directory_path() / "mha-pki-XXXXXX").string();
    dir_ = mkdtemp(pattern.data());
    WriteText(Path("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
    for (const char* ca : {"ca", "ca2"}) {
      const std::string name = ca;
      Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=" + name +
          " -keyout " + Path(name + ".key") + " -out " + Path(name + ".pem"));
    }
    Sign("server", "ca");
    Sign("client", "ca");
    Sign("server2", "ca2");
    Sign("client2", "ca2");
  }
  ~Pki() { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Pem(const std::string& name) const { return ReadText(Path(name + ".pem")); }
  std::string Key(const std::string& name) const { return ReadText(Path(name + ".key")); }

 private:
  void Run(const std::string& command) {
    const int status = std::system((command + " >/dev/null 2>&1").c_str());
    ASSERT_EQ(status, 0) << command;
  }
  void Sign(const std::string& name, const std::string& ca) {
    Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost -keyout " +
        Path(name + ".key") + " -out " + Path(name + ".csr"));
    Run("openssl x509 -req -days 2 -in " + Path(name + ".csr") + " -CA " + Path(ca + ".pem") + " -CAkey " +
        Path(ca + ".key") + " -CAcreateserial -extfile " + Path("san.ext") + " -out " + Path(name + ".pem"));
  }

  std::string dir_;
};

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { pki_ = new Pki(); }
  static void TearDownTestSuite() { delete pki_; }
  void SetUp() override { spdlog::set_level(spdlog::level::warn); }

  // A server on a free loopback port with these TLS files (paths).
  std::unique_ptr<MhaServer> Start(const std::string& cert, const std::string& key, const std::string& client_ca) {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.threads = 2;
    options.tls_cert = cert;
    options.tls_key = key;
    options.tls_client_ca = client_ca;
    absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  // A channel of its own (no shared connections) to `port`, trusting `ca` and presenting `identity` if non-empty.
  static std::shared_ptr<grpc::Channel> TlsChannel(int port, const std::string& ca, const std::string& identity = "") {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pki_->Pem(ca);
    if (!identity.empty()) {
      ssl.pem_cert_chain = pki_->Pem(identity);
      ssl.pem_private_key = pki_->Key(identity);
    }
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::SslCredentials(ssl), args);
  }

  static grpc::Status Info(const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetServerInfoResponse response;
    return v1::Attention::NewStub(channel)->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
  }

  static Pki* pki_;
};

Pki* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, CallOverTlsSucceeds) {
  std::unique_ptr<MhaServer> server = Start(pki_->Path("server.pem"), pki_->Path("server.key"), "");
  ASSERT_NE(server, nullptr);
  const std::shared_ptr<grpc::Channel> channel = TlsChannel(server->port(), "ca");
  EXPECT_TRUE(Info(channel).ok()) << Info(channel).error_message();
  grpc::ClientContext context;
  v1::MultiHeadAttentionResponse response;
  EXPECT_TRUE(v1::Attention::NewStub(channel)->MultiHeadAttention(&context, ValidRequest(), &response).ok());
}

TEST_F(TlsTest, PlaintextClientIsRefused) {
  std::unique_ptr<MhaServer> server = Start(pki_->Path("server.pem"), pki_->Path("server.key"), "");
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Info(grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                     grpc::InsecureChannelCredentials()))
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ClientRefusesAServerFromAnotherCa) {
  std::unique_ptr<MhaServer> server = Start(pki_->Path("server.pem"), pki_->Path("server.key"), "");
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Info(TlsChannel(server->port(), "ca2")).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRefusesAClientWithoutACertificate) {
  std::unique_ptr<MhaServer> server =
      Start(pki_->Path("server.pem"), pki_->Path("server.key"), pki_->Path("ca.pem"));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Info(TlsChannel(server->port(), "ca")).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsAcceptsACertificateFromTheClientCa) {
  std::unique_ptr<MhaServer> server =
      Start(pki_->Path("server.pem"), pki_->Path("server.key"), pki_->Path("ca.pem"));
  ASSERT_NE(server, nullptr);
  const grpc::Status status = Info(TlsChannel(server->port(), "ca", "client"));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(TlsTest, MutualTlsRefusesACertificateFromAnotherCa) {
  std::unique_ptr<MhaServer> server =
      Start(pki_->Path("server.pem"), pki_->Path("server.key"), pki_->Path("ca.pem"));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Info(TlsChannel(server->port(), "ca", "client2")).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, HealthPortAnswersInPlaintextAndServesNothingElse) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.health_listen = "127.0.0.1:0";
  options.tls_cert = pki_->Path("server.pem");
  options.tls_key = pki_->Path("server.key");
  options.tls_client_ca = pki_->Path("ca.pem");
  absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::shared_ptr<grpc::Channel> plain = grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->health_port()), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(grpc::health::v1::Health::NewStub(plain)
                  ->Check(&context, grpc::health::v1::HealthCheckRequest(), &response)
                  .ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Info(plain).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(TlsTest, KeyThatDoesNotMatchTheCertificateFailsTheStart) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.tls_cert = pki_->Path("server.pem");
  options.tls_key = pki_->Path("client.key");
  const absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("does not match the certificate"));
}

TEST_F(TlsTest, ReloadServesTheNewCertificateAndKeepsOpenConnections) {
  // The server's files live where the operator keeps them; the test replaces them and reloads, as SIGHUP does.
  const std::string cert = pki_->Path("live.pem"), key = pki_->Path("live.key");
  WriteText(cert, pki_->Pem("server"));
  WriteText(key, pki_->Key("server"));
  std::unique_ptr<MhaServer> server = Start(cert, key, "");
  ASSERT_NE(server, nullptr);
  const std::shared_ptr<grpc::Channel> open = TlsChannel(server->port(), "ca");
  ASSERT_TRUE(Info(open).ok());
  EXPECT_EQ(Info(TlsChannel(server->port(), "ca2")).error_code(), grpc::StatusCode::UNAVAILABLE);

  WriteText(cert, pki_->Pem("server2"));
  WriteText(key, pki_->Key("server2"));
  ASSERT_TRUE(server->Reload().ok());
  // gRPC looks at the server's private copies once a second.
  grpc::Status fresh;
  for (int attempt = 0; attempt < 50; ++attempt) {
    fresh = Info(TlsChannel(server->port(), "ca2"));
    if (fresh.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(fresh.ok()) << "a new connection still gets the old certificate: " << fresh.error_message();
  EXPECT_TRUE(Info(open).ok()) << "the connection opened before the reload was dropped";
}

TEST_F(TlsTest, ReloadOfABrokenFileKeepsTheOldOne) {
  const std::string cert = pki_->Path("broken.pem"), key = pki_->Path("broken.key");
  WriteText(cert, pki_->Pem("server"));
  WriteText(key, pki_->Key("server"));
  std::unique_ptr<MhaServer> server = Start(cert, key, "");
  ASSERT_NE(server, nullptr);
  WriteText(cert, "not a certificate");
  const absl::Status reload = server->Reload();
  EXPECT_EQ(reload.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reload.message(), HasSubstr("--tls_cert"));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_TRUE(Info(TlsChannel(server->port(), "ca")).ok());
}

TEST_F(TlsTest, ReloadReadsAtMostOneMiBOfAFile) {
  // An endless file in the certificate's place: reading it whole would never end (a 1 GiB one took RSS to 1 GB).
  const std::string cert = pki_->Path("endless.pem"), key = pki_->Path("endless.key");
  WriteText(cert, pki_->Pem("server"));
  WriteText(key, pki_->Key("server"));
  std::unique_ptr<MhaServer> server = Start(cert, key, "");
  ASSERT_NE(server, nullptr);
  std::filesystem::remove(cert);
  std::filesystem::create_symlink("/dev/zero", cert);
  const absl::Status reload = server->Reload();
  EXPECT_EQ(reload.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reload.message(), HasSubstr("--tls_cert " + cert + ": over 1 MiB, not a PEM file"));
}

// Bearer tokens, through the in-process channel (metadata travels the same way).
class TokenTest : public ::testing::Test {
 protected:
  static constexpr const char* kComputeToken = "compute-token-0123456789";
  static constexpr const char* kAdminToken = "admin-token-0123456789ab";
  static constexpr const char* kOtherToken = "other-compute-token-987654";

  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    tokens_ = (std::filesystem::temp_directory_path() / ("mha-tokens-" + std::to_string(getpid()))).string();
    WriteText(tokens_, std::string("# test tokens\n") + kComputeToken + "\n" + kAdminToken + " admin\n" +
                           kOtherToken + "\n");
    ServerOptions options;
    options.listen = "";
    options.threads = 2;
    options.auth_tokens_file = tokens_;
    absl::StatusOr<std::unique_ptr<MhaServer>> server = MhaServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = server_->InProcessChannel();
  }
  void TearDown() override { std::filesystem::remove(tokens_); }

  grpc::Status Compute(const std::string& authorization) {
    grpc::ClientContext context;
    if (!authorization.empty()) context.AddMetadata("authorization", authorization);
    v1::MultiHeadAttentionResponse response;
    return v1::Attention::NewStub(channel_)->MultiHeadAttention(&context, ValidRequest(), &response);
  }
  grpc::Status Load(const std::string& token, const std::string& name) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + token);
    v1::LoadLayerRequest load;
    load.set_name(name);
    *load.mutable_weights() = ValidRequest().inline_weights();
    load.mutable_heads()->set_num_heads(kHeads);
    v1::LoadLayerResponse response;
    return v1::Attention::NewStub(channel_)->LoadLayer(&context, load, &response);
  }

  std::string tokens_;
  std::unique_ptr<MhaServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(TokenTest, MissingMalformedAndWrongTokensGetOneAnswer) {
  const grpc::Status missing = Compute("");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  for (const std::string& authorization :
       {std::string("Bearer wrong-token-0123456789"), std::string(kComputeToken), std::string("Basic abc"),
        std::string("Bearer ") + kComputeToken + "x", std::string("Bearer ")}) {
    const grpc::Status status = Compute(authorization);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << authorization;
    EXPECT_EQ(status.error_message(), missing.error_message()) << authorization;
  }
}

TEST_F(TokenTest, ComputeTokenComputesButCannotLoad) {
  EXPECT_TRUE(Compute(std::string("Bearer ") + kComputeToken).ok());
  const grpc::Status load = Load(kComputeToken, "by_compute");
  EXPECT_EQ(load.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(load.error_message(), HasSubstr("LoadLayer needs a token with the admin role"));
}

TEST_F(TokenTest, AdminTokenLoadsAndComputes) {
  EXPECT_TRUE(Load(kAdminToken, "by_admin").ok());
  EXPECT_TRUE(Compute(std::string("bearer ") + kAdminToken).ok());  // the scheme is case-insensitive
}

// A session belongs to the token that created it: another compute token gets NOT_FOUND for it, as if it did not
// exist, and may open a session of the same id, its own; an admin token lists it with its owner and closes it by
// naming the owner, but cannot use it.
TEST_F(TokenTest, ASessionBelongsToTheTokenThatCreatedIt) {
  const auto with = [](grpc::ClientContext* context, const char* token) {
    context->AddMetadata("authorization", std::string("Bearer ") + token);
  };
  auto stub = v1::Attention::NewStub(channel_);
  v1::CreateSessionRequest create;
  create.set_session_id("mine");
  create.mutable_heads()->set_num_heads(2);
  create.mutable_heads()->set_head_dim(4);
  {
    grpc::ClientContext context;
    with(&context, kComputeToken);
    v1::CreateSessionResponse response;
    ASSERT_TRUE(stub->CreateSession(&context, create, &response).ok());
  }
  v1::ExtendRequest extend;
  v1::ExtendItem* item = extend.add_items();
  item->set_session_id("mine");
  FloatsToTensor(std::vector<float>(8, 0.5f), {1, 2, 4}, v1::FP32, item->mutable_q());
  FloatsToTensor(std::vector<float>(8, 0.5f), {1, 2, 4}, v1::FP32, item->mutable_k());
  FloatsToTensor(std::vector<float>(8, 0.5f), {1, 2, 4}, v1::FP32, item->mutable_v());
  const auto call_extend = [&](const char* token) {
    grpc::ClientContext context;
    with(&context, token);
    v1::ExtendResponse response;
    return stub->Extend(&context, extend, &response);
  };
  // The same step on a stream, with the token (none when null) on the stream.
  const auto stream_extend = [&](const char* token) {
    grpc::ClientContext context;
    if (token != nullptr) with(&context, token);
    auto stream = stub->ExtendStream(&context);
    v1::ExtendResponse response;
    if (stream->Write(extend)) stream->Read(&response);
    stream->WritesDone();
    return stream->Finish();
  };
  const auto listed = [&](const char* token) {
    grpc::ClientContext context;
    with(&context, token);
    v1::ListSessionsResponse response;
    EXPECT_TRUE(stub->ListSessions(&context, v1::ListSessionsRequest(), &response).ok());
    return response;
  };
  const auto list = [&](const char* token) { return listed(token).sessions_size(); };
  const auto close = [&](const char* token, const std::string& owner) {
    grpc::ClientContext context;
    with(&context, token);
    v1::CloseSessionRequest close;
    close.set_session_id("mine");
    close.set_owner(owner);
    v1::CloseSessionResponse response;
    return stub->CloseSession(&context, close, &response).error_code();
  };
  EXPECT_TRUE(call_extend(kComputeToken).ok());
  const grpc::Status other = call_extend(kOtherToken);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(other.error_message(), HasSubstr("no session 'mine'"));
  EXPECT_EQ(call_extend(kAdminToken).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(stream_extend(kComputeToken).ok());
  EXPECT_EQ(stream_extend(kOtherToken).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(stream_extend(nullptr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(list(kComputeToken), 1);
  EXPECT_EQ(list(kOtherToken), 0);
  const v1::ListSessionsResponse all = listed(kAdminToken);
  ASSERT_EQ(all.sessions_size(), 1);
  const std::string owner = all.sessions(0).owner();
  EXPECT_EQ(owner.size(), 64u);  // hex SHA-256 of the token
  EXPECT_EQ(listed(kComputeToken).sessions(0).owner(), "");
  EXPECT_EQ(close(kOtherToken, ""), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(close(kOtherToken, owner), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(close(kAdminToken, ""), grpc::StatusCode::NOT_FOUND);  // the admin's own scope
  EXPECT_EQ(close(kAdminToken, owner), grpc::StatusCode::OK);
  EXPECT_EQ(list(kComputeToken), 0);
  grpc::ClientContext context;  // without a token: refused before anything is looked up
  v1::ListSessionsResponse response;
  EXPECT_EQ(stub->ListSessions(&context, v1::ListSessionsRequest(), &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// Another token's open id is no answer: Create and Fork under it succeed, each token's session its own (an
// ALREADY_EXISTS would let ids be probed and squatted).
TEST_F(TokenTest, AnotherTokensIdIsFreeForEachToken) {
  auto stub = v1::Attention::NewStub(channel_);
  const auto create = [&](const char* token, const std::string& id) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::CreateSessionRequest create;
    create.set_session_id(id);
    create.mutable_heads()->set_num_heads(2);
    create.mutable_heads()->set_head_dim(4);
    v1::CreateSessionResponse response;
    return stub->CreateSession(&context, create, &response).error_code();
  };
  const auto fork = [&](const char* token, const std::string& id, const std::string& new_id) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::ForkSessionRequest fork;
    fork.set_session_id(id);
    fork.set_new_session_id(new_id);
    v1::ForkSessionResponse response;
    return stub->ForkSession(&context, fork, &response).error_code();
  };
  EXPECT_EQ(create(kComputeToken, "chat"), grpc::StatusCode::OK);
  EXPECT_EQ(create(kComputeToken, "beam"), grpc::StatusCode::OK);
  EXPECT_EQ(create(kOtherToken, "chat"), grpc::StatusCode::OK);
  EXPECT_EQ(fork(kOtherToken, "chat", "beam"), grpc::StatusCode::OK);
  EXPECT_EQ(create(kOtherToken, "chat"), grpc::StatusCode::ALREADY_EXISTS);  // its own, open
}

TEST_F(TokenTest, HealthNeedsNoToken) {
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(grpc::health::v1::Health::NewStub(channel_)
                  ->Check(&context, grpc::health::v1::HealthCheckRequest(), &response)
                  .ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(TokenTest, ReloadReplacesTheTokensAndKeepsThemOnABadFile) {
  WriteText(tokens_, "fresh-token-0123456789ab\n");
  ASSERT_TRUE(server_->Reload().ok());
  EXPECT_EQ(Compute(std::string("Bearer ") + kComputeToken).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Compute("Bearer fresh-token-0123456789ab").ok());

  WriteText(tokens_, "short\n");
  EXPECT_EQ(server_->Reload().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Compute("Bearer fresh-token-0123456789ab").ok());
}

TEST(TokenFileTest, ABadLineIsNamedWithoutItsToken) {
  const std::string path = (std::filesystem::temp_directory_path() / "mha-bad-tokens").string();
  WriteText(path, "good-token-0123456789\nsecret-token-0123456789 superuser\n");
  const absl::StatusOr<std::unique_ptr<TokenAuth>> auth = TokenAuth::FromFile(path);
  EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(auth.status().message(), HasSubstr("line 2: the role must be compute or admin"));
  EXPECT_THAT(auth.status().message(), ::testing::Not(HasSubstr("secret")));
  std::filesystem::remove(path);
}

TEST(TokenFileTest, AMissingFileFailsTheStart) {
  ServerOptions options;
  options.listen = "";
  options.auth_tokens_file = "/nonexistent/tokens";
  EXPECT_EQ(MhaServer::Start(options).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mha
