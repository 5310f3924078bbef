// A serialized ExtendRequest through what the server does with it (session_service.cc): parse, validate what the
// request says by itself, find (or here, create) its sessions, then fuzz_extend.h's steps: validate against
// them, reserve blocks, and when small compute on the reference and the CPU backend. Sessions persist from input to
// input in one store with a small pool, so that inputs meet caches of every length, shared blocks and evictions. A
// session is made on first use by its id's first letter: "L" a layer session over "tiny", "b" a head session with a
// bf16 cache, "f" one with fp16, "i" INT8 with RoPE, "4" FP8 E4M3 with RoPE, "5" FP8 E5M2 with RoPE, else fp32 with
// RoPE (fuzz_seeds.cc writes requests against them). Findings: sanitizer reports, an error code the contract does
// not name for a step, results that do not match their items.
#include <string>
#include <vector>

#include "server/sessions/session_store.h"
#include "server/sessions/validate_session.h"
#include "tests/fuzz/fuzz_env.h"
#include "tests/fuzz/fuzz_extend.h"

namespace mha::fuzz {
namespace {

SessionStore& Store() {
  static SessionStore* store = [] {
    SessionStoreOptions options;
    options.capacity_bytes = 8 << 20;
    options.block_tokens = 16;
    options.max_sessions = 64;
    options.max_tokens = 2048;
    return new SessionStore(options, nullptr);
  }();
  return *store;
}

// The cache dtype of a head session whose id starts with `letter`.
v1::DataType CacheDtype(char letter) {
  switch (letter) {
    case 'b': return v1::BF16;
    case 'f': return v1::FP16;
    case 'i': return v1::INT8;
    case '4': return v1::FP8_E4M3;
    case '5': return v1::FP8_E5M2;
    default: return v1::FP32;
  }
}

// Creates session `id` when it does not exist (and may be made), as the first-letter rule says.
void Ensure(const Env& env, const std::string& id) {
  if (Store().View(id, 0, {}, "session_id").ok()) return;
  v1::CreateSessionRequest create;
  if (id[0] == 'L') {
    create.add_layers("tiny");
  } else {
    create.mutable_heads()->set_num_heads(2);
    create.mutable_heads()->set_num_kv_heads(1);
    create.mutable_heads()->set_head_dim(4);
    if (id[0] != 'b' && id[0] != 'f') create.mutable_heads()->set_rope_theta(10000);
    create.set_cache_dtype(CacheDtype(id[0]));
    create.set_num_layers(2);
  }
  absl::StatusOr<SessionConfig> config = ValidateCreateSession(create, env.context);
  if (!config.ok()) Fail("a fuzz session's config", config.status());
  const absl::Status created = Store().Create(*config, id, {}).status();
  if (!created.ok() && created.code() != absl::StatusCode::kResourceExhausted) Fail("creating a session", created);
}

}  // namespace
}  // namespace mha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  const Env& env = GetEnv();
  v1::ExtendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  Count(Stage::kParsed);
  absl::StatusOr<std::vector<std::string>> ids = ExtendIds(request);
  if (!ids.ok()) return 0;
  for (const std::string& id : *ids) Ensure(env, id);
  const absl::StatusOr<ExtendPlan> plan = ValidateStep(env, Store(), request);
  if (plan.ok()) {
    Count(Stage::kValid);
    ComputeStep(env, Store(), *plan);
  }
  // Keep the caches short, so that later inputs still fit: every session of the call cut back to under 64 tokens.
  for (const std::string& id : *ids) Store().Truncate(id, static_cast<int64_t>(size % 64), {}).IgnoreError();
  return 0;
}
