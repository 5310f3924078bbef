#include "server/sessions/validate_session.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/base/names.h"
#include "server/base/status_macros.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view a, absl::string_view b = "", absl::string_view c = "",
                     absl::string_view d = "") {
  return absl::InvalidArgumentError(absl::StrCat(a, b, c, d));
}

std::string Item(int i) { return absl::StrCat("items[", i, "]"); }

// ExtendItem.append: unset means true.
bool Appends(const v1::ExtendItem& item) { return !item.has_append() || item.append(); }

bool SameHeads(const HeadSpec& a, const HeadSpec& b) {
  return a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim &&
         a.scale == b.scale && a.rope_theta == b.rope_theta && a.rope_dim == b.rope_dim &&
         a.rope_interleaved == b.rope_interleaved && a.rope_scaling == b.rope_scaling;
}

// A present tensor's encoding and finite values.
absl::Status CheckInput(const v1::Tensor& t, absl::string_view field) {
  RETURN_IF_ERROR(CheckTensor(t, field).status());
  return CheckFinite(t, field);
}

// `t` has `rank` dims, the last ones `want` (their names in `names`).
absl::Status CheckShape(const v1::Tensor& t, absl::string_view field, std::vector<int64_t> want,
                        absl::string_view names) {
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  bool same = shape.size() == want.size() + 1;
  for (size_t d = 0; same && d < want.size(); ++d) same = shape[d + 1] == want[d];
  if (same) return absl::OkStatus();
  std::string expected = "[n";
  for (int64_t d : want) absl::StrAppend(&expected, ", ", d);
  return Invalid(field, absl::StrCat(".shape must be ", expected, "] ", names, ", got ", ShapeString(shape)));
}

// Item i's new tokens, checked against what its cache holds: the layer's width, or the heads' shapes.
absl::StatusOr<int64_t> NewTokens(const v1::ExtendItem& item, int i, const CacheView& view) {
  const std::string field = Item(i);
  if (view.layer_session != item.has_x()) {
    return Invalid(field, ": session '", item.session_id(),
                   view.layer_session ? "' is a layer session: send x [n, d_model]"
                                      : "' is a head session: send q, k and v, not x");
  }
  if (view.layer_session) {
    RETURN_IF_ERROR(CheckShape(item.x(), field + ".x", {view.layer.d_model},
                               absl::StrCat("(d_model of layer '", view.layer.name, "')")));
    return item.x().shape(0);
  }
  const HeadSpec& h = view.heads;
  RETURN_IF_ERROR(CheckShape(item.q(), field + ".q", {h.num_heads, h.head_dim}, "(n, H, d_k)"));
  const int64_t n = item.q().shape(0);
  for (const auto& [t, name] : {std::pair{&item.k(), ".k"}, std::pair{&item.v(), ".v"}}) {
    if (!Appends(item) && t->shape_size() == 0) continue;  // unused without append
    RETURN_IF_ERROR(CheckShape(*t, field + name, {h.num_kv_heads, h.head_dim}, "(n, Hkv, d_k)"));
    if (t->shape(0) != n) {
      return Invalid(field, name, absl::StrCat(".shape[0] (n) must be q's, ", n, ", got ", t->shape(0)));
    }
  }
  return n;
}

// The session-dependent checks of item i against item 0's cache: one layer or one head configuration, one dtype.
absl::Status SameCall(const v1::ExtendItem& item, int i, const CacheView& view, const CacheView& first) {
  const std::string field = Item(i);
  if (view.layer_session &&
      (view.layer.name != first.layer.name || view.layer.id != first.layer.id)) {
    return Invalid(field, ": session '", item.session_id(),
                   absl::StrCat("' has layer '", view.layer.name, "' at this layer_index, items[0]'s has '",
                                first.layer.name, "'; one call computes one layer"));
  }
  if (!view.layer_session && !SameHeads(view.heads, first.heads)) {
    return Invalid(field, ": session '", item.session_id(),
                   "' has another head configuration than items[0]'s; one call computes one configuration");
  }
  if (view.layout.dtype != first.layout.dtype) {
    return Invalid(field, ": session '", item.session_id(),
                   absl::StrCat("' caches ", DTypeName(view.layout.dtype), ", items[0]'s ",
                                DTypeName(first.layout.dtype), "; one call reads one cache dtype"));
  }
  return absl::OkStatus();
}

