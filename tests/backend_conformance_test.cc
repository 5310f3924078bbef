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
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/registry.h"
#include "server/layer.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
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
  bool value_is_key = false; // cross-attention without a value tensor (value = key)
  float scale = 0.0f;        // 0: 1/sqrt(d_k)
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

  // Sets element `index` of the query (fp32 cases) to NaN, as only a caller that bypassed validation could.
  void PoisonQuery(int64_t index) {
    const float nan = std::nanf("");
    std::memcpy(query_.data() + index * sizeof(float), &nan, sizeof(float));
  }

  // Runs the case on `backend`; returns the output and, when the case asks for them, the weights in *weights.
  std::vector<float> Run(Backend& backend, std::vector<float>* weights) const {
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
  const Case c = WithToleranceOf(given, (*backend)->ComputeDtype(problem));
  if (absl::Status supported = (*backend)->Supports(problem); !supported.ok()) {
    EXPECT_EQ(supported.code(), absl::StatusCode::kUnimplemented) << supported;
    GTEST_SKIP() << label << " does not support this case: " << supported.message();
  }
  const Problem p(c);
  std::unique_ptr<Backend> reference = *Create(std::string(kReferenceBackend));
  std::vector<float> want_weights, got_weights;
  const std::vector<float> want = p.Run(*reference, &want_weights);
  const std::vector<float> got = p.Run(**backend, &got_weights);
  EXPECT_TRUE(AllClose(got, want, c.atol, c.rtol)) << "output";
  if (c.weights) {
    EXPECT_TRUE(AllClose(got_weights, want_weights, c.atol, c.rtol)) << "attention weights";
  }
  // Again on the same instance: what the first call left in reused scratch must not change the result.
  std::vector<float> again_weights;
  EXPECT_EQ(p.Run(**backend, &again_weights), got);
}

std::string TestName(const ::testing::TestParamInfo<ConformanceTest::ParamType>& info) {
  std::string label = std::get<1>(info.param);
  for (char& ch : label) {
    if (ch == '/') ch = '_';
  }
  return std::get<0>(info.param).name + "_" + label;
}

INSTANTIATE_TEST_SUITE_P(Backends, ConformanceTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::ValuesIn(Labels())), TestName);

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
