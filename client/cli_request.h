// Building one MultiHeadAttentionRequest from mha_client's flags; shared by call, bench and plot.
//
// Inputs: --query/--key/--value .npy files, or random values (uniform in [-1, 1], from --seed) of the shape given
// by --batch, --seq and --kv_seq and the layer's feature sizes. Weights: a registered --layer (default "demo"), or
// a --weights_file .safetensors read here and sent inline. Head config: --heads, --kv_heads, --head_dim, --causal,
// --scale override the weights file's metadata (with a named layer they are sent for the server to check).
// Masks: --key_lengths, --head_mask. --weights asks for the per-head attention weights.
#ifndef MHA_CLIENT_CLI_REQUEST_H_
#define MHA_CLIENT_CLI_REQUEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attention_client.h"
#include "proto/mha/v1/attention_shape.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha::cli {

// The request flags after syntax checks: everything that can be judged without files or the server.
struct RequestFlags {
  std::string query_path, key_path, value_path;  // .npy; empty = random
  int64_t batch = 0, seq = 0, kv_seq = 0;         // random inputs; 0 = unset (B 1, Tq 16, Tk = Tq)
  uint32_t seed = 1;
  std::string layer;         // empty = "demo" unless weights_file is set
  std::string weights_file;  // .safetensors
  int32_t heads = 0, kv_heads = 0, head_dim = 0;  // 0 = unset
  bool causal = false;
  float scale = 0;
  std::vector<int32_t> key_lengths;
  std::vector<float> head_mask;
  bool return_weights = false;
  v1::DataType wire_dtype = v1::DATA_TYPE_UNSPECIFIED;  // unset: each .npy's own dtype, fp32 for random inputs
  v1::DataType output_dtype = v1::DATA_TYPE_UNSPECIFIED;
  v1::Backend backend = v1::BACKEND_AUTO;
};

// Reads and checks the request flags. INVALID_ARGUMENT (a usage error) naming the flag for a bad value or a
// conflicting combination (e.g. --layer with --weights_file, --batch with --query, --value without --key).
absl::StatusOr<RequestFlags> RequestFlagsFromCommandLine();

struct PreparedRequest {
  v1::MultiHeadAttentionRequest request;
  AttentionShape shape;  // what the request asks the server to compute
  std::string weights;   // "layer demo" or "file w.safetensors", for reports
};

// Reads the files, asks the server for the named layer's dimensions (ListLayers) and builds the request.
// NOT_FOUND "no layer named X" for an unknown layer or a missing file; INVALID_ARGUMENT for a malformed file or
// shapes that do not fit the weights; otherwise the server's error.
absl::StatusOr<PreparedRequest> PrepareRequest(const RequestFlags& flags, AttentionClient& client);

// Fills v1::Backend / v1::DataType from the flag spellings ("auto", "cpu", ...; "fp32", "fp16", "bf16").
absl::StatusOr<v1::Backend> ParseBackend(const std::string& name);
absl::StatusOr<v1::DataType> ParseDtype(const std::string& name, const std::string& flag);
// The same for a cache's dtype, which may also be int8, fp8_e4m3 or fp8_e5m2.
absl::StatusOr<v1::DataType> ParseCacheDtype(const std::string& name, const std::string& flag);

}  // namespace mha::cli

#endif  // MHA_CLIENT_CLI_REQUEST_H_
