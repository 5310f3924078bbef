// The CPU decode kernels alone (tile_kernels.h: PagedKernels' scores and values, and between them the online softmax
// of the fp32 set, as the decode path pairs them) on cache parts held in L2, one thread: what one block of one KV
// head costs in compute, apart from memory, per cache dtype, as decode_bench's roofline cannot split it. One decode
// row group (4 query rows, GQA 4, d_k 128) against 48 parts of a block each (random keys and values written in the
// cache's layout and dtype); the three kernels timed apart and together, rounds interleaving the dtypes; best and
// median ns per part, elements (keys and values) per ns, and that rate over the bf16 cache's of the same run; then
// what writing a token costs the 8-bit caches.
//   build/bin/decode_kernel_bench [--isa avx512bf16] [--rounds 5] [--block_tokens 32] [--repeats 200]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/backend.h"
#include "server/backends/cpu/tile_kernels.h"
#include "server/backends/quantized_cache.h"
#include "tests/bench/bench_util.h"

namespace mha::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kRows = 4, kDepth = 128, kParts = 48;

struct Flags {
  std::string isa = "auto";
  int rounds = 5, repeats = 200;
  int64_t block_tokens = 32;
};

// kParts blocks of one KV head in `dtype`, and the buffers one row group's kernels use.
class KernelCase {
 public:
  KernelCase(v1::DataType dtype, int64_t block_tokens)
      : cache_{1, kDepth, block_tokens, dtype}, blocks_(kParts * cache_.BlockBytes()), q_(Random(kRows * kDepth, 3)),
        s_(kRows * block_tokens), acc_(kRows * kDepth), max_(kRows, -1e30f), sum_(kRows), factor_(kRows),
        visible_(kRows, block_tokens) {
    const int64_t tb = block_tokens;
    for (float& x : q_) x *= 0.1f;  // scores of a few units: the exps stay in range
    for (int64_t b = 0; b < kParts; ++b) {
      const std::vector<float> k = Random(tb * kDepth, 100 + b), v = Random(tb * kDepth, 200 + b);
      if (b == 0) k0_ = k, v0_ = v;
      char* block = Block(b);
      if (cache_.Quantized()) {
        quant::WriteTokens(cache_, block, 0, 0, tb, k.data(), kDepth, v.data(), kDepth);
        continue;
      }
      const size_t size = DTypeSize(dtype);
      std::vector<float> kt(kDepth * tb);
      for (int64_t j = 0; j < tb; ++j) {
        for (int64_t c = 0; c < kDepth; ++c) kt[c * tb + j] = k[j * kDepth + c];
      }
      EncodeFromFloat(dtype, kt.data(), kt.size(), block + cache_.KeyOffset(0) * size);
      EncodeFromFloat(dtype, v.data(), v.size(), block + cache_.ValueOffset(0) * size);
    }
  }

  v1::DataType dtype() const { return cache_.dtype; }
  bool Quantized() const { return cache_.Quantized(); }
  int64_t PartBytes() const { return cache_.HeadBytes(); }
  int64_t Elements() const { return 2 * kDepth * cache_.block_tokens; }

  // `repeats` passes over the parts: scores (1), softmax (2), values (4), as `mask` says; ns per part.
  // `set`'s decode kernels, and `softmax`'s online softmax (the decode path takes it from the fp32 set).
  double Run(const kernels::TileKernels& set, const kernels::TileKernels& softmax, int mask, int repeats) {
    const kernels::PagedKernels& k = set.paged[cache_.dtype - 1];
    const int64_t tb = cache_.block_tokens;
    const Clock::time_point start = Clock::now();
    for (int r = 0; r < repeats; ++r) {
      for (int64_t b = 0; b < kParts; ++b) {
        const char* key_part = Block(b) + cache_.KeyPart(0);
        const char* value_part = Block(b) + cache_.ValuePart(0);
        if (mask & 1) {
          k.scores(kRows, tb, kDepth, q_.data(), kDepth, key_part, tb, KeyScales(key_part), s_.data(), tb, nullptr, 0);
        }
        if (mask & 2) {
          softmax.online_softmax(kRows, tb, visible_.data(), s_.data(), tb, max_.data(), sum_.data(), factor_.data(),
                             /*log2_units=*/true);
        }
        if (mask & 4) {
          k.values(kRows, tb, kDepth, s_.data(), tb, value_part, ValueScales(value_part), factor_.data(), acc_.data(),
                   kDepth, nullptr, 0);
        }
      }
    }
    return std::chrono::duration<double, std::nano>(Clock::now() - start).count() / (repeats * kParts);
  }

  // An 8-bit cache's writes (quant::WriteTokens) of block 0's tokens again, `repeats` times: one token a call (a
  // decode step's, its channels' scales growing as keys arrive) or the whole block in one; ns per token.
  double Write(bool one_at_a_time, int repeats) {
    const int64_t tb = cache_.block_tokens, step = one_at_a_time ? 1 : tb;
    const Clock::time_point start = Clock::now();
    for (int r = 0; r < repeats; ++r) {
      for (int64_t j = 0; j < tb; j += step) {
        quant::WriteTokens(cache_, Block(0), 0, j, step, k0_.data() + j * kDepth, kDepth, v0_.data() + j * kDepth,
                           kDepth);
      }
    }
    return std::chrono::duration<double, std::nano>(Clock::now() - start).count() / (repeats * tb);
  }

