// Writes the seed corpora of the fuzz targets: valid inputs that reach execution and near-valid ones that each break
// one rule, one file per input, into <out>/<target>/. tests/fuzz/run.sh calls it before fuzzing.
//
//   fuzz_seeds <out>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "client/npy.h"
#include "proto/inference/grpc_service.pb.h"
#include "proto/mha/v1/attention.pb.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

namespace fs = std::filesystem;

class Corpus {
 public:
  Corpus(const fs::path& root, const std::string& target) : dir_(root / target) { fs::create_directories(dir_); }
  void Add(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / ("seed_" + name_prefix_ + name), std::ios::binary) << prefix_ << bytes;
    ++count_;
  }
  // Every later seed starts with `bytes` and its name with `name`.
  void SetPrefix(const std::string& name, const std::string& bytes) {
    name_prefix_ = name;
    prefix_ = bytes;
  }
  void Add(const std::string& name, const google::protobuf::Message& message) {
    Add(name, message.SerializeAsString());
  }
  int count() const { return count_; }

 private:
  fs::path dir_;
  int count_ = 0;
  std::string name_prefix_, prefix_;
};

// Fixed, varied values in [-1, 1].
std::vector<float> Values(int64_t n, float phase = 0.0f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.7f * static_cast<float>(i) + phase);
  return v;
}

void Tensor(std::vector<int64_t> shape, v1::DataType dtype, v1::Tensor* t, float phase = 0.0f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  FloatsToTensor(Values(n, phase), shape, dtype, t);
}

// Inline weights for d_model -> H heads of d_k (Hkv KV heads), inputs d_kv_in and d_v_in.
void Weights(int64_t d_model, int64_t d_kv_in, int64_t d_v_in, int64_t heads, int64_t kv_heads, int64_t head_dim,
             bool bias, v1::DataType dtype, v1::AttentionWeights* w) {
  Tensor({d_model, heads * head_dim}, dtype, w->mutable_w_q(), 0.1f);
  Tensor({d_kv_in, kv_heads * head_dim}, dtype, w->mutable_w_k(), 0.2f);
  Tensor({d_v_in, kv_heads * head_dim}, dtype, w->mutable_w_v(), 0.3f);
  Tensor({heads * head_dim, d_model}, dtype, w->mutable_w_o(), 0.4f);
  if (bias) {
    Tensor({heads * head_dim}, dtype, w->mutable_b_q(), 0.5f);
    Tensor({kv_heads * head_dim}, dtype, w->mutable_b_k(), 0.6f);
    Tensor({kv_heads * head_dim}, dtype, w->mutable_b_v(), 0.7f);
    Tensor({d_model}, dtype, w->mutable_b_o(), 0.8f);
  }
}

void Heads(int heads, int kv_heads, int head_dim, bool causal, v1::HeadConfig* h) {
  h->set_num_heads(heads);
  h->set_num_kv_heads(kv_heads);
  h->set_head_dim(head_dim);
  h->set_causal(causal);
}

// A [rows, cols] or [B, rows, cols] mask: finite values, -inf on every third element, one row fully masked.
void Mask(std::vector<int64_t> shape, v1::DataType dtype, v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v = Values(n, 1.0f);
  for (int64_t i = 0; i < n; i += 3) v[i] = -std::numeric_limits<float>::infinity();
  const int64_t cols = shape.back();
  for (int64_t j = 0; j < cols; ++j) v[j] = -std::numeric_limits<float>::infinity();
  FloatsToTensor(v, shape, dtype, t);
}

// The tensor's bytes replaced by a reference to `offset` in the fuzz env's region "shm" (fuzz_env.h).
void Share(v1::Tensor* t, uint64_t offset) {
  t->clear_data();
  t->mutable_shared_memory()->set_region("shm");
  t->mutable_shared_memory()->set_offset(offset);
}

