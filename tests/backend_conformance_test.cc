// Every backend the registry can build, every variant of it (each CPU tile-kernel set), against the reference
// backend over one table of cases. A new backend joins by registering in server/backends/registry.cc; a variant
// this machine cannot run is skipped with the backend's reason.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/registry.h"
#include "server/layers/layer.h"
#include "server/sessions/block_pool.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
using ::mha::testing::NaNCount;
using ::mha::testing::RandomVector;

// kExtremes: finite extremes a client may send (PyTorch masks with torch.finfo(torch.float32).min), shared by the
// batch: the lowest float on every key of query row 0, which gives it uniform weights, as in PyTorch; the largest
// float on key 1 of row 1 and on keys 0 and 2 of row 2, which take all their row's weight; -inf on every fifth key
// of the other rows.
enum class Mask { kNone, kShared, kPerBatch, kExtremes };

struct Case {
  std::string name;
  int64_t batch, q_len, kv_len, d_model;
  int64_t d_kv_in;  // 0: self-attention (key = value = query); ignored by sdpa cases
  int64_t heads, kv_heads, head_dim;
  bool sdpa = false;         // the attention core alone (ScaledDotProductAttention)
  bool causal = false;
  bool key_lengths = false;  // lengths cycle through Tk, 0, Tk/2, 1
  Mask mask = Mask::kNone;   // shared, per batch: random finite values, some -inf and one fully masked row
  bool bias = false;
  bool head_mask = false;
  bool weights = false;      // return attention weights
  bool stats = false;        // return the softmax statistics (RowStats: lse, head statistics, contribution)
  bool value_is_key = false; // cross-attention without a value tensor (value = key)
  float scale = 0.0f;        // 0: 1/sqrt(d_k)
  double rope_theta = 0;     // RoPE's base; 0: none
  int64_t rope_dim = 0;      // with rope_theta: 0 = head_dim
  bool rope_interleaved = false;
  RopeScaling rope_scaling;  // scaled RoPE frequencies (HeadConfig.rope_scaling); default: none
  float input_bound = 1.0f;  // inputs uniform in +-input_bound
  v1::DataType input_dtype = v1::FP32;
  v1::DataType output_dtype = v1::FP32;
  double atol = 2e-5, rtol = 1e-4;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << c.name << (c.sdpa ? " sdpa" : " mha") << " B=" << c.batch << " Tq=" << c.q_len << " Tk=" << c.kv_len
            << " d=" << c.d_model << " H=" << c.heads << " Hkv=" << c.kv_heads << " dk=" << c.head_dim << " in "
            << DTypeName(c.input_dtype) << " out " << DTypeName(c.output_dtype);
}

// n random values, encoded in `dtype`.
std::string Encoded(int64_t n, uint32_t seed, float bound, v1::DataType dtype) {
  const std::vector<float> values = RandomVector(n, seed, bound);
  std::string bytes(n * DTypeSize(dtype), '\0');
  EncodeFromFloat(dtype, values.data(), n, bytes.data());
  return bytes;
}

// The inputs of one case, and what a backend computes on them (outputs decoded to fp32).
class Problem {
 public:
  explicit Problem(const Case& c) : c_(c) {
    AttentionShape& s = shape_;
    const bool self = !c.sdpa && c.d_kv_in == 0;
    s.batch = c.batch;
    s.q_len = c.q_len;
    s.kv_len = self ? c.q_len : c.kv_len;
    s.heads.num_heads = c.heads;
    s.heads.num_kv_heads = c.kv_heads;
    s.heads.head_dim = c.head_dim;
    s.heads.causal = c.causal;
    s.heads.scale = c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    s.heads.rope_theta = c.rope_theta;
    s.heads.rope_dim = c.rope_theta != 0 && c.rope_dim == 0 ? c.head_dim : c.rope_dim;
    s.heads.rope_interleaved = c.rope_interleaved;
    s.heads.rope_scaling = c.rope_scaling;
    const int64_t qw = s.heads.q_width(), kvw = s.heads.kv_width();
    if (c.sdpa) {
      query_ = Encoded(c.batch * c.q_len * qw, 1, c.input_bound, c.input_dtype);
      key_ = Encoded(c.batch * s.kv_len * kvw, 2, c.input_bound, c.input_dtype);
      value_ = Encoded(c.batch * s.kv_len * kvw, 3, c.input_bound, c.input_dtype);
    } else {
      s.d_model = c.d_model;
      s.d_kv_in = s.d_v_in = self ? c.d_model : c.d_kv_in;
      kv_source_ = self ? KvSource::kQuery : c.value_is_key ? KvSource::kKey : KvSource::kKeyValue;
      query_ = Encoded(c.batch * c.q_len * s.d_model, 1, c.input_bound, c.input_dtype);
      if (!self) key_ = Encoded(c.batch * s.kv_len * s.d_kv_in, 2, c.input_bound, c.input_dtype);
      if (!self && !c.value_is_key) value_ = Encoded(c.batch * s.kv_len * s.d_v_in, 3, c.input_bound, c.input_dtype);
      layer_ = MakeLayer();
    }
    MakeMasks();
  }

  const AttentionShape& shape() const { return shape_; }
  const std::shared_ptr<const Layer>& layer() const { return layer_; }

  // Sets element `index` of the query (fp32 cases) to NaN, as only a caller that bypassed validation could.
  void PoisonQuery(int64_t index) {
    const float nan = std::nanf("");
    std::memcpy(query_.data() + index * sizeof(float), &nan, sizeof(float));
  }

  // Runs the case on `backend`; returns the output and, when the case asks for them, the weights in *weights and
  // the softmax statistics in *stats (lse, entropy, confidence, distance, sink, contribution: [B, H, Tq] each; no
  // contribution for sdpa cases).
  std::vector<float> Run(Backend& backend, std::vector<float>* weights,
                         std::vector<std::vector<float>>* stats = nullptr) const {
    const int64_t stat_count = shape_.batch * shape_.heads.num_heads * shape_.q_len;
    std::vector<std::vector<float>> stats_room(c_.stats ? (c_.sdpa ? 5 : 6) : 0,
                                               std::vector<float>(stat_count, std::nanf("")));
    RowStats row_stats;
    if (c_.stats) {
      float** arrays[] = {&row_stats.lse, &row_stats.entropy, &row_stats.confidence, &row_stats.distance,
                          &row_stats.sink, &row_stats.contribution};
      for (size_t k = 0; k < stats_room.size(); ++k) *arrays[k] = stats_room[k].data();
      row_stats.sink_tokens = 3;
    }
    std::vector<float> result = RunWith(backend, weights, row_stats);
    if (stats != nullptr) *stats = std::move(stats_room);
    return result;
  }

  std::vector<float> RunWith(Backend& backend, std::vector<float>* weights, const RowStats& row_stats) const {
    const AttentionShape& s = shape_;
    const int64_t out_count = c_.sdpa ? s.batch * s.q_len * s.heads.q_width() : s.batch * s.q_len * s.d_model;
    const int64_t weight_count = s.batch * s.heads.num_heads * s.q_len * s.kv_len;
    const size_t out_size = DTypeSize(c_.output_dtype);
    // NaN-filled, so that anything a backend leaves unwritten fails the comparison.
    std::vector<float> nan(std::max(out_count, weight_count), std::nanf(""));
    std::string out_bytes(out_count * out_size, '\0'), weight_bytes;
    EncodeFromFloat(c_.output_dtype, nan.data(), out_count, out_bytes.data());
    MutableTensor out{out_bytes.data(), c_.output_dtype}, weight_out;
    if (c_.weights) {
      weight_bytes.resize(weight_count * out_size);
      EncodeFromFloat(c_.output_dtype, nan.data(), weight_count, weight_bytes.data());
      weight_out = {weight_bytes.data(), c_.output_dtype};
    }
    AttentionMask mask;
    mask.key_lengths = key_lengths_;
    mask.additive = additive_.empty() ? nullptr : additive_.data();
    mask.additive_per_batch = c_.mask == Mask::kPerBatch;
    absl::Status status;
    if (c_.sdpa) {
      SdpaArgs a;
      a.shape = s;
      a.mask = mask;
      a.q = {query_.data(), c_.input_dtype};
      a.k = {key_.data(), c_.input_dtype};
      a.v = {value_.data(), c_.input_dtype};
      a.out = out;
      a.weights = weight_out;
      a.stats = row_stats;
      status = backend.ScaledDotProductAttention(a);
    } else {
      MhaArgs a;
      a.shape = s;
      a.mask = mask;
      a.weights = layer_->Weights();
      a.kv_source = kv_source_;
      a.query = {query_.data(), c_.input_dtype};
      a.key = kv_source_ == KvSource::kQuery ? a.query : ConstTensor{key_.data(), c_.input_dtype};
      a.value = kv_source_ == KvSource::kKeyValue ? ConstTensor{value_.data(), c_.input_dtype} : a.key;
      a.head_mask = head_mask_;
      a.out = out;
      a.attention_weights = weight_out;
      a.stats = row_stats;
      status = backend.MultiHeadAttention(a);
    }
    EXPECT_TRUE(status.ok()) << status;
    if (c_.weights) {
      weights->resize(weight_count);
      DecodeToFloat(c_.output_dtype, weight_bytes.data(), weight_count, weights->data());
    }
    std::vector<float> result(out_count);
    DecodeToFloat(c_.output_dtype, out_bytes.data(), out_count, result.data());
    return result;
  }