 private:
  char* Block(int64_t b) { return blocks_.data() + b * cache_.BlockBytes(); }
  const uint16_t* KeyScales(const char* key_part) const {
    if (!cache_.Quantized()) return nullptr;
    return reinterpret_cast<const uint16_t*>(key_part + quant::KeyScalesOffset(cache_));
  }
  const uint16_t* ValueScales(const char* value_part) const {
    if (!cache_.Quantized()) return nullptr;
    return reinterpret_cast<const uint16_t*>(value_part + quant::ValueScalesOffset(cache_));
  }

  KvCacheLayout cache_;
  std::vector<char> blocks_;
  std::vector<float> k0_, v0_, q_, s_, acc_, max_, sum_, factor_;
  std::vector<int64_t> visible_;
};

Flags Parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--isa") flags.isa = argv[i + 1];
    if (name == "--rounds") flags.rounds = std::max(1, std::atoi(argv[i + 1]));
    if (name == "--repeats") flags.repeats = std::max(1, std::atoi(argv[i + 1]));
    if (name == "--block_tokens") flags.block_tokens = std::max(16, std::atoi(argv[i + 1])) / 16 * 16;
  }
  return flags;
}

// The kernel set `isa` names, or the best this CPU runs ("auto").
const kernels::TileKernels* KernelSet(std::string* isa) {
  if (*isa != "auto") return kernels::TileKernelsFor(isa->c_str());
  for (const char* name : {"amx", "avx512bf16", "avx512", "avx2", "portable"}) {
    if (const kernels::TileKernels* set = kernels::TileKernelsFor(name)) {
      *isa = name;
      return set;
    }
  }
  return nullptr;
}

// The fp32 set whose softmax the CPU backend's decode path runs beside `isa`'s decode kernels: AVX-512's beside the
// bf16 sets (whose own softmax keeps bf16's precision, for bf16 requests), else the set itself.
const kernels::TileKernels* SoftmaxSet(const std::string& isa, const kernels::TileKernels* set) {
  if (isa != "amx" && isa != "avx512bf16") return set;
  const kernels::TileKernels* fp32 = kernels::TileKernelsFor("avx512");
  return fp32 != nullptr ? fp32 : set;
}

// Per case, the series of each timing: scores, softmax, values, and all three in turn.
struct Series {
  std::vector<double> ns[4];
};

void Print(const std::vector<KernelCase>& cases, const std::vector<Series>& series) {
  std::printf("%-10s %9s %9s %9s %13s %13s %9s %8s\n", "cache", "scores", "softmax", "values", "part ns best",
              "part ns med", "elem/ns", "x bf16");
  double bf16_rate = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].dtype() == v1::BF16) bf16_rate = cases[i].Elements() / Of(series[i].ns[3], false).median;
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const Stats all = Of(series[i].ns[3], false);
    const double rate = cases[i].Elements() / all.median;
    std::printf("%-10s %9.0f %9.0f %9.0f %13.0f %13.0f %9.2f %8.2f\n", DTypeName(cases[i].dtype()).c_str(),
                Of(series[i].ns[0], false).median, Of(series[i].ns[1], false).median,
                Of(series[i].ns[2], false).median, all.best, all.median, rate, bf16_rate > 0 ? rate / bf16_rate : 0);
  }
}

int Main(int argc, char** argv) {
  Flags flags = Parse(argc, argv);
  const kernels::TileKernels* set = KernelSet(&flags.isa);
  if (set == nullptr) {
    std::fprintf(stderr, "this CPU does not run the kernel set %s\n", flags.isa.c_str());
    return 1;
  }
  const kernels::TileKernels* softmax = SoftmaxSet(flags.isa, set);
  std::vector<KernelCase> cases;
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    cases.emplace_back(dtype, flags.block_tokens);
  }
  std::printf("kernel set %s, 1 thread; per part (one KV head's block of %lld tokens): %d rows x d_k %lld, median "
              "ns of %d rounds\n",
              flags.isa.c_str(), static_cast<long long>(flags.block_tokens), static_cast<int>(kRows),
              static_cast<long long>(kDepth), flags.rounds);
  std::vector<Series> series(cases.size());
  for (KernelCase& c : cases) c.Run(*set, *softmax, 7, std::max(1, flags.repeats / 10));  // warm-up
  for (int round = 0; round < flags.rounds; ++round) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const int masks[4] = {1, 2, 4, 7};
      for (int t = 0; t < 4; ++t) series[i].ns[t].push_back(cases[i].Run(*set, *softmax, masks[t], flags.repeats));
    }
  }
  Print(cases, series);
  // The 8-bit caches' writes, which a decode step makes once per session and KV head (the 16- and 32-bit caches'
  // are a conversion and a copy).
  std::printf("8-bit cache writes, ns per token of one KV head (median of %d rounds): one token a call (decode), a "
              "block in one call (prefill)\n",
              flags.rounds);
  for (KernelCase& c : cases) {
    if (!c.Quantized()) continue;
    std::vector<double> one, block;
    for (int round = 0; round < flags.rounds; ++round) {
      one.push_back(c.Write(true, flags.repeats));
      block.push_back(c.Write(false, flags.repeats));
    }
    std::printf("%-10s %9.0f %9.0f\n", DTypeName(c.dtype()).c_str(), Of(one, false).median, Of(block, false).median);
  }
  return 0;
}

}  // namespace
}  // namespace mha::bench

int main(int argc, char** argv) { return mha::bench::Main(argc, argv); }
