// A decoding workload against the session RPCs: what `mha_client decode` runs and reports. S sessions get a random
// context of T tokens (prefilled in chunks), then N decode steps of one token per session and layer: either every
// session in one Extend per layer (batched, as a decoder batching its sequences sends them), or one call per session
// and layer from C threads at once (per_session, as independent clients). With `stateless`, the same steps resend
// each session's whole history through ScaledDotProductAttention instead (what the API offered before sessions), to
// show the difference. Tokens/s, per-step latency and the KV bytes the server read per second are measured over the
// decode steps; `check` compares session 0's steps with a local double-precision reference (head sessions) or a
// stateless causal call over its whole sequence (layer sessions). With `shards` > 1 each head session is spread over
// that many sessions on the clients given (client/decode_shards.h) and every step's outputs merge by their lse. With
// `recover` each session records what it was fed and a call that finds it lost (NOT_FOUND, UNAVAILABLE) rebuilds it
// and is sent again (client/session_recovery.h). The sessions are named "decode-<8 hex digits per run>-<i>" (the
// client chooses, so that a proxy hashing on mha-session-id routes even their CreateSession). Extends go over the
// client's streams or unary as `transport` says (client/extend_stepper.h).
#ifndef MHA_CLIENT_DECODE_H_
#define MHA_CLIENT_DECODE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attention_client.h"
#include "client/bench_report.h"

namespace mha {

struct DecodeOptions {
  int sessions = 1;
  int64_t context = 1024;  // T: tokens prefilled per session and layer
  int steps = 32;          // N: decode steps
  // Layer sessions over these registered layers (x in), else head sessions of this configuration (q, k, v in).
  std::vector<std::string> layers;
  int heads = 32, kv_heads = 8, head_dim = 128, num_layers = 1;
  double rope_theta = 500000;  // head sessions; 0 = none
  v1::DataType cache_dtype = v1::BF16;
  v1::DataType wire_dtype = v1::FP32;
  bool per_session = false;  // one call per session and layer, `concurrency` in flight
  int concurrency = 1;
  int64_t prefill_chunk = 1024;  // tokens per prefill call
  bool stateless = false;
  bool check = false;
  v1::Backend backend = v1::BACKEND_AUTO;
  uint32_t seed = 1;
  // Head sessions only, no RoPE (a shard's cache positions start at 0), not stateless, at most `context`: each
  // logical session is this many sessions, shard i on client i % clients, holding a contiguous part of the context.
  int shards = 1;
  // Sessions only (not stateless), one shard: record each session's tokens; a step or prefill call that finds its
  // sessions lost rebuilds them (CreateSession under the same id, the record replayed) and is sent again.
  bool recover = false;
  // How the Extends go: over the client's ExtendStreams while the server has them, as unary calls, or both, every
  // other step each way (so that the two are timed under the same conditions). Sharded steps are unary either way
  // (each goes to several servers at once).
  enum class Transport { kStream, kUnary, kBoth };
  Transport transport = Transport::kStream;
  // Sessions only, one shard, not recover: the first shared_prefix tokens of every session's context are the same,
  // named by prefix keys (PrefixKeys of their positions, with the run's seed and shape as extra bytes), so that
  // sessions after the first attach the prefix's full blocks instead of prefilling them.
  int64_t shared_prefix = 0;
};

// "stream", "unary" or "both"; INVALID_ARGUMENT otherwise.
absl::StatusOr<DecodeOptions::Transport> ParseTransport(absl::string_view name);

// INVALID_ARGUMENT naming the option when out of range.
absl::Status ValidateDecodeOptions(const DecodeOptions& options);

struct DecodeReport {
  DecodeOptions options;
  std::string target;
  int64_t d_model = 0;            // layer sessions
  int64_t heads = 0, kv_heads = 0, head_dim = 0, caches = 0;  // as run (a layer session's are its layer's)
  int64_t prefill_tokens = 0;     // over sessions and layers
  double prefill_seconds = 0;
  int64_t decode_tokens = 0;      // sessions x steps (per layer, one token each)
  double decode_seconds = 0;
  double tokens_per_second = 0;   // decode_tokens / decode_seconds
  LatencySummary step;            // one session's step over every layer (per_session), or every session's (batched)
  // The same, of the steps that went over a stream and of those sent unary, and how many each (a server without
  // ExtendStream takes every step unary).
  LatencySummary stream_step, unary_step;
  int64_t stream_steps = 0, unary_steps = 0;
  // The server's own time in each step's calls (their Timing.handler_us: from the call's start in the server to its
  // answer), so that a step's round trip minus it is the transport and the client; zero stateless or sharded.
  LatencySummary server_step;
  double kv_bytes_read = 0;       // cache bytes the steps' attention read (2 Hkv d_k sizeof(cache) per token)
  double kv_bytes_per_second = 0;
  int64_t request_bytes_per_step = 0;  // what one step sent (all sessions, all layers)
  int64_t errors = 0;
  std::string first_error;
  int64_t recoveries = 0;  // sessions rebuilt (recover), over the prefill and the steps
  bool checked = false;
  double check_max_error = 0;  // max |got - want| / (1 + |want|) over the checked rows
  double check_tolerance = 0;
  std::vector<int64_t> shard_lengths;  // --shards: session 0's first cache per shard after the last step, as served
  // shared_prefix: the server's block size, the tokens CreateSession attached over every session (per cache), and
  // the cache bytes those tokens would have taken over every cache (stored once instead).
  int64_t block_tokens = 0;
  int64_t attached_tokens = 0;
  double attached_bytes = 0;
  double attach_seconds_max = 0;  // the slowest CreateSession that attached tokens, round trip
  // The server's pool after the prefill (GetServerInfo.kv_cache, every client's sessions): bytes in use, and of
  // those in blocks findable by prefix key.
  int64_t pool_used_bytes = 0, pool_prefix_bytes = 0;
};

// Runs the workload (creating and closing its sessions). Errors of the set-up (CreateSession, a prefill call) are
// returned; errors of decode steps are counted in the report.
absl::StatusOr<DecodeReport> RunDecode(AttentionClient& client, const DecodeOptions& options);
// The same over several servers: shard i (of options.shards) on *clients[i % clients.size()]; a run without shards
// uses clients[0] alone. INVALID_ARGUMENT if clients is empty or lists more clients than shards.
absl::StatusOr<DecodeReport> RunDecode(const std::vector<AttentionClient*>& clients, const DecodeOptions& options);

std::string FormatDecodePretty(const DecodeReport& report);
std::string FormatDecodeJson(const DecodeReport& report);

}  // namespace mha

#endif  // MHA_CLIENT_DECODE_H_