void MhaSeeds(Corpus& c) {
  using Req = v1::MultiHeadAttentionRequest;
  Req self;  // inline weights, self-attention: B 1, T 3, d_model 8, 2 heads of 4
  Tensor({1, 3, 8}, v1::FP32, self.mutable_query());
  Weights(8, 8, 8, 2, 2, 4, false, v1::FP32, self.mutable_inline_weights());
  Heads(2, 0, 0, false, self.mutable_heads());
  c.Add("inline_self", self);
  for (auto backend : {v1::BACKEND_CPU, v1::BACKEND_REFERENCE, v1::BACKEND_CUDA, static_cast<v1::Backend>(9)}) {
    Req r = self;
    r.set_backend(backend);
    c.Add("inline_self_backend" + std::to_string(backend), r);
  }
  {
    Req r = self;  // 16-bit everything, causal, weights returned in bf16
    Tensor({1, 3, 8}, v1::FP16, r.mutable_query());
    Weights(8, 8, 8, 2, 1, 4, true, v1::BF16, r.mutable_inline_weights());
    Heads(2, 1, 4, true, r.mutable_heads());
    r.set_return_attention_weights(true);
    r.set_output_dtype(v1::BF16);
    c.Add("inline_self_fp16_bf16_causal_mqa", r);
    r.set_output_dtype(static_cast<v1::DataType>(7));
    c.Add("bad_output_dtype", r);
  }
  Req cross;  // GQA cross-attention with every mask: B 2, Tq 3, Tk 4, d_model 12, d_kv_in 6, d_v_in 5, 4 heads on 2
  Tensor({2, 3, 12}, v1::FP32, cross.mutable_query());
  Tensor({2, 4, 6}, v1::FP16, cross.mutable_key());
  Tensor({2, 4, 5}, v1::BF16, cross.mutable_value());
  Weights(12, 6, 5, 4, 2, 3, true, v1::FP32, cross.mutable_inline_weights());
  Heads(4, 2, 3, false, cross.mutable_heads());
  cross.add_key_lengths(4);
  cross.add_key_lengths(1);
  Mask({3, 4}, v1::FP32, cross.mutable_attn_mask());
  for (float f : {1.0f, 0.0f, 0.5f, -2.0f}) cross.add_head_mask(f);
  cross.set_return_attention_weights(true);
  c.Add("inline_cross_gqa_masks", cross);
  {
    Req r = self;  // the query and the output in the fuzz env's shared-memory region "shm"
    Share(r.mutable_query(), 64);
    r.mutable_output_shared_memory()->set_region("shm");
    r.mutable_output_shared_memory()->set_offset(4096);
    c.Add("shared_memory_query_output", r);
    r = cross;
    Share(r.mutable_key(), 0);
    Share(r.mutable_value(), 8192);
    c.Add("shared_memory_key_value", r);
  }
  {
    Req r = cross;
    Mask({2, 3, 4}, v1::FP16, r.mutable_attn_mask());
    r.mutable_heads()->set_causal(true);
    r.mutable_heads()->set_scale(0.125f);
    r.set_output_dtype(v1::FP16);
    c.Add("inline_cross_per_batch_mask_causal", r);
    r.clear_value();  // value = key: needs d_v_in = d_kv_in
    c.Add("inline_cross_value_is_key_mismatch", r);
    Req bad = cross;
    bad.mutable_attn_mask()->mutable_data()->replace(0, 4, std::string("\x00\x00\xc0\x7f", 4));  // NaN
    c.Add("mask_nan", bad);
    bad = cross;
    bad.set_key_lengths(1, 5);
    c.Add("key_length_past_tk", bad);
    bad = cross;
    bad.add_head_mask(1.0f);
    c.Add("head_mask_too_long", bad);
    bad = cross;
    bad.mutable_key()->mutable_data()->pop_back();
    c.Add("key_data_short", bad);
    bad = cross;
    bad.mutable_heads()->set_num_kv_heads(3);
    c.Add("kv_heads_not_dividing", bad);
    bad = cross;
    bad.mutable_inline_weights()->mutable_w_o()->set_shape(0, 13);
    c.Add("w_o_shape", bad);
  }
  for (const char* layer : {"tiny", "gqa", "demo", "no such layer"}) {
    Req r;
    const int64_t d_model = std::string(layer) == "gqa" ? 12 : std::string(layer) == "demo" ? 512 : 8;
    Tensor({2, 2, d_model}, v1::FP32, r.mutable_query());
    r.set_layer(layer);
    if (std::string(layer) == "gqa") {
      Tensor({2, 3, 6}, v1::FP32, r.mutable_key());
      Tensor({2, 3, 5}, v1::FP16, r.mutable_value());
    }
    c.Add(std::string("layer_") + (layer[0] == 'n' ? "missing" : layer), r);
    r.set_return_attention_weights(true);
    r.add_key_lengths(2);
    r.add_key_lengths(0);
    r.mutable_heads()->set_causal(true);
    c.Add(std::string("layer_lengths_") + (layer[0] == 'n' ? "missing" : layer), r);
  }
  {
    Req r;
    Tensor({1, 1, 8}, v1::FP32, r.mutable_query());
    r.set_layer("tiny");
    c.Add("layer_tiny_one_token", r);
    r.mutable_heads()->set_num_heads(4);
    c.Add("layer_heads_disagree", r);
    r.clear_heads();
    r.mutable_query()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
    c.Add("query_dtype_unspecified", r);
    r.clear_query();
    c.Add("no_query", r);
  }
  {
    Req r = self;
    r.mutable_query()->add_shape(1);
    c.Add("query_rank4", r);
    r = self;
    r.clear_weights();
    c.Add("no_weights", r);
    r = self;
    r.clear_heads();
    c.Add("inline_no_heads", r);
    r = self;
    Tensor({1, 40, 8}, v1::FP32, r.mutable_query());
    r.set_return_attention_weights(true);
    c.Add("inline_40_tokens", r);
  }
}

