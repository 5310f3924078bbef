#include "proto/mha/v1/attention_shape.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view name, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ".", name, message));
}

// A config field given as `given` must agree with what `known` fixes (0 = nothing fixed).
template <typename T>
absl::Status Agree(absl::string_view field, absl::string_view name, T given, T known, absl::string_view from) {
  if (given == T{0} || known == T{0} || given == known) return absl::OkStatus();
  return Invalid(field, name, absl::StrCat(" is ", given, ", which disagrees with ", from, " (", known,
                                           "); leave it 0 to use that value"));
}

constexpr RopeScaling::Type kRopeTypes[] = {RopeScaling::Type::kDefault, RopeScaling::Type::kLinear,
                                           RopeScaling::Type::kDynamic, RopeScaling::Type::kYarn,
                                           RopeScaling::Type::kLongrope, RopeScaling::Type::kLlama3};

// Which of RopeScaling's optional fields a rope_type reads; the rest must be left 0.
struct RopeFieldUse {
  bool factor, original, max, freq_factors, yarn, attention_factor, lists;
};
RopeFieldUse UseOf(RopeScaling::Type t) {
  using T = RopeScaling::Type;
  return {t != T::kDefault, t == T::kYarn || t == T::kLongrope || t == T::kLlama3,
          t == T::kDynamic || t == T::kYarn || t == T::kLongrope, t == T::kLlama3, t == T::kYarn,
          t == T::kYarn || t == T::kLongrope, t == T::kLongrope};
}

// A field the type does not read, set: its name (else empty).
std::string UnreadField(const v1::RopeScaling& r, const RopeFieldUse& use) {
  const std::pair<bool, const char*> fields[] = {
      {!use.factor && r.factor() != 0, "factor"},
      {!use.original && r.original_max_position_embeddings() != 0, "original_max_position_embeddings"},
      {!use.max && r.max_position_embeddings() != 0, "max_position_embeddings"},
      {!use.freq_factors && r.low_freq_factor() != 0, "low_freq_factor"},
      {!use.freq_factors && r.high_freq_factor() != 0, "high_freq_factor"},
      {!use.yarn && r.beta_fast() != 0, "beta_fast"},
      {!use.yarn && r.beta_slow() != 0, "beta_slow"},
      {!use.yarn && r.mscale() != 0, "mscale"},
      {!use.yarn && r.mscale_all_dim() != 0, "mscale_all_dim"},
      {!use.yarn && r.has_truncate(), "truncate"},
      {!use.attention_factor && r.attention_factor() != 0, "attention_factor"},
      {!use.lists && r.short_factor_size() != 0, "short_factor"},
      {!use.lists && r.long_factor_size() != 0, "long_factor"},
  };
  for (const auto& [set, name] : fields) {
    if (set) return name;
  }
  return "";
}

// The numbers of `r` that every type reads alike: finite, and within their ranges when set.
absl::Status CheckRopeNumbers(const v1::RopeScaling& r, absl::string_view field) {
  const std::pair<double, const char*> positive_or_zero[] = {
      {r.factor(), "factor"},       {r.low_freq_factor(), "low_freq_factor"},
      {r.beta_fast(), "beta_fast"}, {r.beta_slow(), "beta_slow"},
      {r.attention_factor(), "attention_factor"}};
  for (const auto& [value, name] : positive_or_zero) {
    if (!std::isfinite(value) || value < 0) {
      return Invalid(field, name, absl::StrCat(" must be finite and >= 0, got ", value));
    }
  }
  for (const auto& [value, name] : {std::pair<double, const char*>{r.high_freq_factor(), "high_freq_factor"},
                                    {r.mscale(), "mscale"}, {r.mscale_all_dim(), "mscale_all_dim"}}) {
    if (!std::isfinite(value)) return Invalid(field, name, absl::StrCat(" must be finite, got ", value));
  }
  for (const auto& [value, name] : {std::pair<int64_t, const char*>{r.original_max_position_embeddings(),
                                                                    "original_max_position_embeddings"},
                                    {r.max_position_embeddings(), "max_position_embeddings"}}) {
    if (value < 0) return Invalid(field, name, absl::StrCat(" must be >= 0, got ", value));
  }
  return absl::OkStatus();
}

