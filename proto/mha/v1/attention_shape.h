// The resolved shape of one attention call, shared by the server, its backends and the clients: every
// "0 means default" of the wire's HeadConfig decided, once, by ResolveHeads; and what a call costs, defined once:
// its FLOPs (AttentionFlops for a stateless call, ExtendFlops for a session's item) and the bytes of K/V a cache
// holds (KvCacheBytes, what a decode step reads). The scheduler, the metrics, the clients and the benchmarks all
// count with these.
#ifndef MHA_PROTO_ATTENTION_SHAPE_H_
#define MHA_PROTO_ATTENTION_SHAPE_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/mha/v1/attention.pb.h"

namespace mha {

// HeadConfig.rope_scaling resolved (the proto documents each field): the defaults that depend on nothing else
// filled in (beta_fast 32, beta_slow 1, truncate true); factor, attention_factor and original_max_position_embeddings
// as given (0 = derived when the frequencies are computed: server/backends/rope_frequencies.h).
struct RopeScaling {
  enum class Type { kDefault, kLinear, kDynamic, kYarn, kLongrope, kLlama3 };
  Type type = Type::kDefault;
  double factor = 0.0;
  int64_t original_max_position_embeddings = 0;
  int64_t max_position_embeddings = 0;
  double low_freq_factor = 0.0, high_freq_factor = 0.0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double attention_factor = 0.0;
  double mscale = 0.0, mscale_all_dim = 0.0;
  bool truncate = true;
  std::vector<double> short_factor, long_factor;

  bool scaled() const { return type != Type::kDefault; }
  // Whether the frequencies depend on the sequence's length (dynamic, and longrope's switch).
  bool length_dependent() const { return type == Type::kDynamic || type == Type::kLongrope; }
  // The factor, or where it is 0 (yarn and longrope's default) max_position_embeddings /
  // original_max_position_embeddings.
  double Factor() const {
    return factor != 0 ? factor
                       : static_cast<double>(max_position_embeddings) /
                             static_cast<double>(original_max_position_embeddings);
  }
  bool operator==(const RopeScaling& o) const;
  bool operator!=(const RopeScaling& o) const { return !(*this == o); }
};

// YaRN's mscale (the paper's Eq. 21): 0.1 mscale ln(scale) + 1, or 1 for scale <= 1.
inline double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// "default", "linear", "dynamic", "yarn", "longrope", "llama3".
const char* RopeTypeName(RopeScaling::Type type);

// A head configuration with every default resolved: num_heads >= 1, num_kv_heads divides it, head_dim >= 1,
// scale finite and non-zero.
struct HeadSpec {
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // Hkv
  int64_t head_dim = 0;      // d_k
  bool causal = false;       // bottom-right aligned: query i sees key j iff j <= i + (Tk - Tq)
  float scale = 0.0f;        // multiplies q.k
  // Rotary position embeddings (HeadConfig's rope fields): rope_theta 0 means none; otherwise rope_dim is even, in
  // [2, head_dim], the first rope_dim dims of each head turning by position * rope_theta^(-2i / rope_dim) in pairs
  // (i, i + rope_dim / 2), or (2i, 2i + 1) when rope_interleaved.
  double rope_theta = 0.0;
  int64_t rope_dim = 0;
  bool rope_interleaved = false;
  RopeScaling rope_scaling = {};  // default (unscaled) without RoPE

  bool has_rope() const { return rope_theta > 0.0; }
  int64_t group_size() const { return num_heads / num_kv_heads; }  // query heads per KV head
  int64_t q_width() const { return num_heads * head_dim; }          // H d_k
  int64_t kv_width() const { return num_kv_heads * head_dim; }      // Hkv d_k
};

// One call: sizes, heads and, for a whole layer, the projections' input widths (all 0 for attention alone).
struct AttentionShape {
  int64_t batch = 0;    // B
  int64_t q_len = 0;    // Tq
  int64_t kv_len = 0;   // Tk
  int64_t d_model = 0;  // query features and output features of a layer; 0 for ScaledDotProductAttention
  int64_t d_kv_in = 0;  // key features of a layer
  int64_t d_v_in = 0;   // value features of a layer
  HeadSpec heads;