// The item's cache length against its expected_length and its max_tokens.
absl::Status CheckLength(const v1::ExtendItem& item, int i, const CacheView& view, int64_t n, int64_t layer_index) {
  if (item.has_expected_length() && item.expected_length() != view.length) {
    return absl::FailedPreconditionError(absl::StrCat(
        Item(i), ".expected_length is ", item.expected_length(), " but session '", item.session_id(), "' holds ",
        view.length, " tokens at layer_index ", layer_index, "; nothing was appended"));
  }
  if (!Appends(item)) {
    if (view.length == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          Item(i), ": append=false attends to the cache alone, and session '", item.session_id(),
          "' holds no tokens at layer_index ", layer_index));
    }
    return absl::OkStatus();
  }
  if (view.length + n > view.max_tokens) {
    return absl::OutOfRangeError(absl::StrCat(Item(i), ": session '", item.session_id(), "' holds ", view.length,
                                              " tokens at layer_index ", layer_index, ", and ", n,
                                              " more would pass its max_tokens (", view.max_tokens, ")"));
  }
  return absl::OkStatus();
}

// `field`[i] of `keys`, each 1..kMaxPrefixKeyBytes bytes.
absl::Status CheckPrefixKeyBytes(const google::protobuf::RepeatedPtrField<std::string>& keys,
                                 absl::string_view field) {
  for (int j = 0; j < keys.size(); ++j) {
    if (keys.Get(j).empty() || keys.Get(j).size() > kMaxPrefixKeyBytes) {
      return Invalid(absl::StrCat(field, "[", j, "] is ", keys.Get(j).size(), " bytes; a prefix key is 1..",
                                  kMaxPrefixKeyBytes, " bytes (mhaclient.prefix_keys makes 32-byte SHA-256 keys)"));
    }
  }
  return absl::OkStatus();
}

// An Extend item's prefix_keys: at most one per block its new tokens land in, and only when it appends.
absl::Status CheckItemPrefixKeys(const v1::ExtendItem& item, int i, const CacheView& view, int64_t n) {
  if (item.prefix_keys_size() == 0) return absl::OkStatus();
  const std::string field = Item(i) + ".prefix_keys";
  if (!Appends(item)) return Invalid(field, " names blocks the item fills; with append=false it fills none");
  const int64_t tb = view.layout.block_tokens;
  const int64_t blocks = (view.length + n + tb - 1) / tb - view.length / tb;
  if (item.prefix_keys_size() > blocks) {
    return Invalid(absl::StrCat(field, " has ", item.prefix_keys_size(), " keys; the item's ", n,
                                " tokens land in ", blocks, " block(s) of ", tb, " tokens, from block ",
                                view.length / tb, " (its cache holds ", view.length, ")"));
  }
  return CheckPrefixKeyBytes(item.prefix_keys(), field);
}

// FLOPs of the call: its items' ExtendFlops.
double CallFlops(const PagedProblem& p, absl::Span<const ExtendPlan::Item> items) {
  double flops = 0;
  for (const ExtendPlan::Item& item : items) {
    flops += ExtendFlops(p.heads, p.d_model, item.length, item.new_tokens, item.append);
  }
  return flops;
}

