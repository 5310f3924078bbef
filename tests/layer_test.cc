// Layers: the size checked before decoding is the size held after, for fused and separate projections, with and
// without biases; a layer over the store's limit is refused before it is decoded.
#include "server/layers/layer.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/layers/layer_store.h"
#include "tests/test_util.h"

namespace mha {
namespace {

struct LayerCase {
  std::string name;
  int64_t d_model, d_kv, heads, kv_heads;
  bool input_bias, output_bias;
};

v1::AttentionWeights Weights(const LayerCase& c) {
  const int64_t dk = c.d_model / c.heads, qw = c.heads * dk, kvw = c.kv_heads * dk;
  v1::AttentionWeights w;
  auto set = [](v1::Tensor* t, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    FloatsToTensor(testing::RandomVector(n, 1), shape, v1::BF16, t);
  };
  set(w.mutable_w_q(), {c.d_model, qw});
  set(w.mutable_w_k(), {c.d_kv, kvw});
  set(w.mutable_w_v(), {c.d_kv, kvw});
  set(w.mutable_w_o(), {qw, c.d_model});
  if (c.input_bias) set(w.mutable_b_k(), {kvw});
  if (c.output_bias) set(w.mutable_b_o(), {c.d_model});
  return w;
}

class LayerSizeTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerSizeTest, HeldBytesKnownBeforeDecodingMatchTheDecodedLayer) {
  const LayerCase& c = GetParam();
  v1::HeadConfig heads;
  heads.set_num_heads(static_cast<int32_t>(c.heads));
  heads.set_num_kv_heads(static_cast<int32_t>(c.kv_heads));
  const v1::AttentionWeights w = Weights(c);
  absl::StatusOr<LayerShape> shape = CheckLayerWeights(w, heads, "weights");
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->fused_qkv(), c.d_kv == c.d_model);
  const std::shared_ptr<const Layer> layer = DecodeLayer("x", "test", w, *shape);
  EXPECT_EQ(layer->SizeBytes(), shape->HeldBytes());
  EXPECT_EQ(layer->has_bias, c.input_bias || c.output_bias);
}

INSTANTIATE_TEST_SUITE_P(Layers, LayerSizeTest,
                         ::testing::Values(LayerCase{"fused_no_bias", 64, 64, 4, 4, false, false},
                                           LayerCase{"fused_gqa_biases", 64, 64, 4, 2, true, true},
                                           LayerCase{"separate_input_bias", 64, 48, 8, 1, true, false},
                                           LayerCase{"separate_output_bias", 32, 40, 2, 2, false, true}),
                         [](const auto& info) { return info.param.name; });

// LLaMA-shaped GQA (d_model 512, 8 heads of 64 over 2 KV heads) sent as PyTorch stores nn.Linear weights, [out, in]:
// w_q and w_o are square and cannot tell, w_k can, and its refusal says what happened.
TEST(LayerWeights, AnNnLinearWeightIsRefusedWithTheHintToTranspose) {
  LayerCase c{"gqa", 512, 512, 8, 2, false, false};
  v1::AttentionWeights w = Weights(c);
  FloatsToTensor(testing::RandomVector(128 * 512, 2), {128, 512}, v1::BF16, w.mutable_w_k());  // [out, in]
  v1::HeadConfig heads;
  heads.set_num_heads(8);
  heads.set_num_kv_heads(2);
  const absl::Status s = CheckLayerWeights(w, heads, "weights", nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "weights.w_k.shape must be [128, 128] (rows: d_kv_in from w_k, 128; columns: num_kv_heads x head_dim = "
            "2 x 64), got [128, 512]; its rows are the 128 columns expected: an nn.Linear weight is stored [out, in] "
            "(y = x W^T), and the layer takes W [in, out] (Y = X W): send every weight matrix transposed");
}

TEST(LayerWeights, AWrongWidthThatIsNoTranspositionGetsNoHint) {
  LayerCase c{"gqa", 512, 512, 8, 2, false, false};
  v1::AttentionWeights w = Weights(c);
  FloatsToTensor(testing::RandomVector(512 * 64, 2), {512, 64}, v1::BF16, w.mutable_w_k());
  v1::HeadConfig heads;
  heads.set_num_heads(8);
  heads.set_num_kv_heads(2);
  const absl::Status s = CheckLayerWeights(w, heads, "weights", nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().find("nn.Linear"), absl::string_view::npos) << s;
}

TEST(LayerStore, LayerOverTheLimitIsRefusedBeforeDecoding) {
  const LayerCase c{"big", 512, 512, 8, 8, false, false};  // 4 MiB in fp32
  v1::HeadConfig heads;
  heads.set_num_heads(8);
  LayerStore store(int64_t{3} << 20, 4);
  absl::StatusOr<std::shared_ptr<const Layer>> layer = store.Load("big", "test", Weights(c), heads, "weights");
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kResourceExhausted) << layer.status();
  EXPECT_NE(layer.status().message().find("--max_layer_mb"), absl::string_view::npos) << layer.status();
  EXPECT_TRUE(store.List().empty());
}

TEST(LayerStore, LoadedLayerIsListed) {
  const LayerCase c{"small", 32, 32, 4, 4, true, true};
  v1::HeadConfig heads;
  heads.set_num_heads(4);
  LayerStore store(int64_t{3} << 20, 4);
  ASSERT_TRUE(store.Load("small", "test", Weights(c), heads, "weights").ok());
  ASSERT_EQ(store.List().size(), 1u);
  EXPECT_EQ(store.List()[0]->name, "small");
  EXPECT_EQ(store.Load("small", "test", Weights(c), heads, "weights").status().code(),
            absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace mha