 private:
  // The layer as the server builds it from the wire (fused Q|K|V when d_kv_in == d_v_in == d_model).
  std::shared_ptr<const Layer> MakeLayer() const {
    const AttentionShape& s = shape_;
    const int64_t qw = s.heads.q_width(), kvw = s.heads.kv_width();
    v1::AttentionWeights w;
    auto set = [](v1::Tensor* t, std::vector<int64_t> shape, uint32_t seed, float bound) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      FloatsToTensor(RandomVector(n, seed, bound), shape, v1::FP32, t);
    };
    set(w.mutable_w_q(), {s.d_model, qw}, 4, 1.0f / std::sqrt(static_cast<float>(s.d_model)));
    set(w.mutable_w_k(), {s.d_kv_in, kvw}, 5, 1.0f / std::sqrt(static_cast<float>(s.d_kv_in)));
    set(w.mutable_w_v(), {s.d_v_in, kvw}, 6, 1.0f / std::sqrt(static_cast<float>(s.d_v_in)));
    set(w.mutable_w_o(), {qw, s.d_model}, 7, 1.0f / std::sqrt(static_cast<float>(qw)));
    if (c_.bias) {
      set(w.mutable_b_q(), {qw}, 8, 1.0f);
      set(w.mutable_b_k(), {kvw}, 9, 1.0f);
      set(w.mutable_b_v(), {kvw}, 10, 1.0f);
      set(w.mutable_b_o(), {s.d_model}, 11, 1.0f);
    }
    v1::HeadConfig heads;
    heads.set_num_heads(static_cast<int32_t>(c_.heads));
    heads.set_num_kv_heads(static_cast<int32_t>(c_.kv_heads));
    heads.set_head_dim(static_cast<int32_t>(c_.head_dim));
    absl::StatusOr<std::shared_ptr<const Layer>> layer = BuildLayer("case", "test", w, heads, "weights");
    EXPECT_TRUE(layer.ok()) << layer.status();
    return *layer;
  }

  void MakeMasks() {
    const int64_t tq = shape_.q_len, tk = shape_.kv_len;
    if (c_.key_lengths) {
      const int64_t cycle[] = {tk, 0, tk / 2, 1};
      for (int64_t b = 0; b < c_.batch; ++b) key_lengths_.push_back(static_cast<int32_t>(cycle[b % 4]));
    }
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    if (c_.mask == Mask::kExtremes) {
      additive_ = RandomVector(tq * tk, 12, 2.0f);
      for (int64_t i = 3 * tk; i < tq * tk; i += 5) additive_[i] = kNegInf;
      for (int64_t j = 0; j < tk; ++j) additive_[j] = std::numeric_limits<float>::lowest();
      additive_[tk + 1] = additive_[2 * tk] = additive_[2 * tk + 2] = std::numeric_limits<float>::max();
    } else if (c_.mask != Mask::kNone) {
      const int64_t n = (c_.mask == Mask::kPerBatch ? c_.batch : 1) * tq * tk;
      additive_ = RandomVector(n, 12, 2.0f);
      for (int64_t i = 0; i < n; i += 7) additive_[i] = kNegInf;
      for (int64_t j = 0; j < tk; ++j) additive_[j] = kNegInf;  // one fully masked query row
    }
    if (c_.head_mask) {
      for (int64_t h = 0; h < c_.heads; ++h) head_mask_.push_back(h % 3 == 0 ? 0.0f : 0.5f * (h + 1));
    }
  }

  const Case c_;
  AttentionShape shape_;
  KvSource kv_source_ = KvSource::kQuery;
  std::string query_, key_, value_;  // encoded in c_.input_dtype
  std::shared_ptr<const Layer> layer_;
  std::vector<int32_t> key_lengths_;
  std::vector<float> additive_, head_mask_;
};

// Scaled RoPE frequencies of each type, with contexts short enough that the cases reach every regime: llama3's
// three wavelength bands, yarn's ramp, dynamic past its max_position_embeddings, longrope's long factors.
RopeScaling Scaling(RopeScaling::Type type, int64_t pairs = 0) {
  RopeScaling r;
  r.type = type;
  r.factor = type == RopeScaling::Type::kLlama3 ? 8 : type == RopeScaling::Type::kDynamic ? 2 : 4;
  if (type == RopeScaling::Type::kLlama3) {
    r.original_max_position_embeddings = 64;
    r.low_freq_factor = 1;
    r.high_freq_factor = 4;
  } else if (type == RopeScaling::Type::kDynamic) {
    r.max_position_embeddings = 128;
  } else {
    r.original_max_position_embeddings = 128;
  }
  for (int64_t i = 0; type == RopeScaling::Type::kLongrope && i < pairs; ++i) {
    r.short_factor.push_back(1.0 + 0.05 * static_cast<double>(i));
    r.long_factor.push_back(1.0 + 0.7 * static_cast<double>(i));
  }
  return r;
}

Case Make(std::string name, int64_t b, int64_t tq, int64_t tk, int64_t d, int64_t dkv, int64_t h, int64_t hkv,
          int64_t dk) {
  Case c;
  c.name = std::move(name);
  c.batch = b;
  c.q_len = tq;
  c.kv_len = tk;
  c.d_model = d;
  c.d_kv_in = dkv;
  c.heads = h;
  c.kv_heads = hkv;
  c.head_dim = dk;
  return c;
}