void SdpaSeeds(Corpus& c) {
  using Req = v1::ScaledDotProductAttentionRequest;
  Req base;  // B 1, Tq 3, Tk 5, H 4 on Hkv 2, d_k 8
  Tensor({1, 3, 4, 8}, v1::FP32, base.mutable_q());
  Tensor({1, 5, 2, 8}, v1::FP32, base.mutable_k(), 1.0f);
  Tensor({1, 5, 2, 8}, v1::FP32, base.mutable_v(), 2.0f);
  c.Add("basic", base);
  {
    Req r = base;  // everything in the fuzz env's shared-memory region "shm"
    Share(r.mutable_q(), 0);
    Share(r.mutable_k(), 1024);
    Share(r.mutable_v(), 2048);
    r.mutable_output_shared_memory()->set_region("shm");
    r.mutable_output_shared_memory()->set_offset(4096);
    c.Add("shared_memory_all", r);
  }
  {
    Req r = base;
    r.mutable_heads()->set_causal(true);
    r.set_return_attention_weights(true);
    c.Add("causal_weights", r);
    r.add_key_lengths(0);
    c.Add("causal_zero_length", r);
    r = base;
    Mask({3, 5}, v1::FP32, r.mutable_attn_mask());
    r.add_key_lengths(3);
    r.set_backend(v1::BACKEND_REFERENCE);
    c.Add("mask_lengths_reference", r);
    r.set_backend(v1::BACKEND_CPU);
    Mask({1, 3, 5}, v1::BF16, r.mutable_attn_mask());
    c.Add("mask_per_batch_cpu", r);
    r = base;
    Tensor({1, 3, 4, 8}, v1::FP16, r.mutable_q());
    Tensor({1, 5, 2, 8}, v1::BF16, r.mutable_k(), 1.0f);
    r.set_output_dtype(v1::FP16);
    r.set_return_attention_weights(true);
    c.Add("mixed_dtypes", r);
    r.mutable_heads()->set_num_heads(4);
    r.mutable_heads()->set_num_kv_heads(2);
    r.mutable_heads()->set_head_dim(8);
    r.mutable_heads()->set_scale(-0.5f);
    c.Add("heads_agree", r);
    r.mutable_heads()->set_head_dim(9);
    c.Add("heads_disagree", r);
  }
  {
    // Scaled RoPE of each type, valid, for the fuzzer to bend (rope_frequencies.cc's inputs).
    Req r = base;
    r.mutable_heads()->set_rope_theta(10000);
    r.mutable_heads()->set_causal(true);
    v1::RopeScaling* s = r.mutable_heads()->mutable_rope_scaling();
    s->set_rope_type("llama3");
    s->set_factor(8);
    s->set_low_freq_factor(1);
    s->set_high_freq_factor(4);
    s->set_original_max_position_embeddings(4);
    c.Add("rope_llama3", r);
    s->Clear();
    s->set_rope_type("yarn");
    s->set_factor(4);
    s->set_original_max_position_embeddings(2);
    s->set_mscale(1);
    s->set_mscale_all_dim(0.5);
    s->set_truncate(false);
    c.Add("rope_yarn", r);
    s->Clear();
    s->set_rope_type("dynamic");
    s->set_factor(2);
    s->set_max_position_embeddings(3);
    c.Add("rope_dynamic", r);
    s->Clear();
    s->set_rope_type("longrope");
    s->set_original_max_position_embeddings(3);
    s->set_max_position_embeddings(12);
    for (int i = 0; i < 4; ++i) s->add_short_factor(1 + i);
    for (int i = 0; i < 4; ++i) s->add_long_factor(2 + i);
    c.Add("rope_longrope", r);
  }
  for (auto [tq, tk, h, hkv, dk] : std::vector<std::array<int64_t, 5>>{
           {1, 1, 1, 1, 1}, {7, 3, 2, 2, 67}, {2, 9, 3, 1, 16}, {17, 17, 1, 1, 4}, {3, 2, 6, 3, 5}}) {
    Req r;
    Tensor({2, tq, h, dk}, v1::FP32, r.mutable_q());
    Tensor({2, tk, hkv, dk}, v1::FP32, r.mutable_k(), 1.0f);
    Tensor({2, tk, hkv, dk}, v1::FP32, r.mutable_v(), 2.0f);
    r.mutable_heads()->set_causal(tq > tk);
    r.set_return_attention_weights(true);
    c.Add("shape_" + std::to_string(tq) + "_" + std::to_string(tk) + "_" + std::to_string(h) + "_" +
              std::to_string(hkv) + "_" + std::to_string(dk),
          r);
  }
  {
    Req r = base;
    r.mutable_k()->set_shape(2, 3);
    c.Add("hkv_not_dividing", r);
    r = base;
    r.mutable_v()->set_shape(1, 4);
    c.Add("v_shape", r);
    r = base;
    r.clear_v();
    c.Add("no_v", r);
    r = base;
    r.mutable_q()->set_shape(0, 0);
    c.Add("zero_dim", r);
    r = base;
    Mask({3, 4}, v1::FP32, r.mutable_attn_mask());
    c.Add("mask_shape", r);
    r = base;
    Mask({3, 5}, v1::FP32, r.mutable_attn_mask());
    r.mutable_attn_mask()->mutable_data()->replace(4, 4, std::string("\x00\x00\x80\x7f", 4));  // +inf
    c.Add("mask_plus_inf", r);
    r = base;
    r.mutable_heads()->set_scale(std::numeric_limits<float>::infinity());
    c.Add("scale_inf", r);
  }
}

