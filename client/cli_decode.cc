// mha_client decode: a decoding workload on KV-cache sessions (client/decode.h): S sessions prefilled with T random
// tokens, then N decode steps, batched or one call per session; tokens/s, per-step latency, KV bytes read per second;
// --check compares session 0 with a reference; --stateless resends the history instead, for comparison; --shards
// spreads each session's context over several servers and merges every step's outputs by their lse; --recover
// rebuilds a session that was lost (a restarted server, a dead replica behind a proxy) from what it was fed.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli.h"
#include "client/cli_request.h"
#include "client/decode.h"

ABSL_FLAG(int, sessions, 1, "decode: sessions decoding at once");
ABSL_FLAG(int64_t, context, 1024, "decode: tokens prefilled per session (and layer) before the steps");
ABSL_FLAG(int, steps, 32, "decode: decode steps, one new token per session and layer each");
ABSL_FLAG(std::string, session_layers, "",
          "decode: registered layers of layer sessions, comma-separated (x in); empty = head sessions (q, k, v in)");
ABSL_FLAG(int, num_layers, 1, "decode: caches per head session (layers of the model)");
ABSL_FLAG(std::string, cache_dtype, "bf16",
          "decode: what the caches store: fp32, fp16, bf16, int8, fp8_e4m3 or fp8_e5m2");
ABSL_FLAG(double, rope_theta, 500000, "decode: head sessions' RoPE base; 0 = none");
ABSL_FLAG(bool, per_session, false, "decode: one call per session and layer, -c calls in flight (default: batched)");
ABSL_FLAG(int64_t, prefill_chunk, 1024, "decode: tokens per prefill call");
ABSL_FLAG(bool, stateless, false,
          "decode: no sessions: every step resends each session's whole history (ScaledDotProductAttention, or "
          "MultiHeadAttention for --session_layers), to compare");
ABSL_FLAG(int, shards, 1,
          "decode: spread each head session's context over this many sessions, one per shard, in contiguous parts; "
          "--target then lists the shards' servers, comma-separated (shard i on server i % count); each step asks "
          "every shard (append=false but the last) and merges the outputs by their lse. Needs --rope_theta 0");
ABSL_FLAG(std::string, transport, "stream",
          "decode: how the Extends go: stream (over ExtendStream, a stream per session stepping, batched: one; unary "
          "where the server has none), unary, or both (every other step each way; the report gives each one's "
          "percentiles)");
ABSL_FLAG(bool, recover, false,
          "decode: record what each session was fed; a call that finds its sessions lost (NOT_FOUND, or UNAVAILABLE: "
          "a restarted server, an evicted session, a dead replica behind a proxy) re-creates them under the same id, "
          "replays the record and is sent again, so the outputs stay exact (--check passes); the report counts the "
          "recoveries. Not with --stateless or --shards");

ABSL_FLAG(int64_t, shared_prefix, 0,
          "decode: the first N context tokens are the same in every session and named by prefix keys: sessions after "
          "the first attach the prefix's full blocks from the server's prefix cache instead of prefilling them; the "
          "report says how many tokens were attached and the cache bytes stored once. Not with --stateless, "
          "--recover or --shards");

ABSL_DECLARE_FLAG(int, c);
ABSL_DECLARE_FLAG(std::string, O);
ABSL_DECLARE_FLAG(bool, check);
ABSL_DECLARE_FLAG(int, heads);
ABSL_DECLARE_FLAG(int, kv_heads);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int, seed);

