// Backend-level multi-head attention throughput on a fixed table of shapes, as GFLOP/s and as a share of this
// machine's fp32 peak measured in the same run (fma_probe). Google Benchmark flags apply, e.g.
//   build/bin/attention_bench --benchmark_filter=b8_t512 --benchmark_min_time=1
// `--memory_case` instead runs B=1, T=16384, d=1024, H=16 once (weights off) and prints the peak RSS above the
// inputs and outputs.
#include <omp.h>
#include <unistd.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "oneapi/dnnl/dnnl.h"
#include "proto/mha/v1/attention_shape.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/bf16_matmul.h"
#include "server/backends/cpu/cpu_backend.h"
#include "server/backends/cpu/tile_kernels.h"
#include "tests/bench/fma_probe.h"

namespace mha::bench {
namespace {

struct Shape {
  std::string name;
  int64_t batch, q_len, kv_len, d_model, heads, kv_heads;
  bool causal;
};

// The benchmark table (docs/PERFORMANCE.md): (B, Tq, Tk, d_model, H, Hkv), causal variants of the last two.
const std::vector<Shape>& Shapes() {
  static const auto* shapes = new std::vector<Shape>{
      {"b1_t16_d64_h4", 1, 16, 16, 64, 4, 4, false},
      {"b32_t64_d256_h4", 32, 64, 64, 256, 4, 4, false},
      {"b8_t128_d512_h8", 8, 128, 128, 512, 8, 8, false},
      {"b8_t512_d512_h8", 8, 512, 512, 512, 8, 8, false},
      {"b8_t512_d512_h8_gqa2", 8, 512, 512, 512, 8, 2, false},
      {"b8_t512_d512_h8_gqa2_causal", 8, 512, 512, 512, 8, 2, true},
      {"b1_t2048_d1024_h16", 1, 2048, 2048, 1024, 16, 16, false},
      {"b1_t2048_d1024_h16_causal", 1, 2048, 2048, 1024, 16, 16, true},
  };
  return *shapes;
}

// The self-attention layer of a table row (d_k = d_model / H); with_projections false: the attention core alone.
AttentionShape ToShape(const Shape& s, bool with_projections = true) {
  AttentionShape shape;
  shape.batch = s.batch;
  shape.q_len = s.q_len;
  shape.kv_len = s.kv_len;
  if (with_projections) shape.d_model = shape.d_kv_in = shape.d_v_in = s.d_model;
  shape.heads.num_heads = s.heads;
  shape.heads.num_kv_heads = s.kv_heads;
  shape.heads.head_dim = s.d_model / s.heads;
  shape.heads.causal = s.causal;
  shape.heads.scale = 1.0f / std::sqrt(static_cast<float>(shape.heads.head_dim));
  return shape;
}

// FLOPs as the server counts them (AttentionFlops: causal counts the visible pairs only).
double Flops(const Shape& s) { return AttentionFlops(ToShape(s)); }

// Inputs and outputs of one shape, filled deterministically; the weights as a registered layer holds them (Q|K|V
// fused into one matrix).
struct Problem {
  AttentionShape shape;
  std::vector<float> x, w_qkv, w_o, out, weights;

  Problem(const Shape& s, bool with_weights) : shape(ToShape(s)) {
    auto fill = [](std::vector<float>& v, int64_t n, float bound) {
      v.resize(n);
      uint32_t state = static_cast<uint32_t>(n);
      for (float& x : v) {
        state = state * 1664525u + 1013904223u;
        x = bound * (static_cast<float>(state >> 8) / (1 << 23) - 1.0f);
      }
    };
    const int64_t qw = shape.heads.q_width(), width = qw + 2 * shape.heads.kv_width();
    fill(x, s.batch * s.q_len * s.d_model, 1.0f);
    const float bound = 1.0f / std::sqrt(static_cast<float>(s.d_model));
    fill(w_qkv, s.d_model * width, bound);
    fill(w_o, qw * s.d_model, bound);
    out.resize(x.size());
    if (with_weights) weights.resize(s.batch * s.heads * s.q_len * s.kv_len);
  }

