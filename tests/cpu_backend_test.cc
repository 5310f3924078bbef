// What is particular to the CPU backend: choosing tile kernels and the bf16 path. Its results are checked against the
// reference, for every kernel set and with the bf16 path on and off, by backend_conformance_test.cc.
#include "server/backends/cpu/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/bf16_matmul.h"
#include "server/backends/cpu/tile_kernels.h"
#include "server/layers/layer.h"
#include "tests/test_util.h"

namespace mha {
namespace {

TEST(CpuBackend, UnknownKernelsAreInvalidArgument) {
  EXPECT_EQ(CpuBackend::Create("avx1024").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuBackend::Create("sgemm").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackend, KernelsTheCpuLacksAreUnavailable) {
  int lacking = 0;
  for (const char* isa : {"amx", "avx512bf16", "avx512", "avx2"}) {
    if (kernels::TileKernelsFor(isa) != nullptr) continue;
    ++lacking;
    EXPECT_EQ(CpuBackend::Create(isa).status().code(), absl::StatusCode::kUnavailable) << isa;
  }
  if (lacking == 0) GTEST_SKIP() << "this CPU runs every tile-kernel set";
}

TEST(CpuBackend, PortableKernelsRunEverywhere) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create("portable");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_NE((*cpu)->device().find("portable attention tiles"), std::string::npos) << (*cpu)->device();
}

TEST(CpuBackend, AutoNamesTheWidestKernelsTheCpuRuns) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const char* widest = kernels::TileKernelsFor("avx512") != nullptr ? "avx512"
                       : kernels::TileKernelsFor("avx2") != nullptr ? "avx2"
                                                                    : "portable";
  EXPECT_NE((*cpu)->device().find(std::string(widest) + " attention tiles"), std::string::npos) << (*cpu)->device();
}

// The bf16 attention-core sets: AMX-BF16's tiles, AVX512-BF16's dot products.
class Bf16TilesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(Bf16TilesTest, ServeBf16CallsWhereTheCpuHasThem) {
  const std::string& isa = GetParam();
  if (kernels::TileKernelsFor(isa.c_str()) == nullptr) {
    EXPECT_EQ(CpuBackend::Create(isa).status().code(), absl::StatusCode::kUnavailable);
    GTEST_SKIP() << "this CPU (or its kernel) does not run " << isa;
  }
  if (cpu::NativeBf16Matmul().empty()) GTEST_SKIP() << "no bf16 matmul on this CPU: every request computes in fp32";
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(isa);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_NE((*cpu)->device().find("bf16 attention on " + isa + " tiles"), std::string::npos) << (*cpu)->device();
  // With the bf16 path off, a bf16 set cannot be asked for.
  EXPECT_EQ(CpuBackend::Create(isa, /*bf16=*/false).status().code(), absl::StatusCode::kUnavailable);
}

TEST(CpuBackend, AutoTakesAmxForBf16CallsElseAvx512Bf16) {
  if (cpu::NativeBf16Matmul().empty()) GTEST_SKIP() << "no bf16 matmul on this CPU: every request computes in fp32";
  const char* want = kernels::TileKernelsFor("amx") != nullptr          ? "amx"
                     : kernels::TileKernelsFor("avx512bf16") != nullptr ? "avx512bf16"
                                                                         : nullptr;
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  if (want == nullptr) {
    EXPECT_EQ((*cpu)->device().find("bf16 attention on"), std::string::npos) << (*cpu)->device();
    GTEST_SKIP() << "no bf16 attention set on this CPU";
  }
  EXPECT_NE((*cpu)->device().find(absl::StrCat("bf16 attention on ", want, " tiles")), std::string::npos)
      << (*cpu)->device();
  // An fp32 set named: every attention core in fp32.
  absl::StatusOr<std::unique_ptr<CpuBackend>> avx512 = CpuBackend::Create("avx512");
  ASSERT_TRUE(avx512.ok()) << avx512.status();
  EXPECT_EQ((*avx512)->device().find("bf16 attention on"), std::string::npos) << (*avx512)->device();
}

// Runs a bf16 ScaledDotProductAttention call of 2 x 80 queries against 300 keys, 4 heads of `head_dim` sharing 2
// KV heads, bottom-right causal, its output in `out_dtype`; returns the output decoded. With `odd_addresses`, q, k,
// v and the output lie one byte past a 2-byte boundary (not bf16-aligned).
std::vector<float> RunBf16Sdpa(Backend& backend, int64_t head_dim, v1::DataType out_dtype = v1::FP32,
                               bool odd_addresses = false) {
  AttentionShape s;
  s.batch = 2;
  s.q_len = 80;
  s.kv_len = 300;
  s.heads = {4, 2, head_dim, true, 1.0f / std::sqrt(static_cast<float>(head_dim))};
  const int64_t q_count = s.batch * s.q_len * s.heads.q_width(), kv_count = s.batch * s.kv_len * s.heads.kv_width();
  const int64_t offset = odd_addresses ? 1 : 0;
  // Each tensor's bytes at `offset` of its own buffer (of uint32_t, so that the buffer itself is aligned).
  const auto bf16 = [&](const std::vector<float>& x) {
    std::vector<uint32_t> buffer(x.size() / 2 + 2);
    std::vector<uint16_t> y(x.size());
    EncodeFromFloat(v1::BF16, x.data(), x.size(), y.data());
    std::memcpy(reinterpret_cast<char*>(buffer.data()) + offset, y.data(), y.size() * sizeof(uint16_t));
    return buffer;
  };
  const std::vector<uint32_t> q = bf16(testing::RandomVector(q_count, 1));
  const std::vector<uint32_t> k = bf16(testing::RandomVector(kv_count, 2));
  const std::vector<uint32_t> v = bf16(testing::RandomVector(kv_count, 3));
  const int64_t out_size = out_dtype == v1::FP32 ? 4 : 2;
  std::vector<uint32_t> out(q_count * out_size / 4 + 2);
  const auto at = [&](const std::vector<uint32_t>& x) { return reinterpret_cast<const char*>(x.data()) + offset; };
  SdpaArgs a;
  a.shape = s;
  a.q = {at(q), v1::BF16};
  a.k = {at(k), v1::BF16};
  a.v = {at(v), v1::BF16};
  a.out = {reinterpret_cast<char*>(out.data()) + offset, out_dtype};
  EXPECT_TRUE(backend.ScaledDotProductAttention(a).ok());
  std::vector<float> decoded(q_count);
  DecodeToFloat(out_dtype, a.out.data, q_count, decoded.data());
  return decoded;
}

TEST_P(Bf16TilesTest, AttentionCoreCallsMultiplyInBf16) {
  const std::string& isa = GetParam();
  if (kernels::TileKernelsFor(isa.c_str()) == nullptr || cpu::NativeBf16Matmul().empty()) {
    GTEST_SKIP() << "this CPU (or its kernel) does not run " << isa << " with bf16 projections";
  }
  absl::StatusOr<std::unique_ptr<CpuBackend>> bf16 = CpuBackend::Create(isa);
  absl::StatusOr<std::unique_ptr<CpuBackend>> fp32 = CpuBackend::Create("auto", /*bf16=*/false);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  // The probabilities rounded to bf16: close to the fp32 core's result, not equal to it.
  const std::vector<float> in_bf16 = RunBf16Sdpa(**bf16, 64), in_fp32 = RunBf16Sdpa(**fp32, 64);
  EXPECT_NE(in_bf16, in_fp32);
  EXPECT_TRUE(testing::AllClose(in_bf16, in_fp32, 3e-2, 3e-2));
  // A head_dim the bf16 sets do not take runs the fp32 core.
  EXPECT_EQ(RunBf16Sdpa(**bf16, 40), RunBf16Sdpa(**fp32, 40));
}

// The bf16 set reads bf16 Q, K, V and writes a bf16 output in place where they are 2-byte aligned, else through fp32
// copies: either way the same operands meet the same roundings, so the results are bit-identical.
TEST_P(Bf16TilesTest, UnalignedBf16TensorsGiveTheAlignedResult) {
  const std::string& isa = GetParam();
  if (kernels::TileKernelsFor(isa.c_str()) == nullptr || cpu::NativeBf16Matmul().empty()) {
    GTEST_SKIP() << "this CPU (or its kernel) does not run " << isa << " with bf16 projections";
  }
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(isa);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  for (v1::DataType out : {v1::BF16, v1::FP32}) {
    const std::vector<float> aligned = RunBf16Sdpa(**cpu, 64, out, /*odd_addresses=*/false);
    const std::vector<float> odd = RunBf16Sdpa(**cpu, 64, out, /*odd_addresses=*/true);
    EXPECT_EQ(aligned, odd) << v1::DataType_Name(out);
  }
}

INSTANTIATE_TEST_SUITE_P(Sets, Bf16TilesTest, ::testing::Values("amx", "avx512bf16"),
                         [](const auto& info) { return std::string(info.param); });

TEST(CpuBackend, RunsSmallCallsInline) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->inline_max_flops(), CpuBackend::kInlineMaxFlops);
  EXPECT_LE(CpuBackend::kInlineMaxFlops, CpuBackend::kSerialFlops);  // what runs inline runs on one thread
}