// The same case with 16-bit inputs and outputs (tolerances of one rounding of the output, as both sides round the
// same fp32-exact inputs) or with 16-bit inputs and fp32 outputs.
Case WithDtypes(Case c, v1::DataType in, v1::DataType out) {
  c.name += "_" + DTypeName(in) + "_to_" + DTypeName(out);
  c.input_dtype = in;
  c.output_dtype = out;
  if (out == v1::BF16) c.atol = c.rtol = 8e-3;
  if (out == v1::FP16) c.atol = c.rtol = 1e-3;
  return c;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back(Make("mha_self", 2, 7, 7, 32, 0, 4, 4, 8));
  cases.push_back(Make("gqa_self", 2, 9, 9, 32, 0, 4, 2, 8));
  cases.push_back(Make("mqa_self", 2, 9, 9, 32, 0, 4, 1, 8));
  cases.push_back(Make("cross_tq_ne_tk", 3, 5, 11, 24, 40, 6, 3, 4));
  Case c = Make("cross_fused_layer_value_is_key", 2, 6, 10, 32, 32, 4, 2, 8);
  c.value_is_key = true;
  c.bias = true;
  cases.push_back(c);
  cases.push_back(Make("head_dim_not_d_over_h", 2, 6, 6, 16, 0, 4, 4, 12));
  c = Make("causal_self", 2, 13, 13, 32, 0, 4, 4, 8);
  c.causal = true;
  cases.push_back(c);
  c = Make("causal_tq_lt_tk", 2, 3, 17, 32, 32, 4, 2, 8);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  c = Make("causal_tq_gt_tk_masks_early_rows", 2, 9, 4, 16, 16, 2, 2, 8);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  c = Make("key_lengths_with_zero", 5, 6, 10, 16, 16, 2, 2, 8);
  c.key_lengths = true;
  c.weights = true;
  cases.push_back(c);
  c = Make("additive_mask_shared", 2, 6, 8, 16, 16, 2, 1, 8);
  c.mask = Mask::kShared;
  c.weights = true;
  cases.push_back(c);
  c = Make("additive_mask_per_batch_causal_lengths", 4, 8, 8, 16, 0, 4, 2, 4);
  c.mask = Mask::kPerBatch;
  c.causal = true;
  c.key_lengths = true;
  c.weights = true;
  cases.push_back(c);
  c = Make("mask_lowest_and_largest_floats", 2, 9, 40, 64, 64, 4, 2, 16);
  c.mask = Mask::kExtremes;
  cases.push_back(c);
  c.name = "mask_lowest_and_largest_floats_weights";
  c.weights = true;
  cases.push_back(c);
  c = Make("biases", 2, 5, 5, 24, 0, 3, 3, 8);
  c.bias = true;
  cases.push_back(c);
  c = Make("biases_cross", 2, 5, 6, 24, 12, 3, 1, 8);
  c.bias = true;
  cases.push_back(c);
  c = Make("head_mask", 2, 5, 5, 24, 0, 6, 3, 4);
  c.head_mask = true;
  cases.push_back(c);
  c = Make("weights_returned", 3, 16, 16, 32, 0, 4, 4, 8);
  c.weights = true;
  cases.push_back(c);
  c = Make("demo_sized", 2, 64, 64, 512, 0, 8, 8, 64);
  c.weights = true;
  c.atol = 5e-5;
  cases.push_back(c);
  // Several query blocks (128 rows) and key blocks (512 keys): the online softmax carries its running max and sum
  // across key blocks, with causal masking and key_lengths skipping blocks and an additive mask inside them.
  c = Make("online_softmax_many_blocks_causal_mask", 2, 300, 1100, 32, 32, 8, 4, 4);
  c.causal = true;
  c.mask = Mask::kPerBatch;
  cases.push_back(c);
  c = Make("online_softmax_many_blocks_key_lengths", 5, 130, 1300, 16, 16, 16, 16, 1);
  c.key_lengths = true;
  cases.push_back(c);
  c = Make("exact_softmax_many_blocks_weights", 1, 260, 1100, 32, 32, 8, 4, 4);
  c.causal = true;
  c.weights = true;
  cases.push_back(c);
  // Head sizes at and between the tile kernels' vector widths, with panels of rows and blocks of columns cut at odd
  // places.
  c = Make("dk16_causal_mask_lengths", 2, 37, 301, 64, 64, 4, 2, 16);
  c.causal = true;
  c.key_lengths = true;
  c.mask = Mask::kPerBatch;
  cases.push_back(c);
  c.name = "dk16_causal_mask_lengths_weights";
  c.weights = true;
  cases.push_back(c);
  c = Make("dk48_causal_many_key_blocks", 1, 70, 1100, 96, 96, 2, 1, 48);
  c.causal = true;
  cases.push_back(c);
  c = Make("dk64_lengths_many_key_blocks", 3, 600, 600, 128, 0, 2, 2, 64);
  c.key_lengths = true;
  c.atol = 5e-5;
  cases.push_back(c);
  c = Make("dk80_weights_cross", 2, 13, 77, 160, 40, 2, 2, 80);
  c.weights = true;
  c.atol = 5e-5;
  cases.push_back(c);
  c = Make("dk8_gqa_weights", 2, 19, 23, 32, 0, 4, 2, 8);
  c.weights = true;
  cases.push_back(c);
  c = Make("dk20_odd_width", 2, 15, 45, 40, 40, 2, 1, 20);
  c.causal = true;
  cases.push_back(c);
  c.name = "dk20_odd_width_weights";
  c.weights = true;
  cases.push_back(c);
  // The attention core alone.
  c = Make("sdpa_gqa_causal_lengths", 2, 5, 9, 0, 0, 4, 2, 8);
  c.sdpa = true;
  c.causal = true;
  c.key_lengths = true;
  c.weights = true;
  c.scale = 0.3f;
  cases.push_back(c);
  c = Make("sdpa_mask_many_blocks", 2, 140, 700, 0, 0, 4, 4, 16);
  c.sdpa = true;
  c.mask = Mask::kPerBatch;
  cases.push_back(c);
  // A finite scale too large to fold log2 e into (3e38 against FLT_MAX / log2 e = 2.4e38) on tiny inputs: ordinary
  // scores, which must not become inf or NaN.
  c = Make("sdpa_scale_beyond_log2_range", 1, 6, 20, 0, 0, 2, 2, 16);
  c.sdpa = true;
  c.scale = 3e38f;
  c.input_bound = 1e-19f;
  cases.push_back(c);
  // RoPE: both conventions, partial rotary, queries bottom-right aligned (Tq < Tk, and Tq > Tk: negative positions),
  // on layers (fused and cross) and on the attention core.
  c = Make("rope_half_causal_gqa_self", 2, 13, 13, 64, 0, 4, 2, 16);
  c.causal = true;
  c.rope_theta = 10000;
  c.bias = true;
  cases.push_back(c);
  c = Make("rope_interleaved_partial_cross_tq_lt_tk", 2, 5, 17, 32, 24, 4, 2, 16);
  c.rope_theta = 500000;
  c.rope_dim = 8;
  c.rope_interleaved = true;
  c.weights = true;
  cases.push_back(c);
  c = Make("rope_half_partial_tq_gt_tk", 2, 9, 4, 32, 32, 2, 1, 12);
  c.causal = true;
  c.rope_theta = 100;
  c.rope_dim = 6;
  cases.push_back(c);
  c = Make("sdpa_rope_interleaved_long_positions", 1, 3, 700, 0, 0, 4, 4, 32);
  c.sdpa = true;
  c.rope_theta = 10000;
  c.rope_interleaved = true;
  cases.push_back(c);
  // Scaled RoPE (rope_scaling), each type: on layers and on the attention core, partial and interleaved too.
  c = Make("rope_llama3_causal_gqa_self", 2, 13, 13, 64, 0, 4, 2, 16);
  c.causal = true;
  c.rope_theta = 10000;
  c.rope_scaling = Scaling(RopeScaling::Type::kLlama3);
  cases.push_back(c);
  c = Make("sdpa_rope_yarn_long_positions", 1, 3, 700, 0, 0, 4, 4, 32);
  c.sdpa = true;
  c.rope_theta = 10000;
  c.rope_scaling = Scaling(RopeScaling::Type::kYarn);
  cases.push_back(c);
  c = Make("sdpa_rope_dynamic_partial_past_max", 1, 5, 300, 0, 0, 4, 2, 32);
  c.sdpa = true;
  c.causal = true;
  c.rope_theta = 10000;
  c.rope_dim = 16;
  c.rope_scaling = Scaling(RopeScaling::Type::kDynamic);
  cases.push_back(c);
  c = Make("rope_longrope_interleaved_cross_long", 2, 5, 200, 32, 24, 4, 2, 16);
  c.rope_theta = 10000;
  c.rope_interleaved = true;
  c.rope_scaling = Scaling(RopeScaling::Type::kLongrope, 8);
  cases.push_back(c);
  c = Make("rope_linear_gqa_self", 1, 9, 9, 64, 0, 4, 2, 16);
  c.rope_theta = 10000;
  c.rope_scaling = Scaling(RopeScaling::Type::kLinear);
  cases.push_back(c);
  // 16-bit wire dtypes: decoded by the backend, outputs encoded in the requested dtype.
  for (v1::DataType in : {v1::FP16, v1::BF16}) {
    Case gqa = Make("gqa_causal_mask", 2, 9, 9, 32, 0, 4, 2, 8);
    gqa.causal = true;
    gqa.mask = Mask::kShared;
    gqa.weights = true;
    cases.push_back(WithDtypes(gqa, in, in));
    cases.push_back(WithDtypes(gqa, in, v1::FP32));
    Case cross = Make("cross_biases_head_mask", 2, 6, 11, 32, 24, 4, 1, 8);
    cross.bias = true;
    cross.head_mask = true;
    cross.key_lengths = true;
    cases.push_back(WithDtypes(cross, in, in));
    // A layer of the demo's width: 16-bit compute paths accumulate over 512 inputs.
    Case demo = Make("demo_sized_causal", 2, 64, 64, 512, 0, 8, 8, 64);
    demo.causal = true;
    demo.bias = true;
    cases.push_back(WithDtypes(demo, in, in));
    // The attention core at head_dim 128 (the CUDA backend's tensor-core kernel) with partial query and key
    // tiles, GQA, causal with Tq < Tk, key lengths and a per-batch mask, weights returned.
    Case core128 = Make("sdpa_dk128_partial_tiles_masks", 2, 70, 130, 0, 0, 4, 2, 128);
    core128.sdpa = true;
    core128.causal = true;
    core128.key_lengths = true;
    core128.mask = Mask::kPerBatch;
    core128.weights = true;
    cases.push_back(WithDtypes(core128, in, in));
    Case sdpa = Make("sdpa_weights", 2, 7, 12, 0, 0, 4, 2, 16);
    sdpa.sdpa = true;
    sdpa.weights = true;
    cases.push_back(WithDtypes(sdpa, in, in));
    Case rope = Make("rope_half_causal_gqa_self", 2, 13, 13, 64, 0, 4, 2, 32);
    rope.causal = true;
    rope.rope_theta = 10000;
    cases.push_back(WithDtypes(rope, in, in));
    Case sdpa_rope = Make("sdpa_rope_interleaved", 2, 5, 40, 0, 0, 4, 2, 64);
    sdpa_rope.sdpa = true;
    sdpa_rope.rope_theta = 10000;
    sdpa_rope.rope_interleaved = true;
    cases.push_back(WithDtypes(sdpa_rope, in, in));
    // PyTorch's finite mask extremes (kExtremes) through the 16-bit attention core at head_dim 64 (the CUDA
    // backend's tensor-core kernel), weights returned: a row of the lowest float has uniform weights, the largest
    // float takes all of its row's weight, as in the fp32 cases above.
    Case extremes = Make("sdpa_dk64_mask_lowest_and_largest_floats_weights", 2, 9, 40, 0, 0, 4, 2, 64);
    extremes.sdpa = true;
    extremes.mask = Mask::kExtremes;
    extremes.weights = true;
    cases.push_back(WithDtypes(extremes, in, in));
  }
  // bf16 layers and attention-core calls whose head_dim suits the amx tiles (multiples of 32), where a CPU has
  // them: query blocks, tiles and key blocks cut at their edges (Tq = 140 is two query blocks of 128, the second 12
  // rows; Tk = 600 is a key block of 512 and a partial one), GQA, bottom-right causal with Tq < Tk, key lengths (one
  // of them 0: rows with nothing visible), a per-batch mask with a fully masked row, a head mask; with and without
  // weights.
  for (bool weights : {false, true}) {
    Case amx = Make(weights ? "bf16_core_dk32_masks_weights" : "bf16_core_dk32_masks_online", 2, 140, 600, 128, 96,
                    4, 2, 32);
    amx.causal = amx.key_lengths = amx.bias = amx.head_mask = true;
    amx.mask = Mask::kPerBatch;
    amx.weights = weights;
    cases.push_back(WithDtypes(amx, v1::BF16, v1::BF16));
    // Without the head mask the core writes the heads in bf16 itself (with weights: staged, then rounded).
    Case heads16 = amx;
    heads16.name = weights ? "bf16_core_dk32_bf16_heads_weights" : "bf16_core_dk32_bf16_heads_online";
    heads16.head_mask = false;
    cases.push_back(WithDtypes(heads16, v1::BF16, v1::BF16));
    // The attention core alone from the wire's bf16 Q, K, V (ScaledDotProductAttention), head_dim 64.
    Case sdpa = Make(weights ? "bf16_core_sdpa_dk64_masks_weights" : "bf16_core_sdpa_dk64_masks_online", 2, 140, 600,
                     0, 0, 4, 2, 64);
    sdpa.sdpa = sdpa.causal = sdpa.key_lengths = true;
    sdpa.mask = Mask::kPerBatch;
    sdpa.weights = weights;
    cases.push_back(WithDtypes(sdpa, v1::BF16, v1::BF16));
  }
  Case amx128 = Make("bf16_core_dk128_gqa_self", 1, 45, 45, 512, 0, 4, 1, 128);
  cases.push_back(WithDtypes(amx128, v1::BF16, v1::FP32));
  Case to_half = Make("mha_self", 2, 7, 7, 32, 0, 4, 4, 8);
  cases.push_back(WithDtypes(to_half, v1::FP32, v1::FP16));
  // The softmax statistics: online (several key blocks: Tk = 1100) and exact (weights) softmaxes, natural and log2
  // units (masks), rows that see no key, GQA, a head mask (contribution), 16-bit paths.
  Case long_keys = Make("causal_long_keys", 2, 20, 1100, 0, 0, 4, 2, 16);
  long_keys.sdpa = long_keys.causal = true;
  cases.push_back(long_keys);
  Case masked_heads = Make("cross_head_mask_bias", 2, 6, 10, 32, 32, 4, 2, 8);
  masked_heads.bias = masked_heads.head_mask = true;
  cases.push_back(masked_heads);
  const std::set<std::string> with_stats = {
      "mha_self", "gqa_self", "causal_tq_lt_tk", "key_lengths_with_zero", "additive_mask_per_batch_causal_lengths",
      "mask_lowest_and_largest_floats", "mask_lowest_and_largest_floats_weights", "causal_long_keys",
      "cross_head_mask_bias", "bf16_core_sdpa_dk64_masks_online_bf16_to_bf16",
      "bf16_core_dk32_masks_weights_bf16_to_bf16", "mha_self_fp32_to_fp16"};
  for (size_t i = 0, n = cases.size(); i < n; ++i) {
    if (with_stats.count(cases[i].name) == 0) continue;
    Case stats = cases[i];
    stats.name += "_stats";
    stats.stats = true;
    cases.push_back(stats);
  }
  return cases;
}

// Every factory but the reference itself.
std::vector<std::string> Labels() {
  std::vector<std::string> labels;
  for (const BackendFactory& f : BackendRegistry::Factories()) {
    if (f.name != kReferenceBackend) labels.push_back(f.label());
  }
  return labels;
}

absl::StatusOr<std::unique_ptr<Backend>> Create(const std::string& label) {
  for (const BackendFactory& f : BackendRegistry::Factories()) {
    if (f.label() == label) return f.create();
  }
  return absl::NotFoundError(label);
}

// A backend that computes a 16-bit request in its dtype (Backend::ComputeDtype: the CUDA backend; the CPU backend's
// bf16 projections) rounds the weights, Q, K, V, the probabilities or the heads on the way, a few roundings more
// than the fp32 path's one of the output. The tolerances are the proto's.
Case WithToleranceOf(Case c, v1::DataType compute) {
  if (compute == v1::FP32) return c;
  const double tolerance = compute == v1::BF16 ? 3e-2 : 4e-3;
  c.atol = std::max(c.atol, tolerance);
  c.rtol = std::max(c.rtol, tolerance);
  return c;
}

class ConformanceTest : public ::testing::TestWithParam<std::tuple<Case, std::string>> {};

TEST_P(ConformanceTest, MatchesTheReference) {
  const std::string& label = std::get<1>(GetParam());
  absl::StatusOr<std::unique_ptr<Backend>> backend = Create(label);
  if (absl::IsUnavailable(backend.status())) GTEST_SKIP() << label << ": " << backend.status().message();
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Case& given = std::get<0>(GetParam());
  AttentionProblem problem;
  problem.shape = Problem(given).shape();
  problem.input_dtype = given.input_dtype;
  problem.output_dtype = given.output_dtype;
  problem.return_weights = given.weights;
  problem.return_stats = given.stats;
  const Case c = WithToleranceOf(given, (*backend)->ComputeDtype(problem));
  if (absl::Status supported = (*backend)->Supports(problem); !supported.ok()) {
    EXPECT_EQ(supported.code(), absl::StatusCode::kUnimplemented) << supported;
    GTEST_SKIP() << label << " does not support this case: " << supported.message();
  }
  const Problem p(c);
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  std::vector<float> want_weights, got_weights;
  std::vector<std::vector<float>> want_stats, got_stats;
  const std::vector<float> want = p.Run(*reference, &want_weights, &want_stats);
  const std::vector<float> got = p.Run(**backend, &got_weights, &got_stats);
  // The buffers start NaN-filled and AllClose lets NaN match NaN: the reference must have written every element.
  EXPECT_EQ(NaNCount(want), 0);
  EXPECT_EQ(NaNCount(want_weights), 0);
  for (const std::vector<float>& stat : want_stats) EXPECT_EQ(NaNCount(stat), 0);
  EXPECT_TRUE(AllClose(got, want, c.atol, c.rtol)) << "output";
  if (c.weights) {
    EXPECT_TRUE(AllClose(got_weights, want_weights, c.atol, c.rtol)) << "attention weights";
  }
  // Each statistic against the reference's, computed there from the full weights; at least the fp32 paths'
  // tolerances (lse and entropy sum roundings of every score).
  const char* names[] = {"lse", "entropy", "confidence", "distance", "sink mass", "contribution"};
  for (size_t k = 0; k < want_stats.size(); ++k) {
    EXPECT_TRUE(AllClose(got_stats[k], want_stats[k], std::max(c.atol, 1e-4), std::max(c.rtol, 1e-4))) << names[k];
  }
  // Again on the same instance: what the first call left in reused scratch must not change the result.
  std::vector<float> again_weights;
  EXPECT_EQ(p.Run(**backend, &again_weights), got);
}