  MhaArgs Args() {
    const int64_t qw = shape.heads.q_width(), kvw = shape.heads.kv_width();
    MhaArgs a;
    a.shape = shape;
    a.weights.fused_qkv = true;
    a.weights.w_q = w_qkv.data();
    a.weights.w_k = w_qkv.data() + qw;
    a.weights.w_v = w_qkv.data() + qw + kvw;
    a.weights.ld_q = a.weights.ld_k = a.weights.ld_v = qw + 2 * kvw;
    a.weights.w_o = w_o.data();
    a.kv_source = KvSource::kQuery;
    a.query = a.key = a.value = {x.data(), v1::FP32};
    a.out = {out.data(), v1::FP32};
    if (!weights.empty()) a.attention_weights = {weights.data(), v1::FP32};
    return a;
  }
};

PeakResult& Peak() {
  static PeakResult peak;
  return peak;
}

// Runs the benchmark loop over `call`, timing every call, and sets the counters that report.py prints:
//   GFLOPs, ms_best: the fastest call; GFLOPs_median, ms_median: the median call;
//   peak_gflops: the FMA probe, taken again right before and right after the loop (the best of 8 windows of about
//     12 ms each, 0.15 s in all), the higher of the two;
//   pct_peak = GFLOPs / peak_gflops, pct_peak_median = GFLOPs_median / peak_gflops.
// Best against best is the like-for-like ratio: the probe keeps its fastest window, and peers.py keeps numpy's and
// PyTorch's fastest run. On this shared VM other tenants' load slows some calls and not others, and the FMA probe
// does not always see it; the median shows how much. Google Benchmark's own real_time column is the mean.
template <typename Call>
void TimeAgainstPeak(benchmark::State& state, double flops, Call call) {
  const double peak_before = MeasurePeak(Peak().threads, 0.05).gflops;
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(call());
    benchmark::ClobberMemory();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double peak = std::max(peak_before, MeasurePeak(Peak().threads, 0.05).gflops);
  if (seconds.empty()) return;  // Google Benchmark runs at least one iteration; kept for safety
  std::sort(seconds.begin(), seconds.end());
  const double best = seconds.front(), median = seconds[seconds.size() / 2];
  const double gflops = flops / best / 1e9, gflops_median = flops / median / 1e9;
  state.counters["GFLOPs"] = gflops;
  state.counters["GFLOPs_median"] = gflops_median;
  state.counters["ms_best"] = best * 1e3;
  state.counters["ms_median"] = median * 1e3;
  state.counters["peak_gflops"] = peak;
  state.counters["pct_peak"] = 100.0 * gflops / peak;
  state.counters["pct_peak_median"] = 100.0 * gflops_median / peak;
}

void BM_MultiHeadAttention(benchmark::State& state, Shape shape, bool with_weights) {
  auto backend = CpuBackend::Create();
  if (!backend.ok()) {
    state.SkipWithError("no oneDNN CPU engine");
    return;
  }
  Problem problem(shape, with_weights);
  MhaArgs args = problem.Args();
  if (!(*backend)->MultiHeadAttention(args).ok()) {  // warm-up: primitive creation, first touch
    state.SkipWithError("backend failed");
    return;
  }
  TimeAgainstPeak(state, Flops(shape), [&] { return (*backend)->MultiHeadAttention(args); });
}

// A bf16 attention-core set (amx, else avx512bf16) runs on this CPU.
bool HasBf16Tiles() {
  return kernels::TileKernelsFor("amx") != nullptr || kernels::TileKernelsFor("avx512bf16") != nullptr;
}

// The paths a bf16 layer call can take.
enum class Bf16Path {
  kBf16,          // what the server runs: bf16 projections, the attention core on a bf16 set (amx or avx512bf16)
  kBf16Fp32Core,  // bf16 projections, the attention core on the fp32 AVX-512 tiles (only where a bf16 set runs)
  kFp32,          // everything in fp32 (what CPUs without native bf16 run)
};

// The layer on bf16 inputs and outputs, as a stored layer (weights packed once), on `path`, so that the paths are
// measured in the same run.
void BM_MultiHeadAttentionBf16(benchmark::State& state, Shape shape, Bf16Path path) {
  if (path != Bf16Path::kFp32 && cpu::NativeBf16Matmul().empty()) {
    state.SkipWithError("no native bf16 on this CPU");
    return;
  }
  if (path == Bf16Path::kBf16Fp32Core && !HasBf16Tiles()) {
    state.SkipWithError("no bf16 attention set on this CPU: the bf16 path's core is fp32 already");
    return;
  }
  auto backend = CpuBackend::Create(path == Bf16Path::kBf16Fp32Core ? "avx512" : "auto", path != Bf16Path::kFp32);
  if (!backend.ok()) {
    state.SkipWithError("no oneDNN CPU engine");
    return;
  }
  Problem problem(shape, /*with_weights=*/false);
  std::vector<uint16_t> x16(problem.x.size()), out16(problem.out.size());
  EncodeFromFloat(v1::BF16, problem.x.data(), problem.x.size(), x16.data());
  MhaArgs args = problem.Args();
  args.weights.resident_id = uint64_t{1} << 62;  // as a stored layer: packed on the first call
  args.query = args.key = args.value = {x16.data(), v1::BF16};
  args.out = {out16.data(), v1::BF16};
  if (!(*backend)->MultiHeadAttention(args).ok()) {
    state.SkipWithError("backend failed");
    return;
  }
  TimeAgainstPeak(state, Flops(shape), [&] { return (*backend)->MultiHeadAttention(args); });
}

// oneDNN's bf16 matmul on the fused Q|K|V projection's shape (weights packed once): the rate the bf16 layer is
// held against.
void BM_Bf16Matmul(benchmark::State& state, Shape shape) {
  if (cpu::NativeBf16Matmul().empty()) {
    state.SkipWithError("no native bf16 on this CPU");
    return;
  }
  Problem problem(shape, /*with_weights=*/false);
  const int64_t m = shape.batch * shape.q_len, k = shape.d_model, n = 3 * shape.d_model;
  std::vector<uint16_t> x16(problem.x.size());
  EncodeFromFloat(v1::BF16, problem.x.data(), problem.x.size(), x16.data());
  std::vector<float> y(m * n);
  const cpu::Bf16Weights w{problem.w_qkv.data(), n, uint64_t{1} << 62};
  const auto call = [&] {
    return cpu::MatmulBf16(x16.data(), m, k, k, w, nullptr, n, y.data(), cpu::MatmulOut::kF32, n, nullptr);
  };
  if (!call().ok()) {
    state.SkipWithError("matmul failed");
    return;
  }
  TimeAgainstPeak(state, 2.0 * m * k * n, call);
}

// Head-packed fp32 Q [B, Tq, H, d_k] and one tensor for K and V [B, Tk, Hkv, d_k] for the attention-core rows.
struct CoreOperands {
  explicit CoreOperands(const Shape& shape)
      : q(shape.batch * shape.q_len * shape.d_model, 0.5f),
        kv(shape.batch * shape.kv_len * shape.kv_heads * (shape.d_model / shape.heads)) {
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(i % 7) * 0.1f;
  }
  std::vector<float> q, kv;
};

// The attention core alone (ScaledDotProductAttention on head-packed Q, K, V): no projections, so the FLOPs are
// 4 B H d_k times the visible pairs, and the causal saving shows undiluted.
void BM_AttentionCore(benchmark::State& state, Shape shape, bool with_weights) {
  auto backend = CpuBackend::Create();
  if (!backend.ok()) {
    state.SkipWithError("no oneDNN CPU engine");
    return;
  }
  SdpaArgs args;
  args.shape = ToShape(shape, /*with_projections=*/false);
  CoreOperands operands(shape);
  std::vector<float>& q = operands.q;
  std::vector<float>& kv = operands.kv;
  std::vector<float> out(q.size()), weights;
  if (with_weights) weights.resize(shape.batch * shape.heads * shape.q_len * shape.kv_len);
  args.q = {q.data(), v1::FP32};
  args.k = args.v = {kv.data(), v1::FP32};
  args.out = {out.data(), v1::FP32};
  if (with_weights) args.weights = {weights.data(), v1::FP32};
  if (!(*backend)->ScaledDotProductAttention(args).ok()) {
    state.SkipWithError("backend failed");
    return;
  }
  TimeAgainstPeak(state, AttentionFlops(args.shape), [&] { return (*backend)->ScaledDotProductAttention(args); });
}

// What the softmax statistics cost (attention.proto's return_lse and return_head_stats): the attention core alone
// (fused kernels) and the layer (whose head statistics add the heads' contributions, one product per head), with
// none, lse only, or every statistic, registered next to each other so that they run in the same minute.
enum class Stats { kNone, kLse, kAll };

void BM_Statistics(benchmark::State& state, Shape shape, bool layer, Stats stats) {
  auto backend = CpuBackend::Create();
  if (!backend.ok()) {
    state.SkipWithError("no oneDNN CPU engine");
    return;
  }
  const int64_t rows = shape.batch * shape.heads * shape.q_len;
  std::vector<std::vector<float>> arrays(6, std::vector<float>(rows));
  RowStats row_stats;
  if (stats != Stats::kNone) row_stats.lse = arrays[0].data();
  if (stats == Stats::kAll) {
    row_stats.entropy = arrays[1].data();
    row_stats.confidence = arrays[2].data();
    row_stats.distance = arrays[3].data();
    row_stats.sink = arrays[4].data();
    if (layer) row_stats.contribution = arrays[5].data();
  }
  if (layer) {
    Problem problem(shape, /*with_weights=*/false);
    MhaArgs args = problem.Args();
    args.stats = row_stats;
    if (!(*backend)->MultiHeadAttention(args).ok()) {
      state.SkipWithError("backend failed");
      return;
    }
    TimeAgainstPeak(state, Flops(shape), [&] { return (*backend)->MultiHeadAttention(args); });
    return;
  }
  SdpaArgs args;
  args.shape = ToShape(shape, /*with_projections=*/false);
  CoreOperands operands(shape);
  std::vector<float> out(operands.q.size());
  args.q = {operands.q.data(), v1::FP32};
  args.k = args.v = {operands.kv.data(), v1::FP32};
  args.out = {out.data(), v1::FP32};
  args.stats = row_stats;
  if (!(*backend)->ScaledDotProductAttention(args).ok()) {
    state.SkipWithError("backend failed");
    return;
  }
  TimeAgainstPeak(state, AttentionFlops(args.shape), [&] { return (*backend)->ScaledDotProductAttention(args); });
}

// The attention core alone on bf16 Q, K, V and output: on the bf16 set (kBf16: amx or avx512bf16, where the CPU
// has one) or the fp32 tiles (kFp32), in the same run.
void BM_AttentionCoreBf16(benchmark::State& state, Shape shape, Bf16Path path) {
  if (path == Bf16Path::kBf16 && (!HasBf16Tiles() || cpu::NativeBf16Matmul().empty())) {
    state.SkipWithError("no bf16 attention set on this CPU: a bf16 attention core computes in fp32");
    return;
  }
  auto backend = CpuBackend::Create("auto", path == Bf16Path::kBf16);
  if (!backend.ok()) {
    state.SkipWithError("no oneDNN CPU engine");
    return;
  }
  SdpaArgs args;
  args.shape = ToShape(shape, /*with_projections=*/false);
  const CoreOperands operands(shape);
  const std::vector<float>& q = operands.q;
  const std::vector<float>& kv = operands.kv;
  std::vector<uint16_t> q16(q.size()), kv16(kv.size()), out16(q.size());
  EncodeFromFloat(v1::BF16, q.data(), q.size(), q16.data());
  EncodeFromFloat(v1::BF16, kv.data(), kv.size(), kv16.data());
  args.q = {q16.data(), v1::BF16};
  args.k = args.v = {kv16.data(), v1::BF16};
  args.out = {out16.data(), v1::BF16};
  if (!(*backend)->ScaledDotProductAttention(args).ok()) {
    state.SkipWithError("backend failed");
    return;
  }
  TimeAgainstPeak(state, AttentionFlops(args.shape), [&] { return (*backend)->ScaledDotProductAttention(args); });
}

// The projections alone, as CpuBackend runs them for self-attention without biases: one dnnl_sgemm for the fused
// Q|K|V product [B*T, d] x [d, (H + 2 Hkv) dk] and one for the output [B*T, H dk] x [H dk, d]. With the core row
// of the same shape it splits the layer's time (report.py's "where the time goes"). FLOPs: the first three and the
// fourth terms of AttentionFlops.
void BM_Projections(benchmark::State& state, Shape shape) {
  Problem problem(shape, /*with_weights=*/false);
  const int64_t rows = shape.batch * shape.q_len, d = shape.d_model, dk = d / shape.heads;
  const int64_t qkv = (shape.heads + 2 * shape.kv_heads) * dk, heads_width = shape.heads * dk;
  std::vector<float> projected(rows * qkv), heads(rows * heads_width, 0.25f);
  auto call = [&] {
    dnnl_status_t status = dnnl_sgemm('N', 'N', rows, qkv, d, 1.0f, problem.x.data(), d, problem.w_qkv.data(), qkv,
                                      0.0f, projected.data(), qkv);
    if (status != dnnl_success) return status;
    return dnnl_sgemm('N', 'N', rows, d, heads_width, 1.0f, heads.data(), heads_width, problem.w_o.data(), d, 0.0f,
                      problem.out.data(), d);
  };
  if (call() != dnnl_success) {  // warm-up, and proof that sgemm runs here
    state.SkipWithError("dnnl_sgemm failed");
    return;
  }
  const double flops = 2.0 * rows * d * qkv + 2.0 * rows * heads_width * d;
  TimeAgainstPeak(state, flops, call);
}

long PeakRssKb() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

long CurrentRssKb() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

int MemoryCase() {
  const Shape shape{"b1_t16384_d1024_h16", 1, 16384, 16384, 1024, 16, 16, false};
  Problem problem(shape, /*with_weights=*/false);
  std::fill(problem.out.begin(), problem.out.end(), 0.0f);  // touch the output too
  auto backend = CpuBackend::Create();
  if (!backend.ok()) return 1;
  const long before_kb = CurrentRssKb();
  MhaArgs args = problem.Args();
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = (*backend)->MultiHeadAttention(args);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  const double above_mib = (PeakRssKb() - before_kb) / 1024.0;
  std::printf("memory_case %s: %.1f s, %.1f GFLOP/s, peak RSS above inputs+outputs+weights %.0f MiB "
              "(inputs+outputs %.0f MiB; an O(T^2) score matrix would be %.0f MiB)\n",
              shape.name.c_str(), seconds, Flops(shape) / seconds / 1e9, above_mib,
              2.0 * problem.x.size() * 4 / (1 << 20), 16.0 * 16384 * 16384 * 4 / (1 << 20));
  return above_mib < 1024 ? 0 : 1;
}

}  // namespace
}  // namespace mha::bench