TEST(CpuBackend, WarmUpSucceeds) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_TRUE((*cpu)->WarmUp().ok());
}

AttentionProblem LayerProblem(v1::DataType dtype) {
  AttentionProblem p;
  p.shape.batch = 1;
  p.shape.q_len = p.shape.kv_len = 16;
  p.shape.d_model = p.shape.d_kv_in = p.shape.d_v_in = 512;
  p.shape.heads = {8, 8, 64, false, 0.125f};
  p.input_dtype = p.output_dtype = dtype;
  return p;
}

TEST(CpuBackend, Bf16LayerCallsComputeInBf16WhereTheCpuHasIt) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  if (cpu::NativeBf16Matmul().empty()) {
    EXPECT_EQ((*cpu)->ComputeDtype(LayerProblem(v1::BF16)), v1::FP32);
    EXPECT_NE((*cpu)->device().find("fp32 projections only"), std::string::npos) << (*cpu)->device();
    GTEST_SKIP() << "no native bf16 on this CPU: every request computes in fp32";
  }
  EXPECT_EQ((*cpu)->ComputeDtype(LayerProblem(v1::BF16)), v1::BF16);
  EXPECT_NE((*cpu)->device().find("bf16 projections on " + cpu::NativeBf16Matmul()), std::string::npos)
      << (*cpu)->device();
  EXPECT_EQ((*cpu)->ComputeDtype(LayerProblem(v1::FP32)), v1::FP32);
  EXPECT_EQ((*cpu)->ComputeDtype(LayerProblem(v1::FP16)), v1::FP32);  // oneDNN 2.6 has no fp16 matmul on x86
  // The attention core alone multiplies in bf16 on a bf16 set only, at the head dims it takes.
  AttentionProblem sdpa = LayerProblem(v1::BF16);
  sdpa.shape.d_model = sdpa.shape.d_kv_in = sdpa.shape.d_v_in = 0;
  const bool bf16_tiles = (*cpu)->device().find("bf16 attention on") != std::string::npos;
  EXPECT_EQ((*cpu)->ComputeDtype(sdpa), bf16_tiles ? v1::BF16 : v1::FP32);
  sdpa.shape.heads.head_dim = 40;
  EXPECT_EQ((*cpu)->ComputeDtype(sdpa), v1::FP32);
  absl::StatusOr<std::unique_ptr<CpuBackend>> fp32 = CpuBackend::Create("auto", /*bf16=*/false);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_EQ((*fp32)->ComputeDtype(LayerProblem(v1::BF16)), v1::FP32);
}