// CreateSessionRequest.layer_heads into *out: none, or one whole HeadConfig per cache whose layout fields are 0 or
// `heads`' (resolved).
absl::Status ResolveLayerHeads(const v1::CreateSessionRequest& r, const HeadSpec& heads, int64_t caches,
                               std::vector<HeadSpec>* out) {
  if (r.layer_heads_size() == 0) return absl::OkStatus();
  if (r.layer_heads_size() != caches) {
    return Invalid(absl::StrCat("layer_heads has ", r.layer_heads_size(), " entries; give one per cache (num_layers, ",
                                caches, ") or none"));
  }
  for (int i = 0; i < r.layer_heads_size(); ++i) {
    const std::string field = absl::StrCat("layer_heads[", i, "]");
    const v1::HeadConfig& c = r.layer_heads(i);
    const std::pair<int64_t, int64_t> layout[] = {{c.num_heads(), heads.num_heads},
                                                  {c.num_kv_heads(), heads.num_kv_heads},
                                                  {c.head_dim(), heads.head_dim}};
    const char* names[] = {"num_heads", "num_kv_heads", "head_dim"};
    for (int k = 0; k < 3; ++k) {
      if (layout[k].first != 0 && layout[k].first != layout[k].second) {
        return Invalid(absl::StrCat(field, ".", names[k], " is ", layout[k].first, "; it must be 0 or heads.",
                                    names[k], " (", layout[k].second, "): a session's caches share one layout"));
      }
    }
    v1::HeadConfig whole = c;
    whole.set_num_heads(static_cast<int32_t>(heads.num_heads));
    whole.set_num_kv_heads(static_cast<int32_t>(heads.num_kv_heads));
    whole.set_head_dim(static_cast<int32_t>(heads.head_dim));
    ASSIGN_OR_RETURN(HeadSpec resolved, ResolveHeads(whole, HeadSpec(), "", /*d_model=*/0, field));
    resolved.causal = true;
    out->push_back(resolved);
  }
  return absl::OkStatus();
}

// Whether `item`'s inputs (x, or q, k and v) differ in dtype from each other or from the first item's.
bool MixedInputs(const v1::ExtendItem& item, const v1::ExtendItem& first) {
  const v1::DataType want = first.has_x() ? first.x().dtype() : first.q().dtype();
  const std::pair<bool, const v1::Tensor*> inputs[] = {
      {item.has_x(), &item.x()}, {item.has_q(), &item.q()}, {item.has_k(), &item.k()}, {item.has_v(), &item.v()}};
  for (const auto& [present, t] : inputs) {
    if (present && t->dtype() != want) return true;
  }
  return false;
}

// Steps of calls with one key compute as one ragged paged call: what PagedArgs shares across its sequences. The
// layer_index does not enter it; each sequence brings its own cache.
std::string BatchKey(const ExtendPlan& plan) {
  const PagedProblem& p = plan.paged;
  return absl::StrCat(
      "extend|", reinterpret_cast<uintptr_t>(plan.backend), "|", reinterpret_cast<uintptr_t>(plan.layer.get()), "|",
      p.heads.num_heads, "|", p.heads.num_kv_heads, "|", p.heads.head_dim, "|",
      absl::bit_cast<uint32_t>(p.heads.scale), "|", RopeKey(p.heads), "|", p.cache.dtype, "|", p.cache.block_tokens,
      "|", p.input_dtype, p.mixed_inputs ? "+" : "", "|", p.output_dtype, "|", p.return_weights, "|",
      plan.stats.lse, plan.stats.head_stats, plan.stats.row_stats, "|", plan.stats.sink_tokens);
}

}  // namespace

