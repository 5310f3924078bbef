// A serialized CreateSessionRequest through what the server does with it (session_service.cc): validate, create in
// a small store, then the session's life in miniature through fuzz_extend.h's steps: a step of fixed values
// into its last cache (two tokens, or a block and one when it names prefix keys, so that a later input can attach
// the block), a fork, the fork truncated to one token and stepped again, both closed. Every head configuration,
// RoPE scaling, per-cache configuration, cache dtype and prefix that validation lets through so meets the cache
// writers, both backends' kernels, Fork and Truncate. Findings: sanitizer reports, a refusal with a code the contract
// does not name for that call, a step that fails on a session the server made, a fork or truncate of it refused.
#include <algorithm>
#include <string>
#include <vector>

#include "server/sessions/session_store.h"
#include "server/sessions/validate_session.h"
#include "tests/fuzz/fuzz_env.h"
#include "tests/fuzz/fuzz_extend.h"

namespace mha::fuzz {
namespace {

constexpr int64_t kBlockTokens = 16;
// A step's q, k, v or x holds at most this many values per token, so that an input stays in the milliseconds.
constexpr int64_t kMaxWidth = 4096;

SessionStore& Store() {
  static SessionStore* store = [] {
    SessionStoreOptions options;
    options.capacity_bytes = 8 << 20;
    options.block_tokens = kBlockTokens;
    options.max_sessions = 8;
    options.max_tokens = 2048;
    return new SessionStore(options, nullptr);
  }();
  return *store;
}

// One item of `tokens` new tokens into the last cache of session `id` (configured by `config`), or nothing when its
// tensors would be wider than kMaxWidth.
bool MakeStep(const SessionConfig& config, const std::string& id, int64_t tokens, v1::ExtendRequest* request) {
  const int64_t cache = config.num_caches - 1;
  request->set_layer_index(static_cast<int32_t>(cache));
  v1::ExtendItem* item = request->add_items();
  item->set_session_id(id);
  if (config.is_layer_session()) {
    const int64_t d_model = config.layers[cache].d_model;
    if (d_model > kMaxWidth) return false;
    FillFixed({tokens, d_model}, item->mutable_x());
    return true;
  }
  const HeadSpec& h = config.HeadsOf(cache);
  if (h.q_width() > kMaxWidth) return false;
  FillFixed({tokens, h.num_heads, h.head_dim}, item->mutable_q());
  FillFixed({tokens, h.num_kv_heads, h.head_dim}, item->mutable_k());
  FillFixed({tokens, h.num_kv_heads, h.head_dim}, item->mutable_v());
  return true;
}

// `tokens` new tokens into session `id`'s last cache, computed only when small (ComputeStep); whether they were. A
// step of the session's own configuration, within its max_tokens, must validate.
bool Step(const Env& env, const SessionConfig& config, const std::string& id, int64_t tokens) {
  v1::ExtendRequest request;
  if (!MakeStep(config, id, tokens, &request)) return false;
  const absl::StatusOr<ExtendPlan> plan = ValidateStep(env, Store(), request);
  if (!plan.ok()) Fail("a step of the session's own shape", plan.status());
  return ComputeStep(env, Store(), *plan);
}

// Session `id`'s step, a fork, the fork truncated to one token and stepped again. `length`: the tokens the session
// starts with (attached from the prefix cache).
void Live(const Env& env, const SessionConfig& config, const std::string& id, int64_t length) {
  const int64_t limit = config.max_tokens > 0 ? config.max_tokens : Store().options().max_tokens;
  const int64_t wanted = config.prefix_keys.empty() ? 2 : kBlockTokens + 1;
  if (length >= limit || !Step(env, config, id, std::min(wanted, limit - length))) return;
  const std::string fork_id = id + "-fork";
  const absl::StatusOr<v1::SessionInfo> fork = Store().Fork(id, fork_id, {});
  if (!fork.ok()) {
    CheckRefusal(fork.status(), {absl::StatusCode::kResourceExhausted});
    return;
  }
  const absl::StatusOr<v1::SessionInfo> cut = Store().Truncate(fork_id, 1, {});
  if (!cut.ok()) Fail("truncating a fork", cut.status());
  for (const int64_t kept : cut->lengths()) {
    if (kept > 1) Fail("a fork's length after Truncate(1)", absl::InternalError(std::to_string(kept)));
  }
  if (limit >= 2) Step(env, config, fork_id, 1);
}

}  // namespace
}  // namespace mha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  v1::CreateSessionRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  Count(Stage::kParsed);
  const absl::StatusOr<SessionConfig> config = ValidateCreateSession(request, env.context);
  if (!config.ok()) {
    CheckRefusal(config.status(), {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                   absl::StatusCode::kFailedPrecondition});
    return 0;
  }
  Count(Stage::kValid);
  // The id the client chose is checked before (session_service.cc's OneId); here one the store accepts.
  const std::string id = "fz";
  const absl::StatusOr<v1::SessionInfo> created = Store().Create(*config, id, {});
  if (!created.ok()) {
    CheckRefusal(created.status(), {absl::StatusCode::kInvalidArgument, absl::StatusCode::kResourceExhausted});
    return 0;
  }
  Live(env, *config, id, created->attached_tokens());
  Store().Close(id + "-fork", {}).IgnoreError();
  if (const absl::Status closed = Store().Close(id, {}); !closed.ok()) Fail("closing a session", closed);
  return 0;
}
