#include "proto/mha/v1/attention_shape.h"

#include <algorithm>
#include <cmath>

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
  return absl::OkStatus();
}

}  // namespace

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
  return c;
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
    absl::StrAppend(&text, " rope=", h.rope_theta, "/", h.rope_dim, h.rope_interleaved ? "/interleaved" : "");
  }
  return text;
}

}  // namespace mha