// "<case>_<backend label>" for the suites parameterized by (case, label), '/' made '_'.
template <typename Param>
std::string TestName(const ::testing::TestParamInfo<Param>& info) {
  std::string label = std::get<1>(info.param);
  for (char& ch : label) {
    if (ch == '/') ch = '_';
  }
  return std::get<0>(info.param).name + "_" + label;
}

INSTANTIATE_TEST_SUITE_P(Backends, ConformanceTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::ValuesIn(Labels())),
                         TestName<ConformanceTest::ParamType>);

// ---------------------------------------------------------------------------------------------------------------
// Sessions: Extend calls over paged caches (Backend::PagedAttention), every backend against the reference, and the
// reference against the stateless causal computation over each whole sequence.

// What happens to the sessions between and after the steps.
enum class SessionPlot {
  kSteps,           // only the steps
  kForkDiverge,     // after the steps, session 0 is forked and both get different tokens in one call
  kTruncateExtend,  // after the steps, session 0 is cut back into a block and extended with new tokens
  kCascade,         // after the steps, session 0 is forked three times and the four decode in calls together
};

struct SessionCase {
  std::string name;
  bool layer = true;  // a layer session (x in, W_O out) or a head session (q, k, v in, the heads out)
  int64_t d_model = 0, heads = 4, kv_heads = 2, head_dim = 16;
  // steps[j][s]: the new tokens of session s in Extend call j (0: not in that call).
  std::vector<std::vector<int64_t>> steps;
  SessionPlot plot = SessionPlot::kSteps;
  int64_t block_tokens = 16;
  v1::DataType cache_dtype = v1::FP32;
  v1::DataType input_dtype = v1::FP32, output_dtype = v1::FP32;
  double rope_theta = 0;
  int64_t rope_dim = 0;
  bool rope_interleaved = false;
  RopeScaling rope_scaling;
  // Chunked Extends equal one stateless call over the whole sequence; not where the frequencies depend on the
  // sequence's length (dynamic, longrope across its switch): each token's keys keep the rotation of their call.
  bool stateless_equal = true;
  bool bias = false;
  bool weights = false;
  bool stats = false;        // every call asks for the softmax statistics (and contribution, with a layer)
  bool host_memory = false;  // blocks in host memory even where the backend lends cache memory (TestCaches)
};

std::ostream& operator<<(std::ostream& os, const SessionCase& c) {
  return os << c.name << (c.layer ? " layer" : " heads") << " H=" << c.heads << " Hkv=" << c.kv_heads
            << " dk=" << c.head_dim << " block=" << c.block_tokens << " cache " << DTypeName(c.cache_dtype);
}

// The session caches of one case over a block pool, managed as the store does it: copy-on-write of a shared block
// before new tokens land in it, forks that share every block, truncation that drops blocks.
class TestCaches {
 public:
  // Blocks in `backend`'s cache memory when it lends some (the server's arrangement: a GPU backend then reads them
  // in place), else in host memory; `host_memory` forces host memory (a GPU backend then stages the blocks).
  TestCaches(const KvCacheLayout& layout, Backend* backend, bool host_memory = false)
      : layout_(layout), arena_(host_memory ? nullptr : ArenaOf(backend)), pool_holder_(PoolOn(arena_.get())) {}
  ~TestCaches() {
    for (auto& [id, cache] : caches_) {
      for (char* block : cache.blocks) pool_.Unref(block);
    }
  }
  struct Cache {
    std::vector<char*> blocks;
    int64_t length = 0;
  };
  Cache& operator[](int64_t id) { return caches_[id]; }
  // The blocks session `id` writes its next n tokens into (its last block copied first when shared).
  void Reserve(int64_t id, int64_t n) {
    Cache& c = caches_[id];
    const int64_t tb = layout_.block_tokens;
    if (c.length % tb != 0 && pool_.RefCount(c.blocks.back()) > 1) {
      char* copy = pool_.Allocate(layout_.BlockBytes());
      std::memcpy(copy, c.blocks.back(), layout_.BlockBytes());
      pool_.Unref(c.blocks.back());
      c.blocks.back() = copy;
    }
    while (static_cast<int64_t>(c.blocks.size()) * tb < c.length + n) {
      char* block = pool_.Allocate(layout_.BlockBytes());
      std::memset(block, 0xff, layout_.BlockBytes());  // NaN-filled (in every dtype): unwritten slots must not count
      c.blocks.push_back(block);
    }
  }
  void Fork(int64_t from, int64_t to) {
    caches_[to] = caches_[from];
    for (char* block : caches_[to].blocks) pool_.Ref(block);
  }
  void Truncate(int64_t id, int64_t length) {
    Cache& c = caches_[id];
    c.length = length;
    const size_t keep = (length + layout_.block_tokens - 1) / layout_.block_tokens;
    for (size_t b = keep; b < c.blocks.size(); ++b) pool_.Unref(c.blocks[b]);
    c.blocks.resize(keep);
  }

 private:
  static constexpr int64_t kPoolBytes = int64_t{64} << 20;
  static std::unique_ptr<CacheArena> ArenaOf(Backend* backend) {
    if (backend == nullptr) return nullptr;
    absl::StatusOr<std::unique_ptr<CacheArena>> arena = backend->AllocateCacheArena(kPoolBytes);
    return arena.ok() ? *std::move(arena) : nullptr;
  }
  static std::unique_ptr<BlockPool> PoolOn(CacheArena* arena) {
    return arena != nullptr ? std::make_unique<BlockPool>(arena->base(), arena->bytes())
                            : std::make_unique<BlockPool>(kPoolBytes);
  }

  const KvCacheLayout layout_;
  std::unique_ptr<CacheArena> arena_;       // destroyed after the pool
  std::unique_ptr<BlockPool> pool_holder_;
  BlockPool& pool_ = *pool_holder_;
  std::map<int64_t, Cache> caches_;
};

// One case's sessions on one backend: each session's tokens so far (its inputs), its caches, and every Extend
// output, row by row as the stateless call over the whole sequence would give them.
class SessionRun {
 public:
  SessionRun(const SessionCase& c, Backend& backend, const Layer* layer)
      : c_(c), backend_(backend), layer_(layer), caches_(Layout(), &backend, c.host_memory) {
    problem_.heads.num_heads = c.heads;
    problem_.heads.num_kv_heads = c.kv_heads;
    problem_.heads.head_dim = c.head_dim;
    problem_.heads.causal = true;
    problem_.heads.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    problem_.heads.rope_theta = c.rope_theta;
    problem_.heads.rope_dim = c.rope_theta != 0 && c.rope_dim == 0 ? c.head_dim : c.rope_dim;
    problem_.heads.rope_interleaved = c.rope_interleaved;
    problem_.heads.rope_scaling = c.rope_scaling;
    problem_.d_model = c.layer ? c.d_model : 0;
    problem_.cache = Layout();
    problem_.input_dtype = c.input_dtype;
    problem_.output_dtype = c.output_dtype;
    problem_.return_weights = c.weights;
  }

  KvCacheLayout Layout() const { return {c_.kv_heads, c_.head_dim, c_.block_tokens, c_.cache_dtype}; }
  const PagedProblem& problem() const { return problem_; }
  int64_t InputWidth() const { return c_.layer ? c_.d_model : (c_.heads + 2 * c_.kv_heads) * c_.head_dim; }
  int64_t OutputWidth() const { return c_.layer ? c_.d_model : c_.heads * c_.head_dim; }

