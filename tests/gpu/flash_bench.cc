// The fused attention kernel's speed on a GPU, next to the cuBLAS bf16 matrix-product rate measured in the same
// run, and a check of the tensor-core kernel against the SIMT kernel on the same data. Run by
// tests/gpu/device-check.sh on a GPU machine; built in CI so that it never rots. Without a GPU it prints the
// driver's reason and exits 2.
//
//   flash_bench --probe        says whether a GPU is usable (exit 0) or why not (exit 2)
//   flash_bench [--quick]      prints a Markdown table: T, d_k, H/Hkv, causal, ms, TFLOP/s, % of the GEMM rate
//
// Then a session's prefill through the paged kernels' dense path (paged_plan.h): one sequence appending T tokens to
// an empty bf16 cache in 32-token blocks (LaunchPagedAppend), its queries rotated and its K and V gathered
// (LaunchPagedDenseInputs), then the causal tensor-core kernel: the time of all three against the causal FLOPs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "server/backends/cuda/cublas_api.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/kernels.h"
#include "server/backends/cuda/paged_kernels.h"
#include "tests/gpu/bench_util.h"

namespace mha {
namespace cuda {
namespace {

// n values uniform in [-1, 1) from a hash of the index, made on the host in bf16 and copied to the device.
__nv_bfloat16* Random(int64_t n, uint32_t seed) {
  std::vector<__nv_bfloat16> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = __float2bfloat16(bench::HashValue(i, seed));
  __nv_bfloat16* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMemcpy(p, host.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  return p;
}

// Median milliseconds of `reps` timed runs of f after two untimed ones.
template <typename F>
float TimeMs(F f, int reps) {
  return bench::TimeMs(nullptr, f, reps, 2).median;
}

double GemmTflops(const CublasApi& api, int n) {
  cublasHandle_t handle;
  if (api.create(&handle) != CUBLAS_STATUS_SUCCESS) return 0;
  __nv_bfloat16 *a = Random(int64_t{n} * n, 1), *b = Random(int64_t{n} * n, 2), *c = Random(int64_t{n} * n, 3);
  const float alpha = 1, beta = 0;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  const float ms = TimeMs(
      [&] {
        status = api.gemm_ex(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                             &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      10);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  api.destroy(handle);
  if (status != CUBLAS_STATUS_SUCCESS) return 0;
  return 2.0 * n * n * static_cast<double>(n) / (ms * 1e-3) / 1e12;
}

AttentionParams Params(const void* q, const void* k, const void* v, void* out, int64_t b, int64_t t, int64_t h,
                       int64_t hkv, int64_t dk, bool causal) {
  AttentionParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.q_row_stride = h * dk;
  p.kv_row_stride = hkv * dk;
  p.dtype = kBF16;
  p.out = out;
  p.out_dtype = kBF16;
  p.batch = b;
  p.q_len = p.kv_len = t;
  p.heads = h;
  p.kv_heads = hkv;
  p.head_dim = dk;
  p.causal = causal;
  p.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  return p;
}

FlashPlan Plan(const AttentionParams& p) {
  AttentionShape s;
  s.batch = p.batch;
  s.q_len = p.q_len;
  s.kv_len = p.kv_len;
  s.heads.num_heads = p.heads;
  s.heads.num_kv_heads = p.kv_heads;
  s.heads.head_dim = p.head_dim;
  s.heads.causal = p.causal;
  s.heads.scale = p.scale;
  return *PlanFlash(s, v1::BF16);
}

// A variant of the tensor-core kernel against the SIMT kernel (fp32 arithmetic throughout) on one causal GQA case;
// returns the largest absolute difference of the outputs.
float CrossCheck(int64_t dk, int block_m, bool async_copies) {
  const int64_t b = 2, t = 300, h = 8, hkv = 2;
  __nv_bfloat16 *q = Random(b * t * h * dk, 11), *k = Random(b * t * hkv * dk, 12), *v = Random(b * t * hkv * dk, 13);
  float *tc = nullptr, *simt = nullptr;
  CHECK_CUDA(cudaMalloc(&tc, b * t * h * dk * 4));
  CHECK_CUDA(cudaMalloc(&simt, b * t * h * dk * 4));
  AttentionParams p = Params(q, k, v, tc, b, t, h, hkv, dk, true);
  p.out_dtype = kF32;
  FlashPlan plan = TensorCoreVariant(Plan(p), t, block_m, async_copies);
  CHECK_CUDA(LaunchAttention(p, plan, nullptr));
  p.out = simt;
  plan.kernel = FlashKernel::kSimt;
  plan.block_m = kSimtWarps;
  plan.threads = kSimtThreads;
  plan.grid_y = (t + kSimtWarps - 1) / kSimtWarps;
  CHECK_CUDA(LaunchAttention(p, plan, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> a(b * t * h * dk), c(a.size());
  CHECK_CUDA(cudaMemcpy(a.data(), tc, a.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(c.data(), simt, c.size() * 4, cudaMemcpyDeviceToHost));
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - c[i]));
  for (void* x : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(tc),
                  static_cast<void*>(simt)}) {
    cudaFree(x);
  }
  return worst;
}

// A session's prefill of t tokens (H = 32 over Hkv = 8, d_k) through the dense path: milliseconds of the append,
// the dense inputs and the causal tensor-core kernel together.
float PagedPrefillMs(int64_t t, int64_t dk, int reps) {
  const int64_t h = 32, hkv = 8, bt = 32, blocks = (t + bt - 1) / bt, block_bytes = hkv * 2 * dk * bt * 2;
  char* pool = nullptr;
  CHECK_CUDA(cudaMalloc(&pool, blocks * block_bytes));
  std::vector<char*> table(blocks);
  for (int64_t b = 0; b < blocks; ++b) table[b] = pool + b * block_bytes;
  std::vector<float> rows(t * (h + 2 * hkv) * dk);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = bench::HashValue(i, 31);
  PagedSequenceDesc seq;
  seq.new_tokens = t;
  seq.dense = 1;
  char **d_table = nullptr, *scratch = nullptr;
  float* d_rows = nullptr;
  PagedSequenceDesc* d_seq = nullptr;
  CHECK_CUDA(cudaMalloc(&d_table, blocks * sizeof(char*)));
  CHECK_CUDA(cudaMalloc(&d_rows, rows.size() * 4));
  CHECK_CUDA(cudaMalloc(&d_seq, sizeof(seq)));
  CHECK_CUDA(cudaMalloc(&scratch, (t * h * dk + 2 * t * hkv * dk) * 2 + t * h * dk * 4));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), blocks * sizeof(char*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_rows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_seq, &seq, sizeof(seq), cudaMemcpyHostToDevice));
  PagedParams p;
  p.sequences = d_seq;
  p.blocks = d_table;
  p.num_sequences = 1;
  p.rows = t;
  p.q = d_rows;
  p.k = d_rows + h * dk;
  p.v = d_rows + (h + hkv) * dk;
  p.q_stride = p.kv_stride = (h + 2 * hkv) * dk;
  p.heads = h;
  p.kv_heads = hkv;
  p.head_dim = dk;
  p.block_tokens = bt;
  p.cache_dtype = kBF16;
  char *q = scratch, *k = q + t * h * dk * 2, *v = k + t * hkv * dk * 2, *out = v + t * hkv * dk * 2;
  const AttentionParams a = Params(q, k, v, out, 1, t, h, hkv, dk, true);
  AttentionParams wide = a;
  wide.out_dtype = kF32;
  const FlashPlan plan = Plan(a);
  const float ms = TimeMs(
      [&] {
        CHECK_CUDA(LaunchPagedAppend(p, nullptr));
        CHECK_CUDA(LaunchPagedDenseInputs(p, 0, t, t, q, k, v, nullptr));
        CHECK_CUDA(LaunchAttention(wide, plan, nullptr));
      },
      reps);
  for (void* x : {static_cast<void*>(pool), static_cast<void*>(d_table), static_cast<void*>(d_rows),
                  static_cast<void*>(d_seq), static_cast<void*>(scratch)}) {
    cudaFree(x);
  }
  return ms;
}

int Main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool probe = argc > 1 && std::strcmp(argv[1], "--probe") == 0;  // only say whether a GPU is usable
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    std::printf("no usable GPU: %s\n", e != cudaSuccess ? cudaGetErrorString(e) : "no device");
    return 2;
  }
  cudaDeviceProp props;
  CHECK_CUDA(cudaGetDeviceProperties(&props, 0));
  if (probe) {
    std::printf("GPU: %s\n", props.name);
    return 0;
  }
  absl::StatusOr<const CublasApi*> api = CublasApi::Load();
  if (!api.ok()) {
    std::printf("%s\n", std::string(api.status().message()).c_str());
    return 2;
  }
  std::printf("# flash_bench on %s (sm_%d%d, %d SMs)\n\n", props.name, props.major, props.minor,
              props.multiProcessorCount);
  for (int64_t dk : {64, 128}) {
    for (int block_m : {128, 64}) {
      for (bool async_copies : {true, false}) {
        const float diff = CrossCheck(dk, block_m, async_copies);
        std::printf("tensor-core (%d rows, %s copies) vs SIMT kernel, bf16 causal GQA d_k=%lld: max |diff| %.2e %s\n",
                    block_m, async_copies ? "async" : "plain", static_cast<long long>(dk), diff,
                    diff < 2e-2f ? "ok" : "MISMATCH");
      }
    }
  }
  const double gemm = GemmTflops(**api, 8192);
  std::printf("\ncuBLAS bf16 GEMM 8192^3 (fp32 accumulate): %.1f TFLOP/s\n\n", gemm);
  // The plan's kernel (128 query rows per block, asynchronous tile copies), then the same kernel with plain tile
  // loads between barriers and with 64-row blocks.
  std::printf("| T | d_k | H/Hkv | causal | B | ms | TFLOP/s | of GEMM | plain loads TFLOP/s | 64 rows TFLOP/s |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  const int64_t tokens = 16384, h = 32;
  // Every row has B * T = tokens: one set of random tensors, made once at the largest size, serves them all.
  const int64_t most = tokens * h * 128;
  __nv_bfloat16 *q = Random(most, 21), *k = Random(most, 22), *v = Random(most, 23), *o = nullptr;
  CHECK_CUDA(cudaMalloc(&o, most * 2));
  for (int64_t t : {1024, 2048, 4096, 8192, 16384}) {
    if (quick && t != 4096) continue;
    for (int64_t dk : {64, 128}) {
      for (int64_t hkv : {32, 8}) {
        for (bool causal : {false, true}) {
          const int64_t b = std::max<int64_t>(1, tokens / t);
          const AttentionParams p = Params(q, k, v, o, b, t, h, hkv, dk, causal);
          const FlashPlan plan = Plan(p);
          const FlashPlan plain = TensorCoreVariant(plan, t, plan.block_m, false);
          const FlashPlan short_rows = TensorCoreVariant(plan, t, 64, true);
          const float ms = TimeMs([&] { CHECK_CUDA(LaunchAttention(p, plan, nullptr)); }, quick ? 3 : 7);
          const float plain_ms = TimeMs([&] { CHECK_CUDA(LaunchAttention(p, plain, nullptr)); }, quick ? 3 : 5);
          const float short_ms = TimeMs([&] { CHECK_CUDA(LaunchAttention(p, short_rows, nullptr)); }, quick ? 3 : 5);
          const double pairs = causal ? t * (t + 1) / 2.0 : static_cast<double>(t) * t;
          const double flop = 4.0 * b * h * dk * pairs;
          const double tflops = flop / (ms * 1e-3) / 1e12;
          std::printf("| %lld | %lld | %lld/%lld | %s | %lld | %.3f | %.1f | %.0f%% | %.1f | %.1f |\n",
                      static_cast<long long>(t), static_cast<long long>(dk), static_cast<long long>(h),
                      static_cast<long long>(hkv), causal ? "yes" : "no", static_cast<long long>(b), ms, tflops,
                      gemm > 0 ? 100 * tflops / gemm : 0.0, flop / (plain_ms * 1e-3) / 1e12,
                      flop / (short_ms * 1e-3) / 1e12);
        }
      }
    }
  }
  for (void* x : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(o)}) {
    cudaFree(x);
  }
  std::printf("\n| paged prefill T | d_k | ms (append + gather + kernel) | TFLOP/s | of GEMM |\n|---|---|---|---|---|\n");
  for (int64_t t : {1024, 4096, 16384}) {
    if (quick && t != 4096) continue;
    for (int64_t dk : {64, 128}) {
      const float ms = PagedPrefillMs(t, dk, quick ? 3 : 5);
      const double tflops = 4.0 * 32 * dk * (t * (t + 1) / 2.0) / (ms * 1e-3) / 1e12;
      std::printf("| %lld | %lld | %.3f | %.1f | %.0f%% |\n", static_cast<long long>(t), static_cast<long long>(dk),
                  ms, tflops, gemm > 0 ? 100 * tflops / gemm : 0.0);
    }
  }
  return 0;
}

}  // namespace
}  // namespace cuda
}  // namespace mha

int main(int argc, char** argv) { return mha::cuda::Main(argc, argv); }