// What a type requires, over CheckRopeNumbers; `pairs` = rope_dim / 2.
absl::Status CheckRopeRequired(const v1::RopeScaling& r, RopeScaling::Type t, int64_t pairs, absl::string_view field) {
  using T = RopeScaling::Type;
  const std::string type = absl::StrCat(" (rope_type '", RopeTypeName(t), "')");
  if ((t == T::kLinear || t == T::kDynamic || t == T::kLlama3) && r.factor() == 0) {
    return Invalid(field, "factor", absl::StrCat(" is required", type, " and must be > 0"));
  }
  if (UseOf(t).original && r.original_max_position_embeddings() == 0) {
    return Invalid(field, "original_max_position_embeddings", absl::StrCat(" is required", type));
  }
  if (t == T::kDynamic && r.max_position_embeddings() == 0) {
    return Invalid(field, "max_position_embeddings", absl::StrCat(" is required", type));
  }
  if (t == T::kDynamic && pairs < 2) {  // its base's exponent is rope_dim / (rope_dim - 2)
    return Invalid(field, "rope_type", absl::StrCat(" 'dynamic' needs rope_dim >= 4, got ", 2 * pairs));
  }
  if ((t == T::kYarn || t == T::kLongrope) && r.factor() == 0 && r.max_position_embeddings() == 0) {
    return Invalid(field, "factor", absl::StrCat(" is 0, so max_position_embeddings is required", type,
                                                 ": the factor is then max_position_embeddings / "
                                                 "original_max_position_embeddings"));
  }
  if (t == T::kLlama3 && (r.low_freq_factor() <= 0 || r.high_freq_factor() <= r.low_freq_factor())) {
    return Invalid(field, r.low_freq_factor() <= 0 ? "low_freq_factor" : "high_freq_factor",
                   absl::StrCat(" must satisfy 0 < low_freq_factor < high_freq_factor", type, ", got ",
                                r.low_freq_factor(), " and ", r.high_freq_factor()));
  }
  if (t != T::kLongrope) return absl::OkStatus();
  for (const auto& [list, name] : {std::pair{&r.short_factor(), "short_factor"}, {&r.long_factor(), "long_factor"}}) {
    if (list->size() != pairs) {
      return Invalid(field, name, absl::StrCat(" must hold rope_dim / 2 = ", pairs, " values", type, ", got ",
                                               list->size()));
    }
    for (int i = 0; i < list->size(); ++i) {
      if (!std::isfinite(list->Get(i)) || list->Get(i) <= 0) {
        return Invalid(field, absl::StrCat(name, "[", i, "]"), absl::StrCat(" must be finite and > 0, got ",
                                                                            list->Get(i)));
      }
    }
  }
  return absl::OkStatus();
}