  // One Extend call: session ids with their new tokens' inputs (n rows of InputWidth fp32 values each, exact in
  // the input dtype); appends each session's outputs (and weights) to its record.
  absl::Status Extend(const std::vector<std::pair<int64_t, std::vector<float>>>& items) {
    std::vector<PagedSequence> sequences(items.size());
    std::vector<std::string> inputs[3], outputs(items.size()), weights(items.size());
    std::vector<std::vector<float>> stats(items.size());  // 6 arrays of [H, n]: RowStats' order
    std::vector<std::vector<char*>> tables(items.size());
    const int64_t qw = c_.heads * c_.head_dim, kvw = c_.kv_heads * c_.head_dim;
    const size_t in_size = DTypeSize(c_.input_dtype), out_size = DTypeSize(c_.output_dtype);
    for (int k = 0; k < 3; ++k) inputs[k].resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const auto& [id, rows] = items[i];
      const int64_t n = static_cast<int64_t>(rows.size()) / InputWidth();
      caches_.Reserve(id, n);
      PagedSequence& seq = sequences[i];
      tables[i] = caches_[id].blocks;
      seq.blocks = tables[i];
      seq.length = caches_[id].length;
      seq.new_tokens = n;
      // The inputs in their wire dtype: x, or q | k | v split out of each row.
      const int64_t widths[3] = {c_.layer ? c_.d_model : qw, kvw, kvw};
      for (int k = 0; k < (c_.layer ? 1 : 3); ++k) {
        std::vector<float> part;
        const int64_t offset = k == 0 ? 0 : k == 1 ? qw : qw + kvw;
        for (int64_t r = 0; r < n; ++r) {
          part.insert(part.end(), rows.begin() + r * InputWidth() + offset,
                      rows.begin() + r * InputWidth() + offset + widths[k]);
        }
        inputs[k][i].resize(part.size() * in_size);
        EncodeFromFloat(c_.input_dtype, part.data(), part.size(), inputs[k][i].data());
      }
      if (c_.layer) {
        seq.x = {inputs[0][i].data(), c_.input_dtype};
      } else {
        seq.q = {inputs[0][i].data(), c_.input_dtype};
        seq.k = {inputs[1][i].data(), c_.input_dtype};
        seq.v = {inputs[2][i].data(), c_.input_dtype};
      }
      outputs[i] = NanBytes(n * OutputWidth(), c_.output_dtype);
      seq.out = {outputs[i].data(), c_.output_dtype};
      if (c_.weights) {
        weights[i] = NanBytes(c_.heads * n * (seq.length + n), c_.output_dtype);
        seq.weights = {weights[i].data(), c_.output_dtype};
      }
      if (c_.stats) {
        const int64_t m = c_.heads * n;
        stats[i].assign(6 * m, std::nanf(""));
        float* a = stats[i].data();
        seq.stats = {a, a + m, a + 2 * m, a + 3 * m, a + 4 * m, c_.layer ? a + 5 * m : nullptr, 3};
        if (!c_.layer) std::fill(a + 5 * m, a + 6 * m, 0.0f);
      }
    }
    PagedArgs args;
    args.problem = problem_;
    args.problem.return_stats = c_.stats;
    args.problem.sequences = static_cast<int64_t>(items.size());
    for (const PagedSequence& seq : sequences) {
      args.problem.new_tokens += seq.new_tokens;
      args.problem.max_new_tokens = std::max(args.problem.max_new_tokens, seq.new_tokens);
      args.problem.max_length = std::max(args.problem.max_length, seq.length + seq.new_tokens);
    }
    if (layer_ != nullptr) args.weights = layer_->Weights();
    args.sequences = sequences;
    if (absl::Status status = backend_.PagedAttention(args); !status.ok()) return status;
    for (size_t i = 0; i < items.size(); ++i) {
      const int64_t id = items[i].first, n = sequences[i].new_tokens;
      caches_[id].length += n;
      tokens_[id].insert(tokens_[id].end(), items[i].second.begin(), items[i].second.end());
      std::vector<float> out(n * OutputWidth());
      DecodeToFloat(c_.output_dtype, outputs[i].data(), out.size(), out.data());
      out_[id].insert(out_[id].end(), out.begin(), out.end());
      if (c_.weights) {
        std::vector<float> w(weights[i].size() / out_size);
        DecodeToFloat(c_.output_dtype, weights[i].data(), w.size(), w.data());
        weights_[id].push_back(std::move(w));
      }
      if (c_.stats) stats_[id].push_back(std::move(stats[i]));
    }
    return absl::OkStatus();
  }

  void Fork(int64_t from, int64_t to) {
    caches_.Fork(from, to);
    tokens_[to] = tokens_[from];
    out_[to] = out_[from];
  }
  void Truncate(int64_t id, int64_t length) {
    caches_.Truncate(id, length);
    tokens_[id].resize(length * InputWidth());
    out_[id].resize(length * OutputWidth());
  }

  const std::vector<float>& tokens(int64_t id) { return tokens_[id]; }
  const std::vector<float>& outputs(int64_t id) { return out_[id]; }
  const std::vector<std::vector<float>>& weights(int64_t id) { return weights_[id]; }
  const std::vector<std::vector<float>>& stats(int64_t id) { return stats_[id]; }

 private:
  static std::string NanBytes(int64_t n, v1::DataType dtype) {
    const std::vector<float> nan(n, std::nanf(""));
    std::string bytes(n * DTypeSize(dtype), '\0');
    EncodeFromFloat(dtype, nan.data(), n, bytes.data());
    return bytes;
  }

  const SessionCase c_;
  Backend& backend_;
  const Layer* const layer_;
  PagedProblem problem_;
  TestCaches caches_;
  std::map<int64_t, std::vector<float>> tokens_, out_;
  std::map<int64_t, std::vector<std::vector<float>>> weights_, stats_;
};

// Runs the case's steps and plot on `backend`, with token inputs from fixed seeds (so every backend sees the same).
absl::Status Drive(const SessionCase& c, SessionRun& run) {
  const auto tokens = [&](int64_t n, uint32_t seed) {
    std::vector<float> rows = RandomVector(n * run.InputWidth(), seed, 1.0f);
    // Exact in the input dtype, so that every backend starts from the same values.
    std::string bytes(rows.size() * DTypeSize(c.input_dtype), '\0');
    EncodeFromFloat(c.input_dtype, rows.data(), rows.size(), bytes.data());
    DecodeToFloat(c.input_dtype, bytes.data(), rows.size(), rows.data());
    return rows;
  };
  uint32_t seed = 100;
  for (const std::vector<int64_t>& step : c.steps) {
    std::vector<std::pair<int64_t, std::vector<float>>> items;
    for (size_t s = 0; s < step.size(); ++s) {
      if (step[s] > 0) items.emplace_back(static_cast<int64_t>(s), tokens(step[s], ++seed));
    }
    if (absl::Status status = run.Extend(items); !status.ok()) return status;
  }
  if (c.plot == SessionPlot::kForkDiverge) {
    run.Fork(0, 99);
    if (absl::Status status = run.Extend({{0, tokens(3, 901)}, {99, tokens(17, 902)}}); !status.ok()) return status;
    return run.Extend({{99, tokens(1, 903)}, {0, tokens(1, 904)}});
  }
  if (c.plot == SessionPlot::kCascade) {  // ragged (1 to 3 tokens), in an order other than the forks'
    for (int64_t id : {1, 2, 99}) run.Fork(0, id);
    absl::Status status =
        run.Extend({{2, tokens(1, 911)}, {0, tokens(1, 912)}, {99, tokens(3, 913)}, {1, tokens(2, 914)}});
    if (status.ok()) status = run.Extend({{99, tokens(1, 915)}, {0, tokens(1, 916)}, {1, tokens(1, 917)}});
    return status.ok() ? run.Extend({{0, tokens(1, 918)}, {1, tokens(1, 919)}, {2, tokens(1, 920)}}) : status;
  }
  if (c.plot == SessionPlot::kTruncateExtend) {
    const int64_t length = static_cast<int64_t>(run.tokens(0).size()) / run.InputWidth();
    run.Truncate(0, length - c.block_tokens / 2 - 1);
    if (absl::Status status = run.Extend({{0, tokens(5, 905)}}); !status.ok()) return status;
    return run.Extend({{0, tokens(1, 906)}});
  }
  return absl::OkStatus();
}

// The stateless causal computation over session `id`'s whole sequence on the reference backend (the session's
// RoPE on the MultiHeadAttention or ScaledDotProductAttention call): its rows are what the Extends must return.
std::vector<float> StatelessRows(const SessionCase& c, const PagedProblem& p, const Layer* layer,
                                 const std::vector<float>& tokens, Backend& reference) {
  const int64_t width = c.layer ? c.d_model : (c.heads + 2 * c.kv_heads) * c.head_dim;
  const int64_t T = static_cast<int64_t>(tokens.size()) / width;
  AttentionShape s;
  s.batch = 1;
  s.q_len = s.kv_len = T;
  s.heads = p.heads;
  std::vector<float> out(T * (c.layer ? c.d_model : c.heads * c.head_dim));
  if (c.layer) {
    s.d_model = s.d_kv_in = s.d_v_in = c.d_model;
    MhaArgs a;
    a.shape = s;
    a.weights = layer->Weights();
    a.kv_source = KvSource::kQuery;
    a.query = a.key = a.value = {tokens.data(), v1::FP32};
    a.out = {out.data(), v1::FP32};
    EXPECT_OK(reference.MultiHeadAttention(a));
    return out;
  }
  const int64_t qw = c.heads * c.head_dim, kvw = c.kv_heads * c.head_dim;
  std::vector<float> q, k, v;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = tokens.data() + t * width;
    q.insert(q.end(), row, row + qw);
    k.insert(k.end(), row + qw, row + qw + kvw);
    v.insert(v.end(), row + qw + kvw, row + width);
  }
  SdpaArgs a;
  a.shape = s;
  a.q = {q.data(), v1::FP32};
  a.k = {k.data(), v1::FP32};
  a.v = {v.data(), v1::FP32};
  a.out = {out.data(), v1::FP32};
  EXPECT_OK(reference.ScaledDotProductAttention(a));
  return out;
}

// The layer of a layer-session case (fused Q|K|V, as the server holds a self-attention layer).
std::shared_ptr<const Layer> SessionLayer(const SessionCase& c) {
  if (!c.layer) return nullptr;
  Case mha = Make(c.name, 1, 1, 1, c.d_model, 0, c.heads, c.kv_heads, c.head_dim);
  mha.bias = c.bias;
  return Problem(mha).layer();
}