int main(int argc, char** argv) {
  using namespace mha::bench;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--memory_case") == 0) return MemoryCase();
  }
  const int threads = omp_get_max_threads();
  // This machine's clock varies from run to run (a shared VM), so the peak is measured here, in the same run as
  // the benchmarks, as the best of several probes.
  Peak() = MeasurePeak(threads, /*seconds=*/1.0);
  std::printf("fp32 peak: %.1f GFLOP/s on %d threads (%s FMA chains)\n", Peak().gflops, Peak().threads,
              Peak().isa.c_str());
  benchmark::AddCustomContext("peak_gflops", std::to_string(Peak().gflops));
  benchmark::AddCustomContext("peak_isa", Peak().isa);
  for (const Shape& shape : Shapes()) {
    for (bool with_weights : {false, true}) {
      benchmark::RegisterBenchmark((shape.name + (with_weights ? "/weights_on" : "/weights_off")).c_str(),
                                   BM_MultiHeadAttention, shape, with_weights)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  for (const Shape& shape : Shapes()) {
    if (shape.name.rfind("b8_t512_d512_h8", 0) != 0 && shape.name.rfind("b1_t2048", 0) != 0) continue;
    benchmark::RegisterBenchmark(("core_" + shape.name + "/weights_off").c_str(), BM_AttentionCore, shape, false)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const auto& [path, name] :
         {std::pair{Bf16Path::kBf16, "bf16_path"}, std::pair{Bf16Path::kFp32, "fp32_path"}}) {
      benchmark::RegisterBenchmark(("bf16_core_" + shape.name + "/" + name).c_str(), BM_AttentionCoreBf16, shape,
                                   path)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    if (shape.causal) continue;  // the same projections as the non-causal shape
    benchmark::RegisterBenchmark(("proj_" + shape.name + "/weights_off").c_str(), BM_Projections, shape)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // One long sequence, the attention core alone: K and V of one head (4 MiB at head_dim 64) outgrow L2.
  const Shape long_sequence{"b1_t8192_d512_h8", 1, 8192, 8192, 512, 8, 8, false};
  benchmark::RegisterBenchmark(("core_" + long_sequence.name + "/weights_off").c_str(), BM_AttentionCore,
                               long_sequence, false)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark(("bf16_core_" + long_sequence.name + "/bf16_path").c_str(), BM_AttentionCoreBf16,
                               long_sequence, Bf16Path::kBf16)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  // bf16 requests: the bf16 path against its projections with the fp32 core and against the fp32 path,
  // interleaved, on every shape (the small ones show the cost of anything done per call); oneDNN's bf16 matmul rate
  // on the large ones.
  for (const Shape& shape : Shapes()) {
    for (const auto& [path, name] : {std::pair{Bf16Path::kBf16, "bf16_path"},
                                     std::pair{Bf16Path::kBf16Fp32Core, "fp32_core"},
                                     std::pair{Bf16Path::kFp32, "fp32_path"}}) {
      benchmark::RegisterBenchmark(("bf16_" + shape.name + "/" + name).c_str(), BM_MultiHeadAttentionBf16, shape,
                                   path)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    if (shape.batch * shape.q_len < 1024 || shape.causal || shape.kv_heads != shape.heads) continue;
    benchmark::RegisterBenchmark(("bf16_matmul_" + shape.name).c_str(), BM_Bf16Matmul, shape)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  // The statistics' cost: core and layer at two shapes, off / lse / all side by side.
  for (const Shape& shape : Shapes()) {
    if (shape.name != "b8_t512_d512_h8" && shape.name != "b1_t2048_d1024_h16_causal") continue;
    for (bool layer : {false, true}) {
      for (const auto& [stats, name] :
           {std::pair{Stats::kNone, "off"}, std::pair{Stats::kLse, "lse"}, std::pair{Stats::kAll, "all"}}) {
        benchmark::RegisterBenchmark(
            (std::string(layer ? "stats_layer_" : "stats_core_") + shape.name + "/" + name).c_str(), BM_Statistics,
            shape, layer, stats)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