void LoadLayerSeeds(Corpus& c) {
  v1::LoadLayerRequest r;
  r.set_name("layer-1.v2_x");
  Weights(8, 8, 8, 2, 2, 4, false, v1::FP32, r.mutable_weights());
  Heads(2, 0, 0, false, r.mutable_heads());
  c.Add("valid_fused", r);
  r.set_name("tiny");
  c.Add("exists", r);
  r.set_name("bad name/");
  c.Add("bad_name", r);
  r.set_name("");
  c.Add("empty_name", r);
  r.set_name(std::string(129, 'a'));
  c.Add("long_name", r);
  r.set_name("gqa2");
  Weights(12, 6, 5, 4, 2, 3, true, v1::FP16, r.mutable_weights());
  Heads(4, 2, 3, true, r.mutable_heads());
  r.mutable_heads()->set_scale(0.25f);
  c.Add("valid_gqa_bias_fp16", r);
  r.mutable_weights()->mutable_b_k()->set_shape(0, 7);
  c.Add("bias_shape", r);
  Weights(12, 6, 5, 4, 2, 3, false, v1::BF16, r.mutable_weights());
  Heads(4, 1, 3, false, r.mutable_heads());
  c.Add("heads_disagree", r);
  Heads(5, 0, 0, false, r.mutable_heads());
  c.Add("heads_not_dividing", r);
  Heads(0, 0, 0, false, r.mutable_heads());
  c.Add("no_heads", r);
  r.clear_weights();
  Heads(2, 0, 0, false, r.mutable_heads());
  c.Add("no_weights", r);
  r.set_name("big");
  Weights(32, 32, 32, 4, 4, 8, true, v1::FP16, r.mutable_weights());
  Heads(4, 0, 0, false, r.mutable_heads());
  c.Add("valid_32", r);
}

// A .safetensors file: 8-byte little-endian header length, the header, the data.
std::string Safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