std::vector<SessionCase> SessionCases() {
  std::vector<SessionCase> cases;
  SessionCase c;
  c.name = "session_layer_chunks_gqa_rope";
  c.d_model = 64;
  c.steps = {{5}, {1}, {1}, {20}, {1}, {1}};
  c.rope_theta = 10000;
  c.bias = true;
  cases.push_back(c);
  c.name = "session_layer_ragged_mha_interleaved_partial_rope";
  c.heads = c.kv_heads = 4;
  c.rope_interleaved = true;
  c.rope_dim = 8;
  c.steps = {{7, 1, 33}, {1, 1, 0}, {1, 20, 1}, {0, 1, 1}};
  cases.push_back(c);
  c = SessionCase();
  c.name = "session_layer_mqa_weights";
  c.d_model = 48;
  c.heads = 6;
  c.kv_heads = 1;
  c.head_dim = 8;
  c.weights = true;
  c.steps = {{9, 2}, {1, 1}, {8, 1}};
  cases.push_back(c);
  c = SessionCase();
  c.name = "session_layer_fork_diverge";
  c.d_model = 64;
  c.rope_theta = 500000;
  c.steps = {{21}};
  c.plot = SessionPlot::kForkDiverge;
  cases.push_back(c);
  c.name = "session_layer_truncate_extend";
  c.steps = {{30}, {10}};
  c.plot = SessionPlot::kTruncateExtend;
  cases.push_back(c);
  // Head sessions: the decode path (query rows per KV head up to 16) and the gather path, blocks cut at odd places.
  c = SessionCase();
  c.name = "session_heads_decode_gqa4";
  c.layer = false;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 32;
  c.rope_theta = 10000;
  c.steps = {{40, 1}, {1, 15}, {1, 1}, {4, 1}, {5, 1}};  // 4 x 4 = 16 rows decode, 4 x 5 = 20 gather
  cases.push_back(c);
  // A cache long enough to be split across work units (flash-decoding), merged by its log-sum-exp.
  c.name = "session_heads_long_cache_split_kv";
  c.steps = {{1100}, {1}, {2}, {1}};
  cases.push_back(c);
  c.name = "session_heads_block32_odd_head_dim";
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 20;
  c.rope_dim = 12;
  c.block_tokens = 32;
  c.steps = {{33, 2}, {1, 1}, {31, 1}, {1, 1}};
  cases.push_back(c);
  c.name = "session_heads_block5_gathers";  // blocks no decode kernel takes: every call gathers
  c.block_tokens = 5;
  cases.push_back(c);
  // Scaled RoPE: llama3 and yarn are the same at every length; dynamic and longrope change their frequencies as
  // the session passes max_position_embeddings / original_max_position_embeddings (128) in its second call.
  c = SessionCase();
  c.layer = false;
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.rope_theta = 10000;
  c.steps = {{100, 40}, {1, 100}, {1, 1}, {30, 1}};
  for (RopeScaling::Type type : {RopeScaling::Type::kLlama3, RopeScaling::Type::kYarn, RopeScaling::Type::kDynamic,
                                 RopeScaling::Type::kLongrope}) {
    c.name = absl::StrCat("session_heads_rope_", RopeTypeName(type));
    c.rope_scaling = Scaling(type, c.head_dim / 2);
    c.stateless_equal = type == RopeScaling::Type::kLlama3 || type == RopeScaling::Type::kYarn;
    cases.push_back(c);
  }
  c = SessionCase();
  c.name = "session_layer_rope_llama3_bf16_cache";
  c.d_model = 64;
  c.rope_theta = 500000;
  c.rope_scaling = Scaling(RopeScaling::Type::kLlama3);
  c.cache_dtype = v1::BF16;
  c.steps = {{70}, {1}, {1}};
  cases.push_back(c);
  c = SessionCase();
  c.name = "session_heads_fork_diverge_weights";
  c.layer = false;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.weights = true;
  c.steps = {{19}};
  c.plot = SessionPlot::kForkDiverge;
  cases.push_back(c);
  // 16-bit caches, with fp32 and 16-bit wires.
  for (v1::DataType cache : {v1::FP16, v1::BF16}) {
    SessionCase heads = SessionCase();
    heads.name = "session_heads_decode_cache_" + DTypeName(cache);
    heads.layer = false;
    heads.heads = 8;
    heads.kv_heads = 2;
    heads.head_dim = 64;
    heads.cache_dtype = cache;
    heads.rope_theta = 10000;
    heads.steps = {{600, 1}, {1, 1}, {1, 30}, {1, 1}};
    cases.push_back(heads);
    heads.name += "_wire";
    heads.input_dtype = heads.output_dtype = cache;
    cases.push_back(heads);
    SessionCase layer = SessionCase();
    layer.name = "session_layer_truncate_cache_" + DTypeName(cache);
    layer.d_model = 64;
    layer.cache_dtype = cache;
    layer.bias = true;
    layer.steps = {{40}, {1}};
    layer.plot = SessionPlot::kTruncateExtend;
    cases.push_back(layer);
  }
  // bf16 caches in 32-token blocks, the decode kernels' 32-lane steps: on AVX512-BF16 ("cpu", "cpu/avx512bf16")
  // dot products over interleaved pairs of rows, whose lanes are put back in order; head_dim 80 ends in a partial
  // step of 16 columns, and the odd key counts of the steps leave a key without its pair.
  for (int64_t head_dim : {128, 80}) {
    SessionCase pairs = SessionCase();
    pairs.name = "session_heads_decode_cache_bf16_block32_dk" + std::to_string(head_dim);
    pairs.layer = false;
    pairs.heads = 8;
    pairs.kv_heads = 2;
    pairs.head_dim = head_dim;
    pairs.block_tokens = 32;
    pairs.cache_dtype = v1::BF16;
    pairs.steps = {{70, 1}, {1, 1}, {1, 3}, {1, 1}};
    cases.push_back(pairs);
  }
  // The prefill path (more query rows per KV head than decode's, no weights): tiles of new tokens over the blocks in
  // place, causal within the chunk, chunks deep into the cache; blocks of 32 (the AVX-512 prefill kernels' 32-key
  // steps) and 48 (16-key steps), one KV head per query head and eight query heads per KV head (the 8-bit caches:
  // their decode kernels over groups of the tile's rows).
  for (v1::DataType cache : {v1::FP32, v1::FP16, v1::BF16, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    SessionCase prefill = SessionCase();
    prefill.name = "session_heads_prefill_block32_cache_" + DTypeName(cache);
    prefill.layer = false;
    prefill.heads = 8;
    prefill.kv_heads = 2;
    prefill.head_dim = 64;
    prefill.block_tokens = 32;
    prefill.cache_dtype = cache;
    prefill.rope_theta = 10000;
    prefill.steps = {{200, 40}, {64, 1}, {1, 100}, {2, 2}};  // session 0 past one span of 256 keys
    cases.push_back(prefill);
  }
  c = SessionCase();
  c.name = "session_heads_prefill_mha_block48";
  c.layer = false;
  c.heads = c.kv_heads = 4;
  c.head_dim = 32;
  c.block_tokens = 48;
  c.steps = {{100}, {50}, {20}};
  cases.push_back(c);
  c.name = "session_heads_prefill_mqa_group8";
  c.heads = 8;
  c.kv_heads = 1;
  c.head_dim = 16;
  c.block_tokens = 16;
  c.steps = {{40}, {33}, {3}};
  cases.push_back(c);
  // 8-bit caches (quantized_cache.h): decode steps on the kernels that compute on the codes (and prefill, below),
  // weights on the gather path, keys whose block scales grow token by token (requantizing the block's earlier keys),
  // an odd head_dim (a padding depth), truncation back into a block, forks that diverge in a shared block.
  for (v1::DataType cache : {v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    SessionCase heads = SessionCase();
    heads.name = "session_heads_decode_cache_" + DTypeName(cache);
    heads.layer = false;
    heads.heads = 8;
    heads.kv_heads = 2;
    heads.head_dim = 64;
    heads.block_tokens = 32;
    heads.cache_dtype = cache;
    heads.rope_theta = 10000;
    heads.steps = {{600, 1}, {1, 1}, {1, 30}, {1, 1}, {1, 1}, {1, 1}};
    cases.push_back(heads);
    // The block size DEPLOY.md suggests for INT8 where memory is fast (64 tokens) at the common head_dim of 128.
    SessionCase wide = heads;
    wide.name = "session_heads_decode_block64_dk128_cache_" + DTypeName(cache);
    wide.head_dim = 128;
    wide.block_tokens = 64;
    wide.steps = {{200, 1}, {1, 1}, {1, 10}, {1, 1}};
    cases.push_back(wide);
    heads.name += "_wire_bf16";
    heads.input_dtype = heads.output_dtype = v1::BF16;
    cases.push_back(heads);
    SessionCase odd = SessionCase();
    odd.name = "session_heads_decode_dk81_mha_cache_" + DTypeName(cache);
    odd.layer = false;
    odd.heads = odd.kv_heads = 2;
    odd.head_dim = 81;
    odd.cache_dtype = cache;
    odd.steps = {{20, 3}, {1, 1}, {1, 14}, {1, 1}, {1, 1}};
    cases.push_back(odd);
    SessionCase layer = SessionCase();
    layer.name = "session_layer_truncate_cache_" + DTypeName(cache);
    layer.d_model = 64;
    layer.cache_dtype = cache;
    layer.bias = true;
    layer.steps = {{40}, {1}, {1}};
    layer.plot = SessionPlot::kTruncateExtend;
    cases.push_back(layer);
    SessionCase fork = SessionCase();
    fork.name = "session_heads_fork_diverge_cache_" + DTypeName(cache);
    fork.layer = false;
    fork.heads = 4;
    fork.kv_heads = 1;
    fork.head_dim = 32;
    fork.cache_dtype = cache;
    fork.steps = {{19}, {1}};
    fork.plot = SessionPlot::kForkDiverge;
    cases.push_back(fork);
    fork.name += "_weights";
    fork.weights = true;
    cases.push_back(fork);
  }
  // Cascade decode: four sessions sharing a prompt's blocks (forks) decode together, every cache dtype; a prompt of
  // several shared splits; statistics; blocks of 12 keys; a layer.
  for (v1::DataType cache : {v1::FP32, v1::FP16, v1::BF16, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    SessionCase cascade;
    cascade.name = "session_heads_cascade_cache_" + DTypeName(cache);
    cascade.layer = false;
    cascade.heads = 8;
    cascade.kv_heads = 2;
    cascade.head_dim = 64;
    cascade.cache_dtype = cache;
    cascade.rope_theta = 10000;
    cascade.steps = {{200}};
    cascade.plot = SessionPlot::kCascade;
    cases.push_back(cascade);
    if (cache != v1::BF16) continue;
    cascade.name = "session_heads_cascade_long_bf16";
    cascade.steps = {{700}, {500}};
    cases.push_back(cascade);
    cascade.name = "session_heads_cascade_stats_bf16";
    cascade.steps = {{200}};
    cascade.stats = true;
    cases.push_back(cascade);
    cascade.name = "session_heads_cascade_block12_bf16";  // blocks of 12 keys: tiles straddle blocks
    cascade.stats = false;
    cascade.block_tokens = 12;
    cases.push_back(cascade);
    cascade = SessionCase();
    cascade.name = "session_layer_cascade_block32";
    cascade.d_model = 64;
    cascade.block_tokens = 32;
    cascade.steps = {{100}};
    cascade.plot = SessionPlot::kCascade;
    cases.push_back(cascade);
  }
  // Every statistic of every call, contribution included, for a layer and for head sessions.
  for (const char* name : {"session_layer_chunks_gqa_rope", "session_heads_decode_gqa4",
                           "session_heads_decode_cache_int8"}) {
    for (const SessionCase& known : std::vector<SessionCase>(cases)) {
      if (known.name != name) continue;
      SessionCase with = known;
      with.name += "_stats";
      with.stats = true;
      cases.push_back(with);
    }
  }
  // Blocks in host memory on a backend that lends cache memory of its own: a GPU backend stages them through the
  // device and writes the new tokens back (the other cases read them in place).
  for (const char* name : {"session_heads_decode_gqa4", "session_layer_truncate_cache_bf16",
                           "session_heads_fork_diverge_weights"}) {
    for (const SessionCase& known : std::vector<SessionCase>(cases)) {
      if (known.name != name) continue;
      SessionCase host = known;
      host.name += "_host_memory";
      host.host_memory = true;
      cases.push_back(host);
    }
  }
  return cases;
}

// Tolerances: the backend against the reference on the same cache (both round K and V to the cache's dtype, from
// fp32 and from double: a value on a rounding boundary may land one ulp apart), and the reference's session against
// the stateless call, whose K and V are never rounded.
double BackendTolerance(const SessionCase& c) {
  double tolerance = c.cache_dtype == v1::BF16 ? 1e-2 : c.cache_dtype == v1::FP16 ? 2e-3 : 2e-5;
  // The 8-bit caches: the same codes, products on them rounded (an INT8 decode step's q to int16, its probabilities
  // to 7 bits per block), and a key on a code's rounding boundary may land one code apart.
  if (IsCacheOnlyDType(c.cache_dtype)) tolerance = 5e-3;
  if (c.output_dtype == v1::BF16) tolerance = std::max(tolerance, 8e-3);
  if (c.output_dtype == v1::FP16) tolerance = std::max(tolerance, 1e-3);
  return tolerance;
}
double StatelessTolerance(const SessionCase& c) {
  // The 8-bit caches' codes against never-rounded K and V, element by element (their error over whole outputs is
  // quantized_cache_test's): a few percent of the values' range.
  if (IsCacheOnlyDType(c.cache_dtype)) return c.cache_dtype == v1::FP8_E5M2 ? 0.25 : 0.12;
  return std::max(BackendTolerance(c), c.cache_dtype == v1::BF16 ? 3e-2 : c.cache_dtype == v1::FP16 ? 4e-3 : 2e-5);
}

class SessionConformanceTest : public ::testing::TestWithParam<std::tuple<SessionCase, std::string>> {};

TEST_P(SessionConformanceTest, ExtendsMatchTheReference) {
  const SessionCase& c = std::get<0>(GetParam());
  const std::string& label = std::get<1>(GetParam());
  absl::StatusOr<std::unique_ptr<Backend>> backend = Create(label);
  if (absl::IsUnavailable(backend.status())) GTEST_SKIP() << label << ": " << backend.status().message();
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  const std::shared_ptr<const Layer> layer = SessionLayer(c);
  SessionRun want(c, *reference, layer.get()), got(c, **backend, layer.get());
  if (absl::Status supported = (*backend)->SupportsPaged(got.problem()); !supported.ok()) {
    EXPECT_EQ(supported.code(), absl::StatusCode::kUnimplemented) << supported;
    EXPECT_EQ(Drive(c, got).code(), absl::StatusCode::kUnimplemented);
    GTEST_SKIP() << label << " does not support sessions: " << supported.message();
  }
  ASSERT_OK(Drive(c, want));
  ASSERT_OK(Drive(c, got));
  for (int64_t id : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{99}}) {
    if (want.tokens(id).empty()) continue;
    EXPECT_EQ(NaNCount(want.outputs(id)), 0) << "session " << id << ": the reference left outputs unwritten";
    EXPECT_TRUE(AllClose(got.outputs(id), want.outputs(id), BackendTolerance(c), BackendTolerance(c)))
        << "session " << id << " against the reference";
    for (size_t step = 0; step < want.weights(id).size(); ++step) {
      EXPECT_EQ(NaNCount(want.weights(id)[step]), 0) << "session " << id << ": the reference's weights of " << step;
      EXPECT_TRUE(AllClose(got.weights(id)[step], want.weights(id)[step], BackendTolerance(c), BackendTolerance(c)))
          << "session " << id << " weights of its call " << step;
    }
    ASSERT_EQ(got.stats(id).size(), want.stats(id).size());
    for (size_t step = 0; step < want.stats(id).size(); ++step) {
      EXPECT_EQ(NaNCount(want.stats(id)[step]), 0) << "session " << id << ": the reference's statistics of " << step;
      // Distances are in tokens: relative tolerance matters for them.
      EXPECT_TRUE(AllClose(got.stats(id)[step], want.stats(id)[step], 10 * BackendTolerance(c), 1e-3))
          << "session " << id << " statistics (lse, entropy, confidence, distance, sink, contribution) of its call "
          << step;
    }
  }
}

// The ground truth's sessions against its own stateless path: chunked Extends (forks, truncations) return what one
// causal call over each whole sequence returns for those rows.
class SessionReferenceTest : public ::testing::TestWithParam<SessionCase> {};

TEST_P(SessionReferenceTest, ExtendsEqualOneStatelessCausalCall) {
  const SessionCase& c = GetParam();
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  const std::shared_ptr<const Layer> layer = SessionLayer(c);
  SessionRun run(c, *reference, layer.get());
  ASSERT_OK(Drive(c, run));
  for (int64_t id : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{99}}) {
    if (run.tokens(id).empty()) continue;
    const std::vector<float> stateless = StatelessRows(c, run.problem(), layer.get(), run.tokens(id), *reference);
    EXPECT_TRUE(AllClose(run.outputs(id), stateless, StatelessTolerance(c), StatelessTolerance(c))) << "session " << id;
  }
}

std::vector<SessionCase> StatelessEqualCases() {
  std::vector<SessionCase> cases = SessionCases();
  cases.erase(std::remove_if(cases.begin(), cases.end(), [](const SessionCase& c) { return !c.stateless_equal; }),
              cases.end());
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Reference, SessionReferenceTest, ::testing::ValuesIn(StatelessEqualCases()),
                         [](const auto& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(Backends, SessionConformanceTest,
                         ::testing::Combine(::testing::ValuesIn(SessionCases()), ::testing::ValuesIn(Labels())),
                         TestName<SessionConformanceTest::ParamType>);

// The backend `label` names, where it runs paged calls like `probe`; null with *skip saying why where this CPU lacks
// its instructions or it refuses such calls (null with *skip empty: it failed otherwise, a test failure).
std::unique_ptr<Backend> PagedBackend(const std::string& label, const PagedProblem& probe, std::string* skip) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = Create(label);
  if (absl::IsUnavailable(backend.status())) {
    *skip = absl::StrCat(label, ": ", backend.status().message());
    return nullptr;
  }
  if (!backend.ok()) {
    ADD_FAILURE() << backend.status();
    return nullptr;
  }
  if (absl::Status supported = (*backend)->SupportsPaged(probe); !supported.ok()) {
    *skip = absl::StrCat(label, ": ", supported.message());
    return nullptr;
  }
  return *std::move(backend);
}

// ---------------------------------------------------------------------------------------------------------------
// Cascade decode's statistics: four forks of a 40-token prompt (two full shared blocks of 16) decode one token each
// in one call, every statistic asked for with 8 sink keys (all shared: the sink mass and distance come mostly from
// the shared blocks' split), every backend against the reference at the PagedStatsTest's tolerance.

struct CascadeStatsCase {
  std::string name;
  v1::DataType cache_dtype;
};

std::ostream& operator<<(std::ostream& os, const CascadeStatsCase& c) { return os << c.name; }

class CascadeStatsTest : public ::testing::TestWithParam<std::tuple<CascadeStatsCase, std::string>> {};

// The test's heads (H = 8 over Hkv = 2, d_k = 64) and cache (blocks of 16 tokens).
PagedProblem CascadeProblem(v1::DataType cache_dtype) {
  PagedProblem p;
  p.heads.num_heads = 8;
  p.heads.num_kv_heads = 2;
  p.heads.head_dim = 64;
  p.heads.causal = true;
  p.heads.scale = 0.125f;
  p.cache = {2, 64, 16, cache_dtype};
  p.input_dtype = p.output_dtype = v1::FP32;
  return p;
}

// The call's outputs and five statistics per sequence (lse, entropy, confidence, distance, sink mass: [H] each).
std::vector<std::vector<float>> CascadeStep(Backend& backend, v1::DataType cache_dtype) {
  constexpr int64_t kSessions = 4, kWidth = 8 * 64, kKvWidth = 2 * 64;
  const PagedProblem p = CascadeProblem(cache_dtype);
  TestCaches caches(p.cache, &backend);
  std::vector<std::vector<float>> q, k, v, got;
  std::vector<PagedSequence> sequences(kSessions);
  const auto add = [&](int64_t id, int64_t n, uint32_t seed) {
    caches.Reserve(id, n);
    q.push_back(RandomVector(n * kWidth, seed, 1.0f));
    k.push_back(RandomVector(n * kKvWidth, seed + 1, 1.0f));
    v.push_back(RandomVector(n * kKvWidth, seed + 2, 1.0f));
    got.emplace_back(n * kWidth, std::nanf(""));
    PagedSequence seq;
    seq.blocks = caches[id].blocks;
    seq.length = caches[id].length;
    seq.new_tokens = n;
    seq.q = {q.back().data(), v1::FP32};
    seq.k = {k.back().data(), v1::FP32};
    seq.v = {v.back().data(), v1::FP32};
    seq.out = {got.back().data(), v1::FP32};
    return seq;
  };
  const auto run = [&](absl::Span<const PagedSequence> seqs, bool stats) {
    PagedArgs args;
    args.problem = p;
    args.problem.return_stats = stats;
    args.problem.sequences = static_cast<int64_t>(seqs.size());
    for (const PagedSequence& seq : seqs) {
      args.problem.new_tokens += seq.new_tokens;
      args.problem.max_new_tokens = std::max(args.problem.max_new_tokens, seq.new_tokens);
      args.problem.max_length = std::max(args.problem.max_length, seq.Keys());
    }
    args.sequences = seqs;
    const absl::Status status = backend.PagedAttention(args);
    EXPECT_TRUE(status.ok()) << status;
  };
  const PagedSequence prompt = add(0, 40, 51);
  run(absl::MakeConstSpan(&prompt, 1), false);
  caches[0].length = 40;
  for (int64_t id = 1; id < kSessions; ++id) caches.Fork(0, id);
  q.clear(), k.clear(), v.clear(), got.clear();
  std::vector<std::vector<float>> stats(kSessions * 5, std::vector<float>(8, std::nanf("")));
  for (int64_t id = 0; id < kSessions; ++id) {
    sequences[id] = add(id, 1, 61 + 3 * static_cast<uint32_t>(id));
    std::vector<float>* s = &stats[id * 5];
    sequences[id].stats = {s[0].data(), s[1].data(), s[2].data(), s[3].data(), s[4].data(), nullptr, 8};
  }
  run(sequences, true);
  got.insert(got.end(), stats.begin(), stats.end());
  return got;
}

TEST_P(CascadeStatsTest, MatchesTheReference) {
  const v1::DataType cache = std::get<0>(GetParam()).cache_dtype;
  PagedProblem probe = CascadeProblem(cache);
  probe.return_stats = true;
  std::string skip;
  const std::unique_ptr<Backend> backend = PagedBackend(std::get<1>(GetParam()), probe, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(backend, nullptr);
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  const std::vector<std::vector<float>> want = CascadeStep(*reference, cache), got = CascadeStep(*backend, cache);
  ASSERT_EQ(got.size(), want.size());
  const char* names[] = {"lse", "entropy", "confidence", "distance", "sink mass"};
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_TRUE(AllClose(got[k], want[k], 3e-2, 3e-2)) << (k < 4 ? "output" : names[(k - 4) % 5]) << " " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CascadeStatsTest,
                         ::testing::Combine(::testing::Values(CascadeStatsCase{"cascade_stats_bf16", v1::BF16},
                                                              CascadeStatsCase{"cascade_stats_int8", v1::INT8}),
                                            ::testing::ValuesIn(Labels())),
                         TestName<CascadeStatsTest::ParamType>);

// ---------------------------------------------------------------------------------------------------------------
// Softmax statistics of paged calls (the decode path of few rows, the prefill path of many) and new tokens that
// attend to a cache without joining it (ExtendItem.append = false), every backend against the reference.

struct PagedStatsCase {
  std::string name;
  int64_t new_tokens;  // of the step after a 70-token prefill
  bool append;
  v1::DataType cache_dtype;
  int64_t prefill = 70;  // 2000: the decode path splits the cache over the threads and merges the splits
};

std::ostream& operator<<(std::ostream& os, const PagedStatsCase& c) { return os << c.name; }

// A head session (H = 4 over Hkv = 2, d_k = 16, blocks of 16 tokens) on `backend`: the case's prefill, then the
// case's step with every statistic asked for; returns the step's output followed by its five statistics (lse,
// entropy, confidence, distance, sink mass: [H, n] each; a head session has no contribution).
std::vector<std::vector<float>> PagedStep(Backend& backend, const PagedStatsCase& c) {
  PagedProblem p;
  p.heads.num_heads = 4;
  p.heads.num_kv_heads = 2;
  p.heads.head_dim = 16;
  p.heads.causal = true;
  p.heads.scale = 0.25f;
  p.cache = {2, 16, 16, c.cache_dtype};
  p.input_dtype = p.output_dtype = v1::FP32;
  TestCaches caches(p.cache, &backend);
  const auto call = [&](int64_t n, bool append, bool stats, uint32_t seed, std::vector<std::vector<float>>* got) {
    if (append) caches.Reserve(0, n);
    std::vector<float> q = RandomVector(n * 64, seed, 1.0f), k = RandomVector(n * 32, seed + 1, 1.0f),
                       v = RandomVector(n * 32, seed + 2, 1.0f), out(n * 64, std::nanf(""));
    std::vector<std::vector<float>> stat(5, std::vector<float>(4 * n, std::nanf("")));
    PagedSequence seq;
    std::vector<char*> blocks = caches[0].blocks;
    seq.blocks = blocks;
    seq.length = caches[0].length;
    seq.new_tokens = n;
    seq.append = append;
    seq.q = {q.data(), v1::FP32};
    seq.k = {k.data(), v1::FP32};
    seq.v = {v.data(), v1::FP32};
    seq.out = {out.data(), v1::FP32};
    if (stats) {
      seq.stats = {stat[0].data(), stat[1].data(), stat[2].data(), stat[3].data(), stat[4].data(), nullptr, 3};
    }
    PagedArgs args;
    args.problem = p;
    args.problem.return_stats = stats;
    args.problem.sequences = 1;
    args.problem.new_tokens = args.problem.max_new_tokens = n;
    args.problem.max_length = seq.Keys();
    args.sequences = absl::MakeConstSpan(&seq, 1);
    const absl::Status status = backend.PagedAttention(args);
    EXPECT_TRUE(status.ok()) << status;
    if (append) caches[0].length += n;
    if (got != nullptr) {
      got->push_back(out);
      for (auto& s : stat) got->push_back(s);
    }
  };
  call(c.prefill, true, false, 31, nullptr);
  std::vector<std::vector<float>> got;
  call(c.new_tokens, c.append, true, 41, &got);
  EXPECT_EQ(caches[0].length, c.prefill + (c.append ? c.new_tokens : 0)) << "the cache's length after the step";
  return got;
}

class PagedStatsTest : public ::testing::TestWithParam<std::tuple<PagedStatsCase, std::string>> {};

TEST_P(PagedStatsTest, MatchesTheReference) {
  const PagedStatsCase& c = std::get<0>(GetParam());
  PagedProblem probe;
  probe.heads.num_heads = 4;
  probe.heads.num_kv_heads = 2;
  probe.heads.head_dim = 16;
  probe.cache = {2, 16, 16, c.cache_dtype};
  probe.return_stats = true;
  std::string skip;
  const std::unique_ptr<Backend> backend = PagedBackend(std::get<1>(GetParam()), probe, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(backend, nullptr);
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  const std::vector<std::vector<float>> want = PagedStep(*reference, c), got = PagedStep(*backend, c);
  ASSERT_EQ(got.size(), want.size());
  const double tolerance = c.cache_dtype == v1::FP32 ? 1e-4 : 3e-2;
  const char* names[] = {"output", "lse", "entropy", "confidence", "distance", "sink mass"};
  for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(AllClose(got[k], want[k], tolerance, tolerance)) << names[k];
}

std::vector<PagedStatsCase> PagedStatsCases() {
  return {{"decode_step", 1, true, v1::FP32},          {"decode_step_bf16_cache", 1, true, v1::BF16},
          {"chunk_prefill_path", 20, true, v1::FP32},  {"decode_without_append", 1, false, v1::FP32},
          {"chunk_without_append", 20, false, v1::FP32}, {"decode_without_append_bf16", 2, false, v1::BF16},
          {"decode_split_cache", 1, true, v1::FP32, 2000},
          {"decode_split_cache_without_append", 1, false, v1::BF16, 2000},
          // The prefill path deep into a cache: several steps of its online softmax, each over many blocks.
          {"chunk_prefill_path_deep_fp16", 20, true, v1::FP16, 2000},
          {"chunk_without_append_deep_bf16", 20, false, v1::BF16, 2000},
          // 8-bit caches: their decode kernels split over the threads, and over groups of a prefill tile's rows.
          {"decode_split_cache_int8", 1, true, v1::INT8, 2000},
          {"chunk_prefill_path_deep_int8", 20, true, v1::INT8, 2000},
          {"chunk_without_append_deep_fp8_e4m3", 20, false, v1::FP8_E4M3, 2000}};
}

INSTANTIATE_TEST_SUITE_P(Backends, PagedStatsTest,
                         ::testing::Combine(::testing::ValuesIn(PagedStatsCases()), ::testing::ValuesIn(Labels())),
                         TestName<PagedStatsTest::ParamType>);

// Properties of the interface rather than of one case, for every backend.
class BackendContractTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = Create(GetParam());
    if (absl::IsUnavailable(backend.status())) GTEST_SKIP() << GetParam() << ": " << backend.status().message();
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    reference_ = *Create(std::string(kReferenceBackend));
  }
  std::unique_ptr<Backend> backend_, reference_;
};

TEST_P(BackendContractTest, ConcurrentCallsOnOneInstanceMatchSerialOnes) {
  // Backends are thread-safe (tiny calls run concurrently on gRPC's threads): scratch must not be shared.
  std::vector<Case> cases;
  for (int i = 0; i < 4; ++i) {
    Case c = Make("thread", 1 + i, 8 + 5 * i, 8 + 5 * i, 32, 0, 4, i % 2 == 0 ? 4 : 2, 8);
    c.causal = i % 2 == 1;
    cases.push_back(c);
  }
  std::vector<std::vector<float>> serial, concurrent(cases.size());
  std::vector<float> unused;
  for (const Case& c : cases) serial.push_back(Problem(c).Run(*backend_, &unused));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] {
      std::vector<float> weights;
      const Problem p(cases[i]);
      for (int repeat = 0; repeat < 20; ++repeat) concurrent[i] = p.Run(*backend_, &weights);
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(concurrent[i], serial[i]) << "case " << i;
}

TEST_P(BackendContractTest, ScratchFromALargeCallDoesNotLeakIntoSmallerOnes) {
  // Scratch kept at the largest size seen must not carry anything into a smaller or differently shaped call (head
  // size, key count, masks).
  Case large = Make("large", 2, 600, 600, 160, 0, 2, 2, 80);
  large.causal = true;
  Case small = Make("small", 3, 5, 5, 32, 0, 2, 1, 16);
  small.mask = Mask::kPerBatch;
  small.key_lengths = true;
  const Case medium = Make("medium", 1, 40, 70, 64, 24, 4, 2, 16);
  for (const Case& c : {large, small, medium, small}) {
    const Problem p(c);
    std::vector<float> unused;
    EXPECT_TRUE(AllClose(p.Run(*backend_, &unused), p.Run(*reference_, &unused), c.atol, c.rtol)) << c;
  }
}

TEST_P(BackendContractTest, ANaNScoreMakesItsRowNaNNotZero) {
  // The service rejects non-finite inputs, but an overflow inside a computation can still make a NaN score: it
  // must reach the output, as in PyTorch, never be taken for a fully masked row (zeros).
  for (auto [backend, weights] : {std::pair{backend_.get(), false}, std::pair{backend_.get(), true},
                                  std::pair{reference_.get(), false}, std::pair{reference_.get(), true}}) {
    Case c = Make("nan", 1, 4, 6, 0, 0, 2, 2, 8);
    c.sdpa = true;
    c.weights = weights;
    Problem p(c);
    p.PoisonQuery((1 * 2 + 0) * 8 + 3);  // query row 1, head 0
    std::vector<float> unused;
    const std::vector<float> out = p.Run(*backend, &unused);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t d = 0; d < 8; ++d) {
          const float x = out[(i * 2 + h) * 8 + d];
          if (i == 1 && h == 0) {
            EXPECT_TRUE(std::isnan(x)) << backend->name() << " weights " << weights << " element " << d << " is " << x;
          } else {
            EXPECT_TRUE(std::isfinite(x)) << backend->name() << " weights " << weights << " row " << i;
          }
        }
      }
    }
  }
}