absl::StatusOr<SessionConfig> ValidateCreateSession(const v1::CreateSessionRequest& r,
                                                    const ValidationContext& context) {
  SessionConfig config;
  const bool layers = r.layers_size() > 0;
  if (layers == r.has_heads()) {
    return Invalid(layers ? "set layers or heads, not both" : "layers or heads is required",
                   ": layers for a layer session (x in, the layer's output out), heads for a head session (q, k, v "
                   "in, the heads out)");
  }
  if (!v1::DataType_IsValid(r.cache_dtype())) {
    return Invalid("cache_dtype must be FP32, FP16, BF16, INT8, FP8_E4M3 or FP8_E5M2, got ",
                   absl::StrCat(r.cache_dtype()));
  }
  config.cache_dtype = r.cache_dtype() == v1::DATA_TYPE_UNSPECIFIED ? v1::FP32 : r.cache_dtype();
  if (r.max_tokens() < 0) return Invalid("max_tokens must be >= 0, got ", absl::StrCat(r.max_tokens()));
  config.max_tokens = r.max_tokens();
  if (r.idle_timeout_s() < 0) return Invalid("idle_timeout_s must be >= 0, got ", absl::StrCat(r.idle_timeout_s()));
  config.idle_timeout = absl::Seconds(r.idle_timeout_s());
  RETURN_IF_ERROR(CheckPrefixKeyBytes(r.prefix_keys(), "prefix_keys"));
  config.prefix_keys.assign(r.prefix_keys().begin(), r.prefix_keys().end());
  if (r.cache_salt().size() > kMaxCacheSaltBytes) {
    return Invalid(absl::StrCat("cache_salt is ", r.cache_salt().size(), " bytes; at most ", kMaxCacheSaltBytes));
  }
  config.cache_salt = r.cache_salt();
  if (layers) {
    if (r.num_layers() != 0) {
      return Invalid("num_layers is for head sessions; a layer session has one cache per entry of layers");
    }
    if (r.layers_size() > kMaxSessionCaches) {
      return Invalid(absl::StrCat("layers may name at most ", kMaxSessionCaches, " layers, got ", r.layers_size()));
    }
    for (int i = 0; i < r.layers_size(); ++i) {
      const std::string field = absl::StrCat("layers[", i, "]");
      RETURN_IF_ERROR(CheckName(r.layers(i), field));
      absl::StatusOr<std::shared_ptr<const Layer>> layer = context.layers->Get(r.layers(i));
      if (!layer.ok()) return absl::Status(layer.status().code(), absl::StrCat(field, ": ", layer.status().message()));
      const LayerShape& shape = (*layer)->shape;
      if (!shape.fused_qkv()) {
        return Invalid(field, absl::StrCat(": layer '", r.layers(i), "' projects keys from ", shape.d_kv_in,
                                           " and values from ", shape.d_v_in, " features; a layer session projects "
                                           "its x into q, k and v, so it needs d_kv_in = d_v_in = d_model (",
                                           shape.d_model, ")"));
      }
      SessionLayer entry{r.layers(i), (*layer)->id, shape.heads, shape.d_model};
      entry.heads.causal = true;
      config.layers.push_back(std::move(entry));
    }
    if (r.layer_heads_size() > 0) {
      return Invalid("layer_heads is for head sessions; a layer session's caches take their layers' configuration");
    }
    config.num_caches = r.layers_size();
    return config;
  }
  if (r.heads().head_dim() <= 0) return Invalid("heads.head_dim is required (>= 1) for a head session");
  ASSIGN_OR_RETURN(config.heads, ResolveHeads(r.heads(), HeadSpec(), "", /*d_model=*/0, "heads"));
  config.heads.causal = true;  // a cache holds earlier tokens only
  if (r.num_layers() < 0 || r.num_layers() > kMaxSessionCaches) {
    return Invalid(absl::StrCat("num_layers must be in [0, ", kMaxSessionCaches, "] (0 means 1), got ",
                                r.num_layers()));
  }
  config.num_caches = std::max(1, r.num_layers());
  RETURN_IF_ERROR(ResolveLayerHeads(r, config.heads, config.num_caches, &config.layer_heads));
  return config;
}