void SafetensorsSeeds(Corpus& c) {
  // d_model 4, 2 heads of 2; F32 w_q, w_k, w_v, F16 w_o, BF16 b_o.
  const std::string tensors =
      R"({"w_q":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]},)"
      R"("w_k":{"dtype":"F32","shape":[4,4],"data_offsets":[64,128]},)"
      R"("w_v":{"dtype":"F32","shape":[4,4],"data_offsets":[128,192]},)"
      R"("w_o":{"dtype":"F16","shape":[4,4],"data_offsets":[192,224]},)";
  std::string data;
  {
    std::vector<float> v = Values(48);
    data.assign(reinterpret_cast<const char*>(v.data()), v.size() * 4);
    v1::Tensor half;
    Tensor({16}, v1::FP16, &half);
    data += half.data();
  }
  const std::string bias = R"("b_o":{"dtype":"BF16","shape":[4],"data_offsets":[224,232]},)";
  const std::string bias_data = std::string("\x80\x3f\x00\x40\x80\xbf\x00\x00", 8);
  c.Add("valid", Safetensors(tensors + R"("__metadata__":{"num_heads":"2"}})", data));
  c.Add("valid_bias_metadata",
        Safetensors(tensors + bias +
                        R"("__metadata__":{"num_heads":"2","num_kv_heads":"2","head_dim":"2","causal":"true",)"
                        R"("scale":"0.5","format":"pt"}})",
                    data + bias_data));
  c.Add("valid_padded_header", Safetensors(tensors + R"("__metadata__":{"num_heads":"1"}}      )", data));
  c.Add("gqa_mismatch", Safetensors(tensors + R"("__metadata__":{"num_heads":"2","num_kv_heads":"1"}})", data));
  c.Add("rope_scaling", Safetensors(tensors + R"("__metadata__":{"num_heads":"2","rope_theta":"10000",)"
                                              R"("rope_scaling":"{\"rope_type\": \"llama3\", \"factor\": 8, )"
                                              R"(\"low_freq_factor\": 1, \"high_freq_factor\": 4, )"
                                              R"(\"original_max_position_embeddings\": 16}"}})",
                                    data));
  c.Add("overlap", Safetensors(R"({"w_q":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]},)"
                               R"("w_k":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]},)"
                               R"("w_v":{"dtype":"F32","shape":[4,4],"data_offsets":[64,128]},)"
                               R"("w_o":{"dtype":"F32","shape":[4,4],"data_offsets":[128,192]},)"
                               R"("__metadata__":{"num_heads":"2"}})",
                               data.substr(0, 192)));
  c.Add("hole", Safetensors(tensors + R"("__metadata__":{"num_heads":"2"}})", data + "pad!"));
  c.Add("extra_tensor", Safetensors(tensors + R"("other":{"dtype":"I8","shape":[4],"data_offsets":[224,228]},)"
                                              R"("__metadata__":{"num_heads":"2"}})",
                                    data + "abcd"));
  c.Add("no_metadata", Safetensors(tensors + R"("x":1})", data));
  c.Add("bad_dtype", Safetensors(R"({"w_q":{"dtype":"F64","shape":[4,2],"data_offsets":[0,64]}})", data));
  c.Add("offsets_outside", Safetensors(tensors + R"("__metadata__":{"num_heads":"2"}})", data.substr(0, 100)));
  c.Add("nested", Safetensors(std::string(64, '[') + std::string(64, ']'), ""));
  c.Add("header_too_long", std::string("\xff\xff\xff\xff\x00\x00\x00\x00{}", 10));
  c.Add("short", std::string("\x02\x00\x00", 3));
}

void NpySeeds(Corpus& c) {
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"0d", {}}, {"1d", {5}}, {"2d", {2, 3}}, {"3d", {2, 1, 4}}, {"empty", {3, 0}}}) {
    for (v1::DataType dtype : {v1::FP32, v1::FP16}) {
      NpyArray a;
      a.shape = shape;
      a.dtype = dtype;
      v1::Tensor t;
      FloatsToTensor(Values(a.NumElements()), {a.NumElements()}, dtype, &t);
      a.data = t.data();
      c.Add(name + (dtype == v1::FP16 ? "_f2" : "_f4"), SerializeNpy(a));
    }
  }
  const std::string data(24, '\x01');
  auto v1_file = [](const std::string& header, const std::string& data) {
    std::string out = std::string("\x93NUMPY\x01\x00", 8);
    out.push_back(static_cast<char>(header.size() & 0xff));
    out.push_back(static_cast<char>(header.size() >> 8));
    return out + header + data;
  };
  c.Add("v2", std::string("\x93NUMPY\x02\x00", 8) + std::string("\x2a\x00\x00\x00", 4) +
                  "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n" + data);
  c.Add("fortran", v1_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }\n", data));
  c.Add("int32", v1_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }\n", data));
  c.Add("structured", v1_file("{'descr': [('a', '<f4'), ('b', '<f4')], 'fortran_order': False, 'shape': (3,), }\n",
                              data));
  c.Add("python2_long", v1_file("{\"descr\": \"<f2\", \"fortran_order\": False, \"shape\": (3L, 4L)}", data));
  c.Add("truncated", v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }\n", data));
  c.Add("one_tuple", v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (6), }\n", data));
  c.Add("huge_dims", v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 0, 9), }\n", ""));
  c.Add("unknown_key", v1_file("{'descr': '<f4', 'x': 1}\n", data));
}