// HeadConfig.rope_scaling into *out, for rope_dim (0: no RoPE). Errors name `field`.rope_scaling.<name>.
absl::Status ResolveRopeScaling(const v1::RopeScaling& r, int64_t rope_dim, absl::string_view parent,
                                RopeScaling* out) {
  const std::string field = absl::StrCat(parent, ".rope_scaling");
  const std::string& name = r.rope_type();
  const auto* type = std::find_if(std::begin(kRopeTypes), std::end(kRopeTypes),
                                  [&](RopeScaling::Type t) { return name == RopeTypeName(t); });
  if (!name.empty() && type == std::end(kRopeTypes)) {
    return Invalid(field, "rope_type", absl::StrCat(" must be one of default, linear, dynamic, yarn, longrope, "
                                                    "llama3 (transformers' names), got '", name, "'"));
  }
  const RopeScaling::Type t = name.empty() ? RopeScaling::Type::kDefault : *type;
  if (const std::string unread = UnreadField(r, UseOf(t)); !unread.empty()) {
    return Invalid(field, unread, absl::StrCat(" is set, but rope_type '", RopeTypeName(t), "' does not read it"));
  }
  if (t != RopeScaling::Type::kDefault && rope_dim == 0) {
    return Invalid(field, "rope_type", absl::StrCat(" is '", name, "' but rope_theta is 0 (no RoPE)"));
  }
  if (auto s = CheckRopeNumbers(r, field); !s.ok()) return s;
  if (auto s = CheckRopeRequired(r, t, rope_dim / 2, field); !s.ok()) return s;
  RopeScaling& o = *out;
  o.type = t;
  o.factor = r.factor();
  o.original_max_position_embeddings = r.original_max_position_embeddings();
  o.max_position_embeddings = r.max_position_embeddings();
  o.low_freq_factor = r.low_freq_factor();
  o.high_freq_factor = r.high_freq_factor();
  o.beta_fast = r.beta_fast() != 0 ? r.beta_fast() : 32.0;  // transformers: `or 32`, `or 1`
  o.beta_slow = r.beta_slow() != 0 ? r.beta_slow() : 1.0;
  o.attention_factor = r.attention_factor();
  o.mscale = r.mscale();
  o.mscale_all_dim = r.mscale_all_dim();
  o.truncate = !r.has_truncate() || r.truncate();
  o.short_factor.assign(r.short_factor().begin(), r.short_factor().end());
  o.long_factor.assign(r.long_factor().begin(), r.long_factor().end());
  return absl::OkStatus();
}

// What finite fields can still make infinite in the scaled frequencies (server/backends/rope_frequencies.cc computes
// them as transformers does): yarn's ramp divides by log(rope_theta), its mscale ratio by
// 0.1 mscale_all_dim log(factor) + 1, and longrope's default attention factor by log(original).
absl::Status CheckRopeDivisors(const HeadSpec& h, absl::string_view field) {
  using T = RopeScaling::Type;
  const RopeScaling& r = h.rope_scaling;
  const double factor = r.Factor();
  if (r.type == T::kYarn && h.rope_theta == 1.0) {
    return Invalid(field, "rope_theta", " must not be 1 with rope_type 'yarn' (its ramp divides by log(rope_theta))");
  }
  const std::string scaling = absl::StrCat(field, ".rope_scaling");
  if (r.type == T::kYarn && r.attention_factor == 0 && r.mscale != 0 && r.mscale_all_dim != 0 &&
      YarnMscale(factor, r.mscale_all_dim) == 0.0) {
    return Invalid(scaling, "mscale_all_dim", " makes the attention factor's divisor 0.1 mscale_all_dim "
                   "log(factor) + 1 zero; set attention_factor or another mscale_all_dim");
  }
  if (r.type == T::kLongrope && r.attention_factor == 0 && factor > 1 && r.original_max_position_embeddings == 1) {
    return Invalid(scaling, "original_max_position_embeddings", " must be > 1 with rope_type 'longrope' and factor > 1 "
                   "unless attention_factor is set (its default divides by log(original_max_position_embeddings))");
  }
  return absl::OkStatus();
}