namespace mha::cli {
namespace {

// The servers of --shards: each comma-separated address of --target is one, shard i on server i % count. Without
// shards, --target is one gRPC target as everywhere else (an address list included).
absl::StatusOr<std::vector<ClientOptions>> ShardServers(const ClientOptions& options, int shards) {
  if (shards <= 1) return std::vector<ClientOptions>{options};
  if (!options.lb_policy.empty()) {
    return absl::InvalidArgumentError(
        "--lb does not go with --shards: --target's comma-separated addresses are then the shards' servers");
  }
  std::vector<ClientOptions> servers;
  for (absl::string_view address : absl::StrSplit(options.target, ',')) {
    if (address.empty()) return absl::InvalidArgumentError("--target has an empty address in its list");
    servers.push_back(options);
    servers.back().target = std::string(address);
  }
  if (static_cast<int>(servers.size()) > shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--target lists ", servers.size(), " servers for --shards ", shards, "; at most one per shard"));
  }
  return servers;
}

}  // namespace

int RunDecode(const ClientOptions& options) {
  DecodeOptions o;
  o.sessions = absl::GetFlag(FLAGS_sessions);
  o.context = absl::GetFlag(FLAGS_context);
  o.steps = absl::GetFlag(FLAGS_steps);
  const std::string layers = absl::GetFlag(FLAGS_session_layers);
  if (!layers.empty()) o.layers = absl::StrSplit(layers, ',');
  // LLaMA-3-8B's attention by default: H=32, Hkv=8, d_k=128.
  o.heads = absl::GetFlag(FLAGS_heads) > 0 ? absl::GetFlag(FLAGS_heads) : 32;
  o.kv_heads = absl::GetFlag(FLAGS_kv_heads) > 0 ? absl::GetFlag(FLAGS_kv_heads)
               : absl::GetFlag(FLAGS_heads) > 0  ? o.heads
                                                 : 8;
  o.head_dim = absl::GetFlag(FLAGS_head_dim) > 0 ? absl::GetFlag(FLAGS_head_dim) : 128;
  o.num_layers = absl::GetFlag(FLAGS_num_layers);
  o.rope_theta = absl::GetFlag(FLAGS_rope_theta);
  o.per_session = absl::GetFlag(FLAGS_per_session);
  o.concurrency = absl::GetFlag(FLAGS_c);
  o.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  o.stateless = absl::GetFlag(FLAGS_stateless);
  o.check = absl::GetFlag(FLAGS_check);
  o.seed = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed));
  o.shards = absl::GetFlag(FLAGS_shards);
  o.recover = absl::GetFlag(FLAGS_recover);
  o.shared_prefix = absl::GetFlag(FLAGS_shared_prefix);
  absl::StatusOr<DecodeOptions::Transport> transport = ParseTransport(absl::GetFlag(FLAGS_transport));
  if (!transport.ok()) return UsageError(transport.status());
  o.transport = *transport;
  absl::StatusOr<v1::DataType> cache = ParseCacheDtype(absl::GetFlag(FLAGS_cache_dtype), "cache_dtype");
  if (!cache.ok()) return UsageError(cache.status());
  o.cache_dtype = *cache;
  const std::string wire = absl::GetFlag(FLAGS_dtype);
  absl::StatusOr<v1::DataType> wire_dtype = ParseDtype(wire.empty() ? "fp32" : wire, "dtype");
  if (!wire_dtype.ok()) return UsageError(wire_dtype.status());
  o.wire_dtype = *wire_dtype;
  absl::StatusOr<v1::Backend> backend = ParseBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return UsageError(backend.status());
  o.backend = *backend;
  const std::string format = absl::GetFlag(FLAGS_O);
  if (format != "pretty" && format != "json") {
    return UsageError(absl::InvalidArgumentError(absl::StrCat("decode: -O must be pretty or json; got '", format, "'")));
  }
  if (absl::Status valid = ValidateDecodeOptions(o); !valid.ok()) return UsageError(valid);
  absl::StatusOr<std::vector<ClientOptions>> servers = ShardServers(options, o.shards);
  if (!servers.ok()) return UsageError(servers.status());

  std::vector<std::unique_ptr<AttentionClient>> clients;
  std::vector<AttentionClient*> shard_clients;
  for (ClientOptions server : *servers) {
    // A stream per session stepping (per session, up to 64 of them; batched, one for all).
    if (o.per_session) server.max_extend_streams = std::max(server.max_extend_streams, std::min(o.sessions, 64));
    clients.push_back(std::make_unique<AttentionClient>(server));
    shard_clients.push_back(clients.back().get());
  }
  absl::StatusOr<DecodeReport> report = mha::RunDecode(shard_clients, o);
  if (!report.ok()) return Fail(report.status());
  report->target = options.target;
  const std::string text = format == "json" ? FormatDecodeJson(*report) : FormatDecodePretty(*report);
  std::fwrite(text.data(), 1, text.size(), stdout);
  if (report->checked && report->check_max_error > report->check_tolerance) {
    std::fprintf(stderr, "error: session 0's last step differs from its reference by %.3g (tolerance %.3g)\n",
                 report->check_max_error, report->check_tolerance);
    return kExitFailure;
  }
  return report->errors > 0 && o.check ? kExitFailure : kExitOk;
}

}  // namespace mha::cli