  bool has_projections() const { return d_model != 0; }
};

// Resolves a wire HeadConfig. `known` holds what tensors or a registered layer already fix (0 / false = not
// fixed): a non-zero field of `config` must equal a non-zero field of `known`, else INVALID_ARGUMENT naming
// `field`.<name> and `known_from` (e.g. "layer 'demo'", "the q and k shapes"). Unfixed zero fields take the
// defaults: num_kv_heads = num_heads, head_dim = d_model / num_heads (which must divide), scale =
// 1/sqrt(head_dim), rope_dim = head_dim when rope_theta is set. causal = config.causal OR known.causal, and
// rope_interleaved likewise; rope_scaling, when `known` has one, must be absent or equal. Every error is
// INVALID_ARGUMENT naming the field.
absl::StatusOr<HeadSpec> ResolveHeads(const v1::HeadConfig& config, const HeadSpec& known,
                                      absl::string_view known_from, int64_t d_model, absl::string_view field);

// The wire form of a resolved configuration: every field filled in.
v1::HeadConfig HeadConfigOf(const HeadSpec& heads);

// The RoPE of `heads` as a string that two configurations share iff they rotate alike: for batch keys, since a
// call may set RoPE that its layer leaves open (ResolveHeads).
std::string RopeKey(const HeadSpec& heads);

// (query, key) pairs that causal masking leaves visible: Tq Tk without causal, sum over i of
// clamp(i + Tk - Tq + 1, 0, Tk) with it (T (T + 1) / 2 for Tq = Tk = T). key_lengths and additive masks are not
// counted: they are data, not shape.
double VisiblePairs(const AttentionShape& shape);

// Floating-point operations the call costs, a multiply and an add counted as two:
//   projections 2 B Tq d_model H d_k (Q) + 2 B Tk (d_kv_in + d_v_in) Hkv d_k (K, V) + 2 B Tq H d_k d_model (O),
//   attention 4 B H d_k VisiblePairs (Q K^T and P V over the visible pairs only).
// The same number is the server's per-request work limit, its mha_flops metric and the clients' GFLOP/s.
double AttentionFlops(const AttentionShape& shape);

// FLOPs of one session item (an ExtendItem), counted as AttentionFlops counts them: `new_tokens` queries attending
// to the `cached` tokens of the cache and, when `append`, to themselves causally (written after them); with a layer
// (d_model > 0) also projecting the new tokens (Q, K, V and the output: the cached tokens' K and V were projected
// when they came). On an empty cache, an appending item of T tokens costs what a causal self-attention call of T
// tokens on the same layer does.
double ExtendFlops(const HeadSpec& heads, int64_t d_model, int64_t cached, int64_t new_tokens, bool append);

// Bytes of K and V that `tokens` tokens of one cache hold in elements of `element_bytes`: 2 Hkv d_k each. A decode
// step reads this for every cache it attends to.
double KvCacheBytes(const HeadSpec& heads, int64_t tokens, int64_t element_bytes);
// The same for a cache of `cache_dtype` (the proto's DataType) in blocks of `block_tokens`: the 8-bit dtypes hold a
// byte per element plus their bf16 scales (a key scale per channel and block, a value scale per token; the layout
// of server/backends/quantized_cache.h), the others their element size.
double KvCacheBytes(const HeadSpec& heads, int64_t tokens, int cache_dtype, int64_t block_tokens);

// "B=1 Tq=16 Tk=16 d_model=512 H=8 Hkv=8 d_k=64" plus " causal" when causal (d_model and the rest only when set).
std::string AttentionShapeString(const AttentionShape& shape);

}  // namespace mha

#endif  // MHA_PROTO_ATTENTION_SHAPE_H_