// The rope fields of `c` over what `known` fixes, into *h (whose head_dim is resolved).
absl::Status ResolveRope(const v1::HeadConfig& c, const HeadSpec& known, absl::string_view known_from,
                         absl::string_view field, HeadSpec* h) {
  if (!std::isfinite(c.rope_theta()) || c.rope_theta() < 0) {
    return Invalid(field, "rope_theta", absl::StrCat(" must be finite and >= 0 (0 = no RoPE), got ", c.rope_theta()));
  }
  if (c.rope_dim() < 0) return Invalid(field, "rope_dim", absl::StrCat(" must be >= 0, got ", c.rope_dim()));
  if (auto s = Agree<double>(field, "rope_theta", c.rope_theta(), known.rope_theta, known_from); !s.ok()) return s;
  if (auto s = Agree<int64_t>(field, "rope_dim", c.rope_dim(), known.rope_dim, known_from); !s.ok()) return s;
  h->rope_theta = known.rope_theta != 0 ? known.rope_theta : c.rope_theta();
  h->rope_interleaved = known.rope_interleaved || c.rope_interleaved();
  if (!h->has_rope()) {
    RopeScaling unused;  // a scaled type refused for want of RoPE; the default type's fields checked all the same
    if (c.has_rope_scaling()) {
      if (auto s = ResolveRopeScaling(c.rope_scaling(), 0, field, &unused); !s.ok()) return s;
    }
    if (c.rope_dim() != 0 || c.rope_interleaved()) {
      return Invalid(field, c.rope_dim() != 0 ? "rope_dim" : "rope_interleaved",
                     " is set but rope_theta is 0 (no RoPE); set rope_theta to rotate");
    }
    return absl::OkStatus();
  }
  h->rope_dim = known.rope_dim != 0 ? known.rope_dim : c.rope_dim() != 0 ? c.rope_dim() : h->head_dim;
  if (h->rope_dim % 2 != 0 || h->rope_dim > h->head_dim) {
    return Invalid(field, "rope_dim",
                   absl::StrCat(" (", h->rope_dim, c.rope_dim() == 0 && known.rope_dim == 0 ? ", from head_dim" : "",
                                ") must be even and at most head_dim (", h->head_dim, ")"));
  }
  if (!c.has_rope_scaling()) {
    h->rope_scaling = known.rope_scaling;
    return absl::OkStatus();
  }
  RopeScaling given;
  if (auto s = ResolveRopeScaling(c.rope_scaling(), h->rope_dim, field, &given); !s.ok()) return s;
  if (known.rope_scaling.scaled() && given != known.rope_scaling) {
    return Invalid(field, "rope_scaling",
                   absl::StrCat(" (", RopeTypeName(given.type), ") disagrees with ", known_from, " (",
                                RopeTypeName(known.rope_scaling.type), "); leave it unset to use that"));
  }
  h->rope_scaling = known.rope_scaling.scaled() ? known.rope_scaling : given;
  return CheckRopeDivisors(*h, field);
}

}  // namespace

const char* RopeTypeName(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::kLinear: return "linear";
    case RopeScaling::Type::kDynamic: return "dynamic";
    case RopeScaling::Type::kYarn: return "yarn";
    case RopeScaling::Type::kLongrope: return "longrope";
    case RopeScaling::Type::kLlama3: return "llama3";
    case RopeScaling::Type::kDefault: break;
  }
  return "default";
}

bool RopeScaling::operator==(const RopeScaling& o) const {
  return type == o.type && factor == o.factor &&
         original_max_position_embeddings == o.original_max_position_embeddings &&
         max_position_embeddings == o.max_position_embeddings && low_freq_factor == o.low_freq_factor &&
         high_freq_factor == o.high_freq_factor && beta_fast == o.beta_fast && beta_slow == o.beta_slow &&
         attention_factor == o.attention_factor && mscale == o.mscale && mscale_all_dim == o.mscale_all_dim &&
         truncate == o.truncate && short_factor == o.short_factor && long_factor == o.long_factor;
}