TEST_P(BackendContractTest, APagedCallWhoseBlocksDoNotCoverItsTokensIsRefused) {
  PagedArgs args;
  args.problem.heads.num_heads = 2;
  args.problem.heads.num_kv_heads = 1;
  args.problem.heads.head_dim = 8;
  args.problem.heads.scale = 0.35f;
  args.problem.cache = {1, 8, 16, v1::FP32};
  args.problem.sequences = args.problem.new_tokens = args.problem.max_new_tokens = 1;
  args.problem.max_length = 17;
  if (!backend_->SupportsPaged(args.problem).ok()) GTEST_SKIP() << "no paged attention here";
  std::vector<char> block(args.problem.cache.BlockBytes());
  std::vector<float> q(16), kv(8), out(16);
  char* const blocks[] = {block.data()};  // one block of 16 tokens for 17
  PagedSequence seq;
  seq.blocks = blocks;
  seq.length = 16;
  seq.new_tokens = 1;
  seq.q = {q.data(), v1::FP32};
  seq.k = seq.v = {kv.data(), v1::FP32};
  seq.out = {out.data(), v1::FP32};
  args.sequences = {&seq, 1};
  EXPECT_EQ(backend_->PagedAttention(args).code(), absl::StatusCode::kInternal);
}

TEST_P(BackendContractTest, WorkspaceGrowsWithTheProblem) {
  AttentionProblem small, large;
  small.shape = Problem(Make("small", 1, 16, 16, 64, 0, 4, 4, 16)).shape();
  large.shape = Problem(Make("large", 8, 512, 512, 64, 0, 4, 4, 16)).shape();
  EXPECT_LT(backend_->WorkspaceBytes(small), backend_->WorkspaceBytes(large));
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendContractTest, ::testing::ValuesIn(Labels()), [](const auto& info) {
  std::string label = info.param;
  for (char& ch : label) {
    if (ch == '/') ch = '_';
  }
  return label;
});

TEST(BackendRegistry, EveryBackendHasOneDefaultFactory) {
  std::map<std::string, int> defaults;
  for (const BackendFactory& f : BackendRegistry::Factories()) {
    defaults[f.name];
    if (f.variant.empty()) ++defaults[f.name];
  }
  EXPECT_EQ(defaults[std::string(kReferenceBackend)], 1);
  EXPECT_EQ(defaults[std::string(kCpuBackend)], 1);
  for (const auto& [name, count] : defaults) EXPECT_EQ(count, 1) << name;
  // The registry lists every backend the service knows, compiled in or not.
  std::vector<std::string> listed;
  const std::unique_ptr<BackendRegistry> registry = BackendRegistry::Create();
  for (const BackendEntry& entry : registry->entries()) listed.push_back(entry.name);
  EXPECT_THAT(listed, ::testing::UnorderedElementsAre(std::string(kReferenceBackend), std::string(kCpuBackend),
                                                      std::string(kCudaBackend)));
}

}  // namespace
}  // namespace mha