void CodecSeeds(Corpus& c) {
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.5f, 65504.0f, 65519.0f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f,
                            6.1e-5f, 3.0e38f, std::numeric_limits<float>::denorm_min(), INFINITY, -INFINITY, NAN,
                            1.00390625f, 1.01171875f};
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16}) {
    v1::Tensor t;
    FloatsToTensor(specials, {static_cast<int64_t>(std::size(specials))}, dtype, &t);
    c.Add("specials_" + DTypeName(dtype), t);
    Tensor({2, 3, 4}, dtype, &t);
    c.Add("rank3_" + DTypeName(dtype), t);
    t.mutable_data()->pop_back();
    c.Add("short_" + DTypeName(dtype), t);
  }
  v1::Tensor overflow;
  for (int i = 0; i < 4; ++i) overflow.add_shape(int64_t{1} << 20);
  overflow.set_dtype(v1::FP32);
  c.Add("overflow", overflow);
  c.Add("raw_floats", std::string(reinterpret_cast<const char*>(specials), sizeof(specials)));
}

// Extend requests against fuzz_extend_request's sessions (its first-letter rule): decode steps and prefills of head
// sessions (fp32 with RoPE, bf16, fp16, INT8 and FP8 caches), a layer session over "tiny", a ragged call of three, weights, and
// near-misses (a repeated id, mixed kinds, a short k, a wrong width, an expected_length that is off).
void ExtendSeeds(Corpus& c) {
  const auto heads = [](v1::ExtendItem* item, const std::string& id, int64_t n, v1::DataType dtype, float phase) {
    item->set_session_id(id);
    Tensor({n, 2, 4}, dtype, item->mutable_q(), phase);
    Tensor({n, 1, 4}, dtype, item->mutable_k(), phase + 1);
    Tensor({n, 1, 4}, dtype, item->mutable_v(), phase + 2);
  };
  v1::ExtendRequest decode;
  heads(decode.add_items(), "h1", 1, v1::FP32, 0);
  c.Add("head_decode", decode);
  v1::ExtendRequest prefill;
  heads(prefill.add_items(), "h2", 20, v1::FP32, 1);
  prefill.set_layer_index(1);
  c.Add("head_prefill_layer1", prefill);
  v1::ExtendRequest ragged;
  heads(ragged.add_items(), "h1", 3, v1::FP32, 2);
  heads(ragged.add_items(), "h3", 17, v1::FP32, 3);
  heads(ragged.add_items(), "h4", 1, v1::BF16, 4);
  ragged.set_return_attention_weights(true);
  c.Add("ragged_weights", ragged);
  v1::ExtendRequest bf16;
  heads(bf16.add_items(), "b1", 5, v1::BF16, 5);
  bf16.set_output_dtype(v1::BF16);
  c.Add("bf16_cache", bf16);
  v1::ExtendRequest fp16;
  heads(fp16.add_items(), "f1", 33, v1::FP16, 6);
  c.Add("fp16_cache", fp16);
  // The 8-bit caches: a prefill across a block's end, then one that grows a key channel's scale (the block's
  // earlier keys requantized) and a value's, and FP8's decode steps.
  v1::ExtendRequest int8;
  heads(int8.add_items(), "i1", 20, v1::FP32, 8);
  c.Add("int8_cache", int8);
  v1::ExtendRequest outlier;
  heads(outlier.add_items(), "i1", 2, v1::FP32, 9);
  FloatsToTensor({0.5f, -300.0f, 0.25f, 1e30f, 1.0f, 2.0f, -3.0f, 4.0f}, {2, 1, 4}, v1::FP32,
                 outlier.mutable_items(0)->mutable_k());
  FloatsToTensor({1e-30f, 7.0f, -1e20f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, {2, 1, 4}, v1::FP32,
                 outlier.mutable_items(0)->mutable_v());
  c.Add("int8_outlier", outlier);
  v1::ExtendRequest fp8;
  heads(fp8.add_items(), "41", 1, v1::FP32, 10);
  heads(fp8.add_items(), "51", 3, v1::BF16, 11);
  fp8.set_return_attention_weights(true);
  c.Add("fp8_caches", fp8);
  v1::ExtendRequest layer;
  v1::ExtendItem* x = layer.add_items();
  x->set_session_id("L1");
  Tensor({4, 8}, v1::FP32, x->mutable_x(), 7);
  c.Add("layer_session", layer);
  v1::ExtendRequest repeated = decode;
  *repeated.add_items() = decode.items(0);
  c.Add("repeated_id", repeated);
  v1::ExtendRequest mixed = layer;
  *mixed.add_items() = decode.items(0);
  c.Add("mixed_kinds", mixed);
  v1::ExtendRequest short_k = prefill;
  Tensor({2, 1, 4}, v1::FP32, short_k.mutable_items(0)->mutable_k());
  c.Add("short_k", short_k);
  v1::ExtendRequest width = layer;
  Tensor({4, 6}, v1::FP32, width.mutable_items(0)->mutable_x());
  c.Add("wrong_width", width);
  v1::ExtendRequest expected = decode;
  expected.mutable_items(0)->set_expected_length(7);
  c.Add("expected_length", expected);
}

// CreateSession requests for fuzz_create_session: head sessions with each cache dtype (GQA, MQA, an odd d_k), every
// RoPE scaling type, a configuration per cache, prefix keys, and layer sessions over "tiny" and "gqa".
void CreateSessionSeeds(Corpus& c) {
  const auto heads = [](int h, int kv, int d, v1::DataType dtype) {
    v1::CreateSessionRequest r;
    r.mutable_heads()->set_num_heads(h);
    r.mutable_heads()->set_num_kv_heads(kv);
    r.mutable_heads()->set_head_dim(d);
    r.set_cache_dtype(dtype);
    return r;
  };
  const std::pair<const char*, v1::DataType> dtypes[] = {{"fp32", v1::FP32},  {"bf16", v1::BF16},
                                                         {"fp16", v1::FP16},  {"int8", v1::INT8},
                                                         {"fp8_e4m3", v1::FP8_E4M3}, {"fp8_e5m2", v1::FP8_E5M2}};
  for (const auto& [name, dtype] : dtypes) c.Add(std::string("gqa_") + name, heads(4, 2, 8, dtype));
  c.Add("mqa_odd_dk_int8", heads(3, 1, 5, v1::INT8));
  const char* types[] = {"linear", "dynamic", "yarn", "longrope", "llama3"};
  for (const char* type : types) {
    v1::CreateSessionRequest r = heads(2, 1, 8, v1::INT8);
    v1::HeadConfig& h = *r.mutable_heads();
    h.set_rope_theta(10000);
    v1::RopeScaling& s = *h.mutable_rope_scaling();
    s.set_rope_type(type);
    s.set_factor(4);
    s.set_original_max_position_embeddings(8);
    if (std::string(type) == "llama3") {
      s.set_low_freq_factor(1);
      s.set_high_freq_factor(4);
    }
    if (std::string(type) == "longrope") {
      for (int i = 0; i < 4; ++i) {
        s.add_short_factor(1.0 + i);
        s.add_long_factor(2.0 + i);
      }
    }
    c.Add(std::string("rope_") + type, r);
  }
  v1::CreateSessionRequest layered = heads(2, 2, 4, v1::FP8_E4M3);
  layered.set_num_layers(3);
  layered.add_layer_heads()->set_scale(0.5f);
  layered.add_layer_heads()->set_rope_theta(500000);
  v1::HeadConfig* partial = layered.add_layer_heads();
  partial->set_rope_theta(10000);
  partial->set_rope_dim(2);
  partial->set_rope_interleaved(true);
  c.Add("layer_heads", layered);
  v1::CreateSessionRequest prefix = heads(2, 1, 4, v1::BF16);
  prefix.add_prefix_keys("block-0");
  prefix.add_prefix_keys("block-1");
  prefix.set_max_tokens(64);
  c.Add("prefix_keys", prefix);
  v1::CreateSessionRequest layers;
  layers.add_layers("tiny");
  layers.add_layers("gqa");
  layers.set_cache_dtype(v1::INT8);
  c.Add("layer_session", layers);
}

// KServe v2 requests on the fuzz env's "tiny" layer (d_model 8) and the "sdpa" model: raw and typed contents,
// a BOOL mask, INT64 key lengths, parameters, requested outputs, shared memory, and a misnamed input.
void KServeSeeds(Corpus& c) {
  using Req = inference::ModelInferRequest;
  const auto input = [](Req* r, const char* name, const char* datatype, std::vector<int64_t> shape,
                        const std::string& raw) {
    auto* in = r->add_inputs();
    in->set_name(name);
    in->set_datatype(datatype);
    in->mutable_shape()->Assign(shape.begin(), shape.end());
    r->add_raw_input_contents(raw);
  };
  const auto floats = [](int64_t n, float phase) {
    const std::vector<float> v = Values(n, phase);
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  Req base;
  base.set_model_name("tiny");
  input(&base, "query", "FP32", {1, 3, 8}, floats(24, 0.0f));
  c.Add("query", base);
  Req r = base;
  input(&r, "attn_mask", "BOOL", {3, 3}, std::string("\1\0\0\1\1\0\1\1\1", 9));
  const int64_t lengths[] = {2};
  input(&r, "key_lengths", "INT64", {1}, std::string(reinterpret_cast<const char*>(lengths), sizeof(lengths)));
  (*r.mutable_parameters())["causal"].set_bool_param(true);
  (*r.mutable_parameters())["backend"].set_string_param("reference");
  r.add_outputs()->set_name("output");
  r.add_outputs()->set_name("attention_weights");
  c.Add("mask_lengths_weights", r);
  Req typed;
  typed.set_model_name("tiny");
  auto* query = typed.add_inputs();
  query->set_name("query");
  query->set_datatype("FP32");
  for (int64_t d : {1, 1, 8}) query->add_shape(d);
  const std::vector<float> values = Values(8);
  query->mutable_contents()->mutable_fp32_contents()->Assign(values.begin(), values.end());
  c.Add("typed", typed);
  Req shared = typed;
  shared.mutable_inputs(0)->clear_contents();
  auto& params = *shared.mutable_inputs(0)->mutable_parameters();
  params["shared_memory_region"].set_string_param("shm");
  params["shared_memory_byte_size"].set_int64_param(32);
  params["shared_memory_offset"].set_int64_param(1024);
  c.Add("shared_memory", shared);
  Req sdpa;
  sdpa.set_model_name("sdpa");
  input(&sdpa, "q", "FP32", {1, 3, 4, 8}, floats(96, 0.0f));
  input(&sdpa, "k", "FP32", {1, 5, 2, 8}, floats(80, 1.0f));
  input(&sdpa, "v", "FP32", {1, 5, 2, 8}, floats(80, 2.0f));
  (*sdpa.mutable_parameters())["scale"].set_double_param(0.5);
  c.Add("sdpa", sdpa);
  Req misnamed = base;
  misnamed.mutable_inputs(0)->set_name("Query");
  c.Add("misnamed", misnamed);
}

// fuzz_request_reader's first byte picks the message (high bit: SDPA) and the slicing; the rest are the requests'
// seeds.
void RequestReaderSeeds(Corpus& c) {
  c.SetPrefix("mha_", std::string(1, '\x07'));
  MhaSeeds(c);
  c.SetPrefix("sdpa_", std::string(1, '\x83'));
  SdpaSeeds(c);
}

}  // namespace
}  // namespace mha

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  const std::pair<const char*, std::function<void(mha::Corpus&)>> targets[] = {
      {"fuzz_mha_request", mha::MhaSeeds},     {"fuzz_sdpa_request", mha::SdpaSeeds},
      {"fuzz_extend_request", mha::ExtendSeeds},       {"fuzz_create_session", mha::CreateSessionSeeds},
      {"fuzz_load_layer_request", mha::LoadLayerSeeds}, {"fuzz_safetensors", mha::SafetensorsSeeds},
      {"fuzz_npy", mha::NpySeeds},             {"fuzz_tensor_codec", mha::CodecSeeds},
      {"fuzz_request_reader", mha::RequestReaderSeeds}, {"fuzz_kserve_request", mha::KServeSeeds}};
  for (const auto& [name, seeds] : targets) {
    mha::Corpus corpus(root, name);
    seeds(corpus);
    std::printf("%s: %d seeds\n", name, corpus.count());
  }
  return 0;
}