absl::StatusOr<HeadSpec> ResolveHeads(const v1::HeadConfig& c, const HeadSpec& known, absl::string_view known_from,
                                      int64_t d_model, absl::string_view field) {
  if (auto s = Agree<int64_t>(field, "num_heads", c.num_heads(), known.num_heads, known_from); !s.ok()) return s;
  if (auto s = Agree<int64_t>(field, "num_kv_heads", c.num_kv_heads(), known.num_kv_heads, known_from); !s.ok()) {
    return s;
  }
  if (auto s = Agree<int64_t>(field, "head_dim", c.head_dim(), known.head_dim, known_from); !s.ok()) return s;
  if (!std::isfinite(c.scale())) return Invalid(field, "scale", absl::StrCat(" must be finite, got ", c.scale()));
  if (auto s = Agree<float>(field, "scale", c.scale(), known.scale, known_from); !s.ok()) return s;

  HeadSpec h;
  h.num_heads = known.num_heads != 0 ? known.num_heads : c.num_heads();
  if (h.num_heads <= 0) return Invalid(field, "num_heads", absl::StrCat(" must be >= 1, got ", h.num_heads));
  if (c.num_kv_heads() < 0) {
    return Invalid(field, "num_kv_heads",
                   absl::StrCat(" must be >= 0 (0 means num_heads), got ", c.num_kv_heads()));
  }
  h.num_kv_heads = known.num_kv_heads != 0 ? known.num_kv_heads
                   : c.num_kv_heads() != 0 ? c.num_kv_heads()
                                           : h.num_heads;
  if (h.num_kv_heads > h.num_heads || h.num_heads % h.num_kv_heads != 0) {
    return Invalid(field, "num_kv_heads",
                   absl::StrCat(" (", h.num_kv_heads, ") must divide num_heads (", h.num_heads, ")"));
  }
  if (c.head_dim() < 0) {
    return Invalid(field, "head_dim",
                   absl::StrCat(" must be >= 0 (0 means d_model / num_heads), got ", c.head_dim()));
  }
  if (known.head_dim != 0) {
    h.head_dim = known.head_dim;
  } else if (c.head_dim() != 0) {
    h.head_dim = c.head_dim();
  } else {
    if (d_model % h.num_heads != 0) {
      return Invalid(field, "head_dim",
                     absl::StrCat(" is 0, so d_model (", d_model, ") must be divisible by num_heads (", h.num_heads,
                                  "); set head_dim explicitly otherwise"));
    }
    h.head_dim = d_model / h.num_heads;
  }
  if (h.head_dim <= 0) return Invalid(field, "head_dim", absl::StrCat(" must be >= 1, got ", h.head_dim));
  const float scale = known.scale != 0.0f ? known.scale : c.scale();
  h.scale = scale != 0.0f ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(h.head_dim)));
  h.causal = known.causal || c.causal();
  if (auto s = ResolveRope(c, known, known_from, field, &h); !s.ok()) return s;
  return h;
}

v1::HeadConfig HeadConfigOf(const HeadSpec& heads) {
  v1::HeadConfig c;
  c.set_num_heads(static_cast<int32_t>(heads.num_heads));
  c.set_num_kv_heads(static_cast<int32_t>(heads.num_kv_heads));
  c.set_head_dim(static_cast<int32_t>(heads.head_dim));
  c.set_causal(heads.causal);
  c.set_scale(heads.scale);
  c.set_rope_theta(heads.rope_theta);
  c.set_rope_dim(static_cast<int32_t>(heads.rope_dim));
  c.set_rope_interleaved(heads.rope_interleaved);
  const RopeScaling& r = heads.rope_scaling;
  if (r.scaled()) {
    v1::RopeScaling* w = c.mutable_rope_scaling();
    w->set_rope_type(RopeTypeName(r.type));
    w->set_factor(r.factor);
    w->set_original_max_position_embeddings(static_cast<int32_t>(r.original_max_position_embeddings));
    w->set_max_position_embeddings(static_cast<int32_t>(r.max_position_embeddings));
    w->set_low_freq_factor(r.low_freq_factor);
    w->set_high_freq_factor(r.high_freq_factor);
    w->set_attention_factor(r.attention_factor);
    if (r.type == RopeScaling::Type::kYarn) {  // the fields only yarn reads
      w->set_beta_fast(r.beta_fast);
      w->set_beta_slow(r.beta_slow);
      w->set_mscale(r.mscale);
      w->set_mscale_all_dim(r.mscale_all_dim);
      w->set_truncate(r.truncate);
    }
    for (double f : r.short_factor) w->add_short_factor(f);
    for (double f : r.long_factor) w->add_long_factor(f);
  }
  return c;
}

std::string RopeKey(const HeadSpec& heads) {
  if (!heads.has_rope()) return "none";
  return absl::StrCat(absl::bit_cast<uint64_t>(heads.rope_theta), "/", heads.rope_dim, "/", heads.rope_interleaved,
                      "/", heads.rope_scaling.scaled() ? HeadConfigOf(heads).rope_scaling().SerializeAsString() : "");
}