absl::StatusOr<std::vector<std::string>> ValidateExtendRequest(const v1::ExtendRequest& r, int max_items) {
  if (r.items_size() == 0) return Invalid("items must hold at least one session's new tokens");
  if (r.items_size() > max_items) {
    return absl::InvalidArgumentError(absl::StrCat("items: ", r.items_size(), " given; a call names at most ",
                                                   max_items, " sessions, as many as may be open (--max_sessions)"));
  }
  if (r.layer_index() < 0) return Invalid("layer_index must be >= 0, got ", absl::StrCat(r.layer_index()));
  if (IsCacheOnlyDType(r.output_dtype())) {
    return Invalid("output_dtype ", DTypeName(r.output_dtype()),
                   " is for KV caches only (CreateSessionRequest.cache_dtype); outputs are FP32, FP16 or BF16");
  }
  if (!v1::DataType_IsValid(r.output_dtype())) {
    return Invalid("output_dtype must be DATA_TYPE_UNSPECIFIED, FP32, FP16 or BF16, got ",
                   absl::StrCat(r.output_dtype()));
  }
  if (!v1::Backend_IsValid(r.backend())) {
    return Invalid("backend must be BACKEND_AUTO, BACKEND_CPU, BACKEND_CUDA or BACKEND_REFERENCE, got ",
                   absl::StrCat(r.backend()));
  }
  std::vector<std::string> ids;
  std::map<std::string, int> seen;
  const bool layer = r.items(0).has_x();
  for (int i = 0; i < r.items_size(); ++i) {
    const v1::ExtendItem& item = r.items(i);
    const std::string field = Item(i);
    RETURN_IF_ERROR(CheckName(item.session_id(), field + ".session_id"));
    if (const auto [it, fresh] = seen.emplace(item.session_id(), i); !fresh) {
      return Invalid(field, ".session_id repeats ", Item(it->second), "'s; each session at most once per call");
    }
    ids.push_back(item.session_id());
    const bool heads = item.has_q() || item.has_k() || item.has_v();
    if (item.has_x() == heads) {
      return Invalid(field, heads ? ": x (a layer session's input) and q, k, v (a head session's) exclude each other"
                                  : ": x (a layer session) or q, k and v (a head session) is required");
    }
    if (item.has_x() != layer) {
      return Invalid(field, ": every item of a call is for the same kind of session, and items[0]'s is ",
                     layer ? "a layer session's (x)" : "a head session's (q, k, v)");
    }
    if (layer) {
      RETURN_IF_ERROR(CheckInput(item.x(), field + ".x"));
      continue;
    }
    for (const auto& [has, t, name] : {std::tuple{item.has_q(), &item.q(), ".q"},
                                       std::tuple{item.has_k(), &item.k(), ".k"},
                                       std::tuple{item.has_v(), &item.v(), ".v"}}) {
      if (!has && !Appends(item) && t != &item.q()) continue;  // k and v are unused without append
      if (!has) return Invalid(field, name, " is required: a head session takes q, k and v");
      RETURN_IF_ERROR(CheckInput(*t, field + name));
    }
  }
  return ids;
}