// Runs `layer` (the demo layer's shape) on 16 bf16 tokens; `inline_weights` passes its weights as a request's
// inline weights would be.
void RunDemoLayer(Backend& backend, const Layer& layer, bool inline_weights) {
  const std::vector<float> x = testing::RandomVector(16 * 512, 3, 1.0f);
  std::vector<uint16_t> query(x.size()), out(x.size());
  EncodeFromFloat(v1::BF16, x.data(), x.size(), query.data());
  MhaArgs a;
  a.shape = LayerProblem(v1::BF16).shape;
  a.weights = layer.Weights();
  if (inline_weights) a.weights.resident_id = 0;
  a.kv_source = KvSource::kQuery;
  a.query = a.key = a.value = {query.data(), v1::BF16};
  a.out = {out.data(), v1::BF16};
  ASSERT_TRUE(backend.MultiHeadAttention(a).ok());
}

TEST(CpuBackend, StoredLayersArePackedOnceAndInlineWeightsPerCall) {
  if (cpu::NativeBf16Matmul().empty()) GTEST_SKIP() << "no native bf16 on this CPU";
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::shared_ptr<const Layer> layer = MakeDemoLayer();
  const int64_t before = cpu::PackedWeightBytes();
  RunDemoLayer(**cpu, *layer, /*inline_weights=*/true);
  EXPECT_EQ(cpu::PackedWeightBytes(), before);  // packed for the call, not kept
  RunDemoLayer(**cpu, *layer, /*inline_weights=*/false);
  const int64_t packed = cpu::PackedWeightBytes();
  // Q|K|V [512, 1536] and O [512, 512] in bf16 (packed layouts may pad).
  EXPECT_GE(packed - before, (512 * 1536 + 512 * 512) * 2);
  RunDemoLayer(**cpu, *layer, /*inline_weights=*/false);
  EXPECT_EQ(cpu::PackedWeightBytes(), packed);  // the second call reuses them
  // Another layer (a new id, even where its memory reuses the first's addresses) is packed for itself.
  RunDemoLayer(**cpu, *MakeDemoLayer(), /*inline_weights=*/false);
  EXPECT_GT(cpu::PackedWeightBytes(), packed);
}

TEST(CpuBackend, ABf16QueryWithFp32KeysTakesTheFp32Path) {
  // A request may mix dtypes: the bf16 path reads every activation as bf16, so it must not take this one.
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  absl::StatusOr<std::unique_ptr<CpuBackend>> fp32 = CpuBackend::Create("auto", /*bf16=*/false);
  ASSERT_TRUE(cpu.ok() && fp32.ok());
  const std::shared_ptr<const Layer> layer = MakeDemoLayer();
  const std::vector<float> x = testing::RandomVector(16 * 512, 3, 1.0f), kv = testing::RandomVector(16 * 512, 4, 1.0f);
  std::vector<uint16_t> query(x.size());
  EncodeFromFloat(v1::BF16, x.data(), x.size(), query.data());
  std::vector<float> got(x.size()), want(x.size());
  MhaArgs a;
  a.shape = LayerProblem(v1::BF16).shape;
  a.weights = layer->Weights();
  a.kv_source = KvSource::kKeyValue;
  a.query = {query.data(), v1::BF16};
  a.key = a.value = {kv.data(), v1::FP32};
  a.out = {got.data(), v1::FP32};
  ASSERT_TRUE((*cpu)->MultiHeadAttention(a).ok());
  a.out = {want.data(), v1::FP32};
  ASSERT_TRUE((*fp32)->MultiHeadAttention(a).ok());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace mha
