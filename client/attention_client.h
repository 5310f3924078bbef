// A thin C++ client for the Attention service: one channel (any gRPC target, optionally load-balanced), typed
// calls with a per-call deadline, message limits matching the server's, and gRPC errors turned into
// absl::Status. Thread-safe: calls may be made concurrently from many threads.
#ifndef MHA_CLIENT_ATTENTION_CLIENT_H_
#define MHA_CLIENT_ATTENTION_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/mha/v1/attention.grpc.pb.h"

namespace mha {

struct ClientOptions {
  // Any gRPC target: "127.0.0.1:50051", "dns:///mha.svc:50051", "ipv4:127.0.0.1:50051,127.0.0.1:50052".
  std::string target = "127.0.0.1:50051";
  // Should match the server's --max_message_mb.
  int max_message_mb = 256;
  // gRPC load-balancing policy across the target's addresses: "pick_first" (gRPC's default) or "round_robin".
  std::string lb_policy;
  // Deadline of every call.
  absl::Duration timeout = absl::Seconds(60);
  // Give this channel its own connections instead of sharing them with other channels of the same target and
  // arguments (gRPC's default). Load tests set it to spread calls over several TCP connections.
  bool dedicated_connection = false;
  // TLS instead of plaintext: the PEM roots that verify the server (empty = gRPC's default roots), and for mutual
  // TLS the PEM certificate chain and key this client presents. tls_server_name overrides the name checked in the
  // server's certificate (default: the target's host).
  bool tls = false;
  std::string tls_roots_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_server_name;
  // Sent with every call as "authorization: Bearer <token>" when non-empty (servers with --auth_tokens_file).
  std::string token;
  // Extend calls go over ExtendStream (a decoder's per-layer steps without a new HTTP/2 stream each), a stream per
  // session stepping, kept open between steps, up to this many at once (client/extend_stepper.h); past them, and
  // with 0, Extends are unary. Keep it well under the server's --max_streams_per_connection (100).
  int max_extend_streams = 16;
};

class ExtendStreams;

// A channel to options.target with the options' message limits, load-balancing policy, connection sharing,
// transport security and token.
std::shared_ptr<grpc::Channel> CreateAttentionChannel(const ClientOptions& options);

// A dense fp32 array with its shape, row-major.
struct Array {
  std::vector<int64_t> shape;
  std::vector<float> values;  // product(shape) values
};

// A MultiHeadAttention call on plain arrays. Borrowed pointers must outlive the call.
struct MhaInputs {
  const Array* query = nullptr;  // [B, Tq, d_model], required
  const Array* key = nullptr;    // [B, Tk, d_kv_in]; null = self-attention
  const Array* value = nullptr;  // [B, Tk, d_v_in]; null = key
  std::string layer = "demo";    // a registered layer
  bool causal = false;
  std::vector<int32_t> key_lengths;  // empty or B values
  std::vector<float> head_mask;      // empty or H values
  bool return_attention_weights = false;
  v1::DataType wire_dtype = v1::FP32;  // how the inputs travel (FP16/BF16 halve the bytes); outputs come back as fp32
  v1::Backend backend = v1::BACKEND_AUTO;
};

struct MhaOutputs {
  Array output;             // [B, Tq, d_model]
  Array attention_weights;  // [B, H, Tq, Tk]; empty unless requested
  std::string backend;      // which backend ran
  v1::Timing timing;        // server queue / compute / handler microseconds
};

// grpc::Status -> absl::Status (the codes share their numbering).
absl::Status FromGrpcStatus(const grpc::Status& status);

class AttentionClient {
 public:
  explicit AttentionClient(const ClientOptions& options);
  ~AttentionClient();

  absl::StatusOr<v1::MultiHeadAttentionResponse> MultiHeadAttention(const v1::MultiHeadAttentionRequest& request);
  // The same call on plain arrays: fp32 in and out, no protobuf in sight. See MhaInputs. The arrays' bytes are
  // sent as they lie (fp32 wire) and the outputs decoded straight from gRPC's buffers: one copy of each tensor's
  // bytes on this side, gRPC's into the outputs.
  absl::StatusOr<MhaOutputs> MultiHeadAttention(const MhaInputs& inputs);
  absl::StatusOr<v1::ScaledDotProductAttentionResponse> ScaledDotProductAttention(
      const v1::ScaledDotProductAttentionRequest& request);
  absl::StatusOr<v1::LoadLayerResponse> LoadLayer(const v1::LoadLayerRequest& request);
  absl::Status UnloadLayer(const std::string& name);
  absl::StatusOr<v1::ListLayersResponse> ListLayers();
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  // Maps the shared-memory object `key` (see SharedMemoryObject) of `byte_size` bytes on the server as region
  // `name`, for SharedMemoryRef; the server must run with --max_shared_memory_regions > 0 and share this host.
  absl::Status RegisterSharedMemory(const std::string& name, const std::string& key, uint64_t byte_size);
  // Drops region `name` (empty: every region) on the server.
  absl::Status UnregisterSharedMemory(const std::string& name);
  // The registered regions (empty `name`: all of them; else that one, or NOT_FOUND).
  absl::StatusOr<v1::GetSharedMemoryStatusResponse> GetSharedMemoryStatus(const std::string& name = "");
  // grpc.health.v1 Check for the whole server (service ""): true when SERVING.
  absl::StatusOr<bool> Serving();

  // The session RPCs. Each sends its session's id as "mha-session-id" metadata (CreateSession's when the client
  // chose one, the source's for ForkSession, the first item's for Extend), so that a proxy can route every call of
  // a session to the replica that holds it. client/session.h wraps them in a handle.
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& request);
  // Over one of the client's streams (ClientOptions::max_extend_streams), unary where the server has no
  // ExtendStream or every stream is stepping; ExtendUnary always as one unary call.
  absl::StatusOr<v1::ExtendResponse> Extend(const v1::ExtendRequest& request);
  absl::StatusOr<v1::ExtendResponse> ExtendUnary(const v1::ExtendRequest& request);
  // Whether Extend goes over streams: false with max_extend_streams 0, or once the server showed it has none.
  bool streams_extends() const;
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const v1::ForkSessionRequest& request);
  absl::StatusOr<v1::TruncateSessionResponse> TruncateSession(const v1::TruncateSessionRequest& request);
  absl::Status CloseSession(const std::string& session_id);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const ClientOptions& options() const { return options_; }
  // The generated stub, for the streaming calls (ExtendStepper).
  v1::Attention::Stub* stub() const { return stub_.get(); }

 private:
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_stub_;  // for calls whose tensors travel outside the message
  std::unique_ptr<ExtendStreams> extend_streams_;    // null with max_extend_streams 0
};

}  // namespace mha

#endif  // MHA_CLIENT_ATTENTION_CLIENT_H_