absl::StatusOr<ExtendPlan> ValidateExtendHeld(const v1::ExtendRequest& r, const SessionStore& store,
                                              const SessionCaller& caller, const ValidationContext& context) {
  ExtendPlan plan;
  std::vector<CacheView> views;
  for (int i = 0; i < r.items_size(); ++i) {
    ASSIGN_OR_RETURN(CacheView view,
                     store.View(r.items(i).session_id(), r.layer_index(), caller, Item(i) + ".session_id"));
    views.push_back(std::move(view));
  }
  const CacheView& first = views.front();
  PagedProblem& p = plan.paged;
  p.heads = first.heads;
  p.cache = first.layout;
  for (int i = 0; i < r.items_size(); ++i) {
    const v1::ExtendItem& item = r.items(i);
    RETURN_IF_ERROR(SameCall(item, i, views[i], first));
    ASSIGN_OR_RETURN(const int64_t n, NewTokens(item, i, views[i]));
    RETURN_IF_ERROR(CheckLength(item, i, views[i], n, r.layer_index()));
    RETURN_IF_ERROR(CheckItemPrefixKeys(item, i, views[i], n));
    plan.items.push_back({&item, views[i].length, n, Appends(item)});
    plan.reserve.push_back({item.session_id(), r.layer_index(), Appends(item) ? n : 0, caller.owner,
                            {item.prefix_keys().begin(), item.prefix_keys().end()}});
    const v1::DataType dtype = item.has_x() ? item.x().dtype() : item.q().dtype();
    if (p.input_dtype == v1::FP32 && dtype != v1::FP32) p.input_dtype = dtype;
    p.mixed_inputs |= MixedInputs(item, r.items(0));
    p.sequences += 1;
    p.new_tokens += n;
    p.max_new_tokens = std::max(p.max_new_tokens, n);
    p.max_length = std::max(p.max_length, views[i].length + (Appends(item) ? n : 0));
  }
  if (first.layer_session) {
    absl::StatusOr<std::shared_ptr<const Layer>> layer = context.layers->Get(first.layer.name);
    if (!layer.ok() || (*layer)->id != first.layer.id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer '", first.layer.name, "' was ", layer.ok() ? "replaced" : "unloaded", " after session '",
          r.items(0).session_id(), "' was created; its cache holds keys and values of the old weights"));
    }
    plan.layer = *std::move(layer);
    p.d_model = first.layer.d_model;
  }
  const v1::ExtendItem& item0 = r.items(0);
  p.output_dtype = r.output_dtype() != v1::DATA_TYPE_UNSPECIFIED ? r.output_dtype()
                   : item0.has_x()                                 ? item0.x().dtype()
                                                                   : item0.q().dtype();
  p.return_weights = r.return_attention_weights();
  ASSIGN_OR_RETURN(plan.stats, ValidateStats(r.return_lse(), r.return_head_stats(), r.sink_tokens(),
                                             r.return_row_stats()));
  p.return_stats = plan.stats.any();
  ASSIGN_OR_RETURN(plan.backend, ChooseBackend(r.backend(), context,
                                               [&p](const Backend& backend) { return backend.SupportsPaged(p); }));

  // The response, the work and the working memory against the server's limits.
  const int64_t out_width = p.d_model > 0 ? p.d_model : p.heads.q_width();
  double response_bytes = 4096;
  for (const ExtendPlan::Item& item : plan.items) {
    response_bytes += 64 + static_cast<double>(item.new_tokens) * out_width * DTypeSize(p.output_dtype);
    if (p.return_weights) {
      response_bytes += static_cast<double>(p.heads.num_heads) * item.new_tokens *
                        (item.length + (item.append ? item.new_tokens : 0)) * DTypeSize(p.output_dtype);
    }
    response_bytes += plan.stats.ResponseBytes(p.heads.num_heads, item.new_tokens);
  }
  plan.response_bytes = static_cast<int64_t>(std::min(response_bytes, 9e18));
  if (response_bytes > static_cast<double>(context.max_message_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would be about ", plan.response_bytes, " bytes, over the server's ", context.max_message_bytes,
        "-byte message limit (--max_message_mb); ask for output_dtype FP16",
        p.return_weights ? ", return_attention_weights=false" : "", " or fewer tokens per call"));
  }
  plan.flops = CallFlops(p, plan.items);
  plan.workspace_bytes =
      plan.backend->PagedWorkspaceBytes(p) + plan.stats.WorkspaceBytes(p.heads.num_heads, p.new_tokens);
  RETURN_IF_ERROR(CheckWorkLimits(plan, context));

  // What the scheduler sees of the call.
  AttentionShape& s = plan.problem.shape;
  s.batch = p.sequences;
  s.q_len = p.max_new_tokens;
  s.kv_len = p.max_length;
  s.d_model = s.d_kv_in = s.d_v_in = p.d_model;
  s.heads = p.heads;
  plan.problem.input_dtype = p.input_dtype;
  plan.problem.mixed_inputs = p.mixed_inputs;
  plan.problem.output_dtype = p.output_dtype;
  plan.problem.return_weights = p.return_weights;
  plan.batch_key = BatchKey(plan);
  plan.shapes = absl::StrCat("items=", p.sequences, " tokens=", p.new_tokens, " max_length=", p.max_length,
                             " layer_index=", r.layer_index(),
                             first.layer_session ? absl::StrCat(" layer=", first.layer.name)
                                                 : absl::StrCat(" H=", p.heads.num_heads, " Hkv=", p.heads.num_kv_heads,
                                                                " d_k=", p.heads.head_dim),
                             " cache=", DTypeName(p.cache.dtype), " session=", item0.session_id());
  return plan;
}

}  // namespace mha