double VisiblePairs(const AttentionShape& s) {
  const double tq = static_cast<double>(s.q_len), tk = static_cast<double>(s.kv_len);
  if (!s.heads.causal) return tq * tk;
  // Row i sees min(Tk, max(0, i + Tk - Tq + 1)) keys; the upper bound never binds for i < Tq. Summed, that is
  // m(m + 1)/2 - (first - 1) first / 2 over the visible counts first..Tk with first = max(1, Tk - Tq + 1).
  const double first = std::max(1.0, tk - tq + 1.0);
  return (tk * (tk + 1.0) - (first - 1.0) * first) / 2.0;
}

namespace {

// The projections of `q_rows` query rows (Q and the output) and `kv_rows` key/value rows (K and V) of one item.
double ProjectionFlops(const HeadSpec& h, double q_rows, double kv_rows, int64_t d_model, int64_t d_kv_in,
                       int64_t d_v_in) {
  const double qw = static_cast<double>(h.q_width()), kvw = static_cast<double>(h.kv_width());
  return 2 * q_rows * static_cast<double>(d_model) * qw + 2 * kv_rows * static_cast<double>(d_kv_in + d_v_in) * kvw +
         2 * q_rows * qw * static_cast<double>(d_model);
}

// Q K^T and P V over the visible pairs of one item.
double CoreFlops(const AttentionShape& s) {
  return 4 * static_cast<double>(s.heads.num_heads) * static_cast<double>(s.heads.head_dim) * VisiblePairs(s);
}

}  // namespace

double AttentionFlops(const AttentionShape& s) {
  const double b = static_cast<double>(s.batch);
  return b * (ProjectionFlops(s.heads, static_cast<double>(s.q_len), static_cast<double>(s.kv_len), s.d_model,
                              s.d_kv_in, s.d_v_in) +
              CoreFlops(s));
}

double ExtendFlops(const HeadSpec& heads, int64_t d_model, int64_t cached, int64_t new_tokens, bool append) {
  AttentionShape s;
  s.batch = 1;
  s.q_len = new_tokens;
  s.kv_len = cached + (append ? new_tokens : 0);
  s.heads = heads;
  s.heads.causal = append;  // appended tokens see the cache and those before them; otherwise the whole cache
  const double n = static_cast<double>(new_tokens);
  return ProjectionFlops(heads, n, n, d_model, d_model, d_model) + CoreFlops(s);
}

double KvCacheBytes(const HeadSpec& heads, int64_t tokens, int64_t element_bytes) {
  return 2.0 * static_cast<double>(heads.kv_width()) * static_cast<double>(tokens) *
         static_cast<double>(element_bytes);
}

double KvCacheBytes(const HeadSpec& heads, int64_t tokens, int cache_dtype, int64_t block_tokens) {
  if (!IsCacheOnlyDType(cache_dtype)) return KvCacheBytes(heads, tokens, static_cast<int64_t>(DTypeSize(cache_dtype)));
  const int64_t d = heads.head_dim, depth = (d + 1) / 2 * 2, padded = (block_tokens + 3) / 4 * 4;
  const double head_block = static_cast<double>(depth * block_tokens + 2 * depth + padded * d + 2 * padded);
  return head_block / static_cast<double>(block_tokens) * static_cast<double>(heads.num_kv_heads * tokens);
}

std::string AttentionShapeString(const AttentionShape& s) {
  const HeadSpec& h = s.heads;
  std::string text = absl::StrCat("B=", s.batch, " Tq=", s.q_len, " Tk=", s.kv_len);
  if (s.has_projections()) {
    absl::StrAppend(&text, " d_model=", s.d_model, s.d_kv_in != s.d_model ? absl::StrCat(" d_kv=", s.d_kv_in) : "",
                    s.d_v_in != s.d_kv_in ? absl::StrCat(" d_v=", s.d_v_in) : "");
  }
  absl::StrAppend(&text, " H=", h.num_heads, " Hkv=", h.num_kv_heads, " d_k=", h.head_dim,
                  h.causal ? " causal" : "");
  if (h.has_rope()) {
    absl::StrAppend(&text, " rope=", h.rope_theta, "/", h.rope_dim, h.rope_interleaved ? "/interleaved" : "",
                    h.rope_scaling.scaled() ? absl::StrCat("/", RopeTypeName(h.rope_scaling.type)) : "");
  }
  return text;
}

}  // namespace mha
