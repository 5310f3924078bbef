// The KV-cache sessions on the CPU backend, in process (no gRPC), as ratios measured in one run:
//  - decode steps (one new token per session) against the memory-read probe: K/V bytes the attention read per
//    second, each call on sessions whose caches no other call touched since (the working set rotates over several
//    copies, 4x the last-level cache: RotationBytes, as a server with many sessions sees it);
//  - prefill chunks through Extend (paged attention) against the same stateless causal call.
// Rounds interleave the probe and every case (this VM's neighbours move its bandwidth); best and median are printed.
//   build/bin/decode_bench [--rounds 3] [--seconds 0.5] [--filter decode_1x8192] [--warm] [--json results.jsonl]
//                          [--isa avx2] [--block_tokens 32]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/cpu_backend.h"
#include "server/backends/quantized_cache.h"
#include "server/sessions/session_store.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/decode_step.h"
#include "tests/bench/fma_probe.h"
#include "tests/bench/memory_probe.h"

namespace mha::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Decode steps of `sessions` head sessions whose caches hold `length` tokens, H/Hkv/d_k, cache dtype.
class DecodeCase {
 public:
  DecodeCase(std::string name, int sessions, int64_t length, HeadSpec heads, v1::DataType dtype,
             int64_t block_tokens = 32)
      : name_(std::move(name)), sessions_(sessions), length_(length), heads_(heads), dtype_(dtype),
        block_tokens_(block_tokens) {}

  const std::string& name() const { return name_; }
  v1::DataType dtype() const { return dtype_; }
  int sessions() const { return sessions_; }
  // Multiply-adds per call: every cached element (keys and values) against each of its group's H / Hkv query rows.
  double MacsPerCall() const {
    return static_cast<double>(sessions_) * (length_ + 1) * 2 * heads_.head_dim * heads_.num_heads;
  }
  int64_t BytesPerCall() const {
    return sessions_ * static_cast<int64_t>(KvCacheBytes(heads_, length_ + 1, dtype_, block_tokens_));
  }

  // Sessions in `copies` groups, caches filled with `length` tokens of random keys and values (written, not
  // computed: what decode reads is the same either way).
  void Prepare(CpuBackend* backend, bool warm) {
    backend_ = backend;
    const int64_t evict = RotationBytes();
    copies_ = static_cast<int>(std::max<int64_t>(1, (evict + BytesPerCall() - 1) / BytesPerCall()));
    if (warm) copies_ = 1;
    SessionStoreOptions options;
    options.capacity_bytes = (copies_ * BytesPerCall() * 11 / 10) + (int64_t{64} << 20);
    options.max_sessions = copies_ * sessions_;
    options.max_tokens = length_ + (1 << 20);
    options.block_tokens = block_tokens_;
    store_ = std::make_unique<SessionStore>(options, nullptr);
    SessionConfig config;
    config.heads = heads_;
    config.cache_dtype = dtype_;
    const KvCacheLayout layout{heads_.num_kv_heads, heads_.head_dim, options.block_tokens, dtype_};
    const std::vector<float> values = Random(layout.BlockElements(), 7);
    std::string block_bytes(layout.BlockBytes(), '\0');
    if (layout.Quantized()) {  // a whole block of tokens per KV head, quantized as the server writes them
      const int64_t dk = heads_.head_dim;
      for (int64_t g = 0; g < heads_.num_kv_heads; ++g) {
        const float* k = values.data() + g * 2 * dk * block_tokens_;
        quant::WriteTokens(layout, block_bytes.data(), g, 0, block_tokens_, k, dk, k + dk * block_tokens_, dk);
      }
    } else {
      EncodeFromFloat(dtype_, values.data(), values.size(), block_bytes.data());
    }
    for (int i = 0; i < copies_ * sessions_; ++i) {
      ids_.push_back(store_->Create(config, "", {})->session_id());
      ExtendReservation r = *store_->Reserve({ReserveItem{ids_.back(), 0, length_, "", {}}});
      for (char* block : r.items()[0].blocks) std::memcpy(block, block_bytes.data(), block_bytes.size());
      r.Commit();
    }
    q_ = Random(heads_.q_width(), 1);
    kv_ = Random(heads_.kv_width(), 2);
    out_.resize(sessions_ * heads_.q_width());
  }

  // One call on the next copy's sessions; its seconds.
  double Call() {
    const int copy = next_++ % copies_;
    return DecodeStep(*backend_, *store_, absl::MakeConstSpan(ids_).subspan(copy * sessions_, sessions_), heads_,
                      {heads_.num_kv_heads, heads_.head_dim, block_tokens_, dtype_}, q_.data(), kv_.data(),
                      out_.data(), name_);
  }

  int copies() const { return copies_; }

 private:
  const std::string name_;
  const int sessions_;
  const int64_t length_;
  const HeadSpec heads_;
  const v1::DataType dtype_;
  const int64_t block_tokens_;
  CpuBackend* backend_ = nullptr;
  int copies_ = 1;
  int next_ = 0;
  std::unique_ptr<SessionStore> store_;
  std::vector<std::string> ids_;
  std::vector<float> q_, kv_, out_;
};

// n new tokens through Extend onto a cache of `cached` tokens (in calls of `chunk` tokens; 0: one call), and the
// stateless causal call over the same n queries and cached + n keys: ScaledDotProductAttention for a head session,
// its q, k and v in the cache's dtype (the bf16 tile kernels take a bf16 call); for a layer session (`layer`,
// d_model = H d_k, random weights, fp32 cache), MultiHeadAttention, which projects every key again where Extend
// projects only the new ones. The cached tokens are written into the blocks, not computed (what the timed calls
// read is the same either way), so a 32K-token history costs its bytes only.
class PrefillCase {
 public:
  PrefillCase(std::string name, int64_t n, int64_t cached, HeadSpec heads, v1::DataType dtype = v1::FP32,
              int64_t chunk = 0, bool layer = false)
      : name_(std::move(name)), n_(n), cached_(cached), chunk_(chunk > 0 ? chunk : n), heads_(heads), dtype_(dtype),
        layer_(layer) {}
  const std::string& name() const { return name_; }

  void Prepare(CpuBackend* backend) {
    backend_ = backend;
    SessionStoreOptions options;
    options.capacity_bytes = KvCacheBytes(heads_, cached_ + n_, DTypeSize(dtype_)) * 3 + (int64_t{64} << 20);
    options.max_tokens = 1 << 20;
    store_ = std::make_unique<SessionStore>(options, nullptr);
    const int64_t T = cached_ + n_;
    q_ = Random(T * heads_.q_width(), 3);
    k_ = Random(T * heads_.kv_width(), 4);
    v_ = Random(T * heads_.kv_width(), 5);
    for (const std::vector<float>* from : {&q_, &k_, &v_}) {
      wire_.emplace_back(from->size() * DTypeSize(dtype_), '\0');
      EncodeFromFloat(dtype_, from->data(), from->size(), wire_.back().data());
    }
    out_.resize(T * heads_.q_width());
    const KvCacheLayout layout{heads_.num_kv_heads, heads_.head_dim, options.block_tokens, dtype_};
    const std::vector<float> values = Random(layout.BlockElements(), 7);
    block_bytes_.assign(layout.BlockBytes(), '\0');
    EncodeFromFloat(dtype_, values.data(), values.size(), block_bytes_.data());
    if (layer_) {
      const int64_t d = heads_.q_width();
      x_ = Random(T * d, 6);
      w_q_ = Random(d * d, 8);
      w_k_ = Random(d * heads_.kv_width(), 9);
      w_v_ = Random(d * heads_.kv_width(), 10);
      w_o_ = Random(d * d, 11);
      for (std::vector<float>* w : {&w_q_, &w_k_, &w_v_, &w_o_}) {
        for (float& value : *w) value *= 1.0f / std::sqrt(static_cast<float>(d));
      }
    }
  }

  // A fresh session holding `cached` tokens, then the timed Extends of n more: the sum of the calls' times.
  double Extend() {
    SessionConfig config;
    config.heads = heads_;
    config.cache_dtype = dtype_;
    const std::string id = store_->Create(config, "", {})->session_id();
    if (cached_ > 0) {
      ExtendReservation r = *store_->Reserve({ReserveItem{id, 0, cached_, "", {}}});
      for (char* block : r.items()[0].blocks) std::memcpy(block, block_bytes_.data(), block_bytes_.size());
      r.Commit();
    }
    double seconds = 0;
    for (int64_t first = cached_; first < cached_ + n_; first += chunk_) {
      seconds += Run(id, first, std::min(chunk_, cached_ + n_ - first));
    }
    store_->Close(id, {}).IgnoreError();
    return seconds;
  }

  double Stateless() { return layer_ ? StatelessLayer() : StatelessHeads(); }

  double Flops() const { return ExtendFlops(heads_, layer_ ? heads_.q_width() : 0, cached_, n_, true); }

 private:
  LayerWeights Weights() const {
    LayerWeights w;
    w.w_q = w_q_.data();
    w.w_k = w_k_.data();
    w.w_v = w_v_.data();
    w.w_o = w_o_.data();
    w.ld_q = heads_.q_width();
    w.ld_k = w.ld_v = heads_.kv_width();
    return w;
  }

  double StatelessLayer() {
    MhaArgs a;
    a.shape.batch = 1;
    a.shape.q_len = n_;
    a.shape.kv_len = cached_ + n_;
    a.shape.d_model = a.shape.d_kv_in = a.shape.d_v_in = heads_.q_width();
    a.shape.heads = heads_;
    a.weights = Weights();
    a.kv_source = cached_ == 0 ? KvSource::kQuery : KvSource::kKey;
    a.query = {x_.data() + cached_ * heads_.q_width(), v1::FP32};
    a.key = a.value = {x_.data(), v1::FP32};
    a.out = {out_.data(), v1::FP32};
    const auto start = Clock::now();
    const absl::Status status = backend_->MultiHeadAttention(a);
    ExitUnlessOk(status, name_);
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  double StatelessHeads() {
    const int64_t element = static_cast<int64_t>(DTypeSize(dtype_));
    SdpaArgs a;
    a.shape.batch = 1;
    a.shape.q_len = n_;
    a.shape.kv_len = cached_ + n_;
    a.shape.heads = heads_;
    a.q = {wire_[0].data() + cached_ * heads_.q_width() * element, dtype_};
    a.k = {wire_[1].data(), dtype_};
    a.v = {wire_[2].data(), dtype_};
    a.out = {out_.data(), v1::FP32};
    const auto start = Clock::now();
    const absl::Status status = backend_->ScaledDotProductAttention(a);
    ExitUnlessOk(status, name_);
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  double Run(const std::string& id, int64_t first, int64_t n) {
    ExtendReservation r = *store_->Reserve({ReserveItem{id, 0, n, "", {}}});
    PagedSequence seq;
    seq.blocks = r.items()[0].blocks;
    seq.length = first;
    seq.new_tokens = n;
    if (layer_) {
      seq.x = {x_.data() + first * heads_.q_width(), v1::FP32};
    } else {
      seq.q = {q_.data() + first * heads_.q_width(), v1::FP32};
      seq.k = {k_.data() + first * heads_.kv_width(), v1::FP32};
      seq.v = {v_.data() + first * heads_.kv_width(), v1::FP32};
    }
    seq.out = {out_.data(), v1::FP32};
    PagedArgs args;
    args.problem.heads = heads_;
    if (layer_) {
      args.problem.d_model = heads_.q_width();
      args.weights = Weights();
    }
    args.problem.cache = {heads_.num_kv_heads, heads_.head_dim, store_->options().block_tokens, dtype_};
    args.problem.sequences = 1;
    args.problem.new_tokens = args.problem.max_new_tokens = n;
    args.problem.max_length = first + n;
    args.sequences = {&seq, 1};
    const auto start = Clock::now();
    const absl::Status status = backend_->PagedAttention(args);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    ExitUnlessOk(status, name_);
    r.Commit();
    return seconds;
  }

  const std::string name_;
  const int64_t n_, cached_, chunk_;
  const HeadSpec heads_;
  const v1::DataType dtype_;
  const bool layer_;
  CpuBackend* backend_ = nullptr;
  std::unique_ptr<SessionStore> store_;
  std::vector<float> q_, k_, v_, out_;
  std::vector<std::string> wire_;  // q, k, v in the cache's dtype, for the stateless call
  std::string block_bytes_;        // a block of random keys and values in the cache's dtype
  std::vector<float> x_, w_q_, w_k_, w_v_, w_o_;  // a layer's input and weights
};

struct Flags {
  int rounds = 3;
  double seconds = 0.5;  // per case and round
  std::string filter;
  // Every decode call on the same sessions, whose caches then stay in the CPU's caches: the kernels' compute
  // ceiling rather than the memory's.
  bool warm = false;
  std::string json_out;  // also write the results here as JSON lines
  std::string isa = "auto";  // the CPU backend's kernel set (tile_kernels.h): avx2, avx512, ... as this CPU runs
  // The caches' block size (the server's --kv_block_tokens) for every case but the block_* ones, which set theirs.
  int64_t block_tokens = 32;
};

Flags Parse(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--warm") flags.warm = true;
  }
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--rounds") flags.rounds = std::atoi(argv[i + 1]);
    if (name == "--seconds") flags.seconds = std::atof(argv[i + 1]);
    if (name == "--filter") flags.filter = argv[i + 1];
    if (name == "--json") flags.json_out = argv[i + 1];
    if (name == "--isa") flags.isa = argv[i + 1];
    if (name == "--block_tokens") flags.block_tokens = std::atoll(argv[i + 1]);
  }
  return flags;
}

// The results as JSON lines (tests/bench/decode_compare.py reads them).
void WriteJson(const std::string& path, const Stats& probe, const std::vector<DecodeCase>& decodes,
               const std::vector<std::vector<double>>& rates, const std::vector<PrefillCase>& prefills,
               const std::vector<std::vector<double>>& extend_s, const std::vector<std::vector<double>>& stateless_s) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return;
  std::fprintf(f, "{\"probe_gbps\": %.3f, \"probe_gbps_median\": %.3f}\n", probe.best, probe.median);
  for (size_t i = 0; i < decodes.size(); ++i) {
    if (rates[i].empty()) continue;
    const Stats s = Of(rates[i], true);
    std::fprintf(f, "{\"case\": \"%s\", \"gbps\": %.3f, \"gbps_median\": %.3f}\n", decodes[i].name().c_str(),
                 s.best, s.median);
  }
  for (size_t i = 0; i < prefills.size(); ++i) {
    if (extend_s[i].empty()) continue;
    const Stats e = Of(extend_s[i], false), st = Of(stateless_s[i], false);
    std::fprintf(f, "{\"case\": \"%s\", \"extend_ms\": %.3f, \"extend_ms_median\": %.3f, \"stateless_ms\": %.3f, "
                 "\"stateless_ms_median\": %.3f}\n", prefills[i].name().c_str(), e.best * 1e3, e.median * 1e3,
                 st.best * 1e3, st.median * 1e3);
  }
  std::fclose(f);
}

std::vector<DecodeCase> DecodeCases(int64_t tb) {
  std::vector<DecodeCase> decodes;
  decodes.reserve(32);
  decodes.emplace_back("decode_1x8192_bf16", 1, 8191, Heads(32, 8, 128), v1::BF16, tb);
  decodes.emplace_back("decode_1x8192_fp32", 1, 8191, Heads(32, 8, 128), v1::FP32, tb);
  decodes.emplace_back("decode_32x1024_bf16", 32, 1023, Heads(32, 8, 128), v1::BF16, tb);
  decodes.emplace_back("decode_32x1024_fp32", 32, 1023, Heads(32, 8, 128), v1::FP32, tb);
  decodes.emplace_back("decode_32x2048_bf16", 32, 2047, Heads(32, 8, 128), v1::BF16, tb);
  decodes.emplace_back("decode_32x2048_fp32", 32, 2047, Heads(32, 8, 128), v1::FP32, tb);
  // fp16 caches, as llama.cpp's CPU flash attention decodes by default.
  decodes.emplace_back("decode_1x8192_fp16", 1, 8191, Heads(32, 8, 128), v1::FP16, tb);
  decodes.emplace_back("decode_32x1024_fp16", 32, 1023, Heads(32, 8, 128), v1::FP16, tb);
  decodes.emplace_back("decode_32x2048_fp16", 32, 2047, Heads(32, 8, 128), v1::FP16, tb);
  // 8-bit caches (a byte per element plus bf16 scales): against bf16 at the same shapes, and a 16K context.
  for (v1::DataType dtype : {v1::INT8, v1::FP8_E4M3}) {
    decodes.emplace_back(absl::StrCat("decode_1x8192_", DTypeName(dtype)), 1, 8191, Heads(32, 8, 128), dtype, tb);
    decodes.emplace_back(absl::StrCat("decode_32x2048_", DTypeName(dtype)), 32, 2047, Heads(32, 8, 128), dtype, tb);
  }
  for (v1::DataType dtype : {v1::BF16, v1::INT8, v1::FP8_E4M3}) {
    decodes.emplace_back(absl::StrCat("decode_1x16384_", DTypeName(dtype)), 1, 16383, Heads(32, 8, 128), dtype,
                         tb);
  }
  // Caches that stay in a 32 MiB L3 under --warm (8 and 16 MiB): the kernels' ceiling on CPUs whose last level is
  // that small (one Zen 4 or 5 CCD).
  decodes.emplace_back("decode_1x2048_bf16", 1, 2047, Heads(32, 8, 128), v1::BF16, tb);
  decodes.emplace_back("decode_1x2048_fp32", 1, 2047, Heads(32, 8, 128), v1::FP32, tb);
  decodes.emplace_back("decode_1x2048_int8", 1, 2047, Heads(32, 8, 128), v1::INT8, tb);
  decodes.emplace_back("decode_1x2048_fp8_e4m3", 1, 2047, Heads(32, 8, 128), v1::FP8_E4M3, tb);
  // The block size (--kv_block_tokens): the layout's one free parameter (an 8-bit cache's key scales cover a block).
  for (int64_t b : {16, 64, 128}) {
    decodes.emplace_back(absl::StrCat("decode_1x8192_bf16_block", b), 1, 8191, Heads(32, 8, 128), v1::BF16, b);
    decodes.emplace_back(absl::StrCat("decode_1x8192_fp32_block", b), 1, 8191, Heads(32, 8, 128), v1::FP32, b);
    if (b > 32) {
      decodes.emplace_back(absl::StrCat("decode_1x8192_int8_block", b), 1, 8191, Heads(32, 8, 128), v1::INT8, b);
    }
  }
  return decodes;
}

// The roofline's compute side, one per cache dtype the run decodes: one session of about 16 MiB (2048 to 8192
// tokens), the same one every call, so that it stays in a 32 MiB L3 and its rate is what the kernels compute when
// memory is not what waits. (At 2048 tokens the 8-bit calls are short enough, 0.2 ms, that their rate scatters by
// 1.7x between calls; a smaller session's call is as much the thread pool's as the kernels'. Where the last-level
// cache is smaller, PrintRoofline says so.)
std::vector<DecodeCase> CeilingCases(const std::vector<DecodeCase>& decodes, const std::vector<bool>& wanted,
                                     int64_t tb) {
  std::vector<DecodeCase> ceilings;
  ceilings.reserve(8);
  for (size_t i = 0; i < decodes.size(); ++i) {
    const v1::DataType dtype = decodes[i].dtype();
    const bool have = std::any_of(ceilings.begin(), ceilings.end(), [&](const DecodeCase& c) {
      return c.dtype() == dtype;
    });
    if (wanted[i] && !have) {
      const HeadSpec heads = Heads(32, 8, 128);
      const double per_token = KvCacheBytes(heads, 1024, dtype, tb) / 1024;
      const int64_t tokens = std::clamp<int64_t>(static_cast<int64_t>((16 << 20) / per_token) / 1024 * 1024, 2048,
                                                 8192);
      ceilings.emplace_back(absl::StrCat("ceiling_", DTypeName(dtype)), 1, tokens - 1, heads, dtype, tb);
    }
  }
  return ceilings;
}

std::vector<PrefillCase> PrefillCases() {
  std::vector<PrefillCase> prefills;
  prefills.reserve(32);
  prefills.emplace_back("prefill_512_empty", 512, 0, Heads(32, 8, 128));
  prefills.emplace_back("prefill_512_after_3584", 512, 3584, Heads(32, 8, 128));
  prefills.emplace_back("prefill_512_layer_empty", 512, 0, Heads(32, 8, 128), v1::FP32, 0, true);
  // A 2K-token prompt whole and in chunks (Extend calls of that many tokens, as --max_prefill_chunk makes them).
  for (v1::DataType dtype : {v1::FP32, v1::BF16, v1::FP16}) {
    for (int64_t chunk : {0, 512, 128, 64}) {
      if (dtype == v1::FP16 && (chunk == 512 || chunk == 128)) continue;
      prefills.emplace_back(absl::StrCat("prefill_2048_", DTypeName(dtype), chunk == 0 ? "_whole" : "_chunk",
                                         chunk == 0 ? "" : std::to_string(chunk)),
                            2048, 0, Heads(32, 8, 128), dtype, chunk);
    }
  }
  // A chunk deep into a long context.
  for (v1::DataType dtype : {v1::FP32, v1::BF16, v1::FP16}) {
    prefills.emplace_back(absl::StrCat("prefill_128_after_32K_", DTypeName(dtype)), 128, 32768 - 128,
                          Heads(32, 8, 128), dtype);
  }
  prefills.emplace_back("prefill_64_after_32K_bf16", 64, 32768 - 64, Heads(32, 8, 128), v1::BF16);
  return prefills;
}

// Calls `c` for about `seconds`, appending each call's GB/s.
void TimeDecode(DecodeCase& c, double seconds, std::vector<double>* rates) {
  c.Call();  // warm: scratch, thread pool
  for (const auto until = Clock::now() + std::chrono::duration<double>(seconds); Clock::now() < until;) {
    rates->push_back(c.BytesPerCall() / c.Call() / 1e9);
  }
}

void PrintDecodes(const Stats& p, const std::vector<DecodeCase>& decodes,
                  const std::vector<std::vector<double>>& rates) {
  std::printf("%-24s %10s %7s %10s %10s %9s %9s\n", "decode (H=32 Hkv=8 dk=128)", "KV MiB", "copies", "GB/s best",
              "GB/s med", "%probe", "%probe md");
  for (size_t i = 0; i < decodes.size(); ++i) {
    if (rates[i].empty()) continue;
    const Stats s = Of(rates[i], true);
    std::printf("%-24s %10.1f %7d %10.1f %10.1f %8.0f%% %8.0f%%\n", decodes[i].name().c_str(),
                decodes[i].BytesPerCall() / 1048576.0, decodes[i].copies(), s.best, s.median, 100 * s.best / p.best,
                100 * s.median / p.median);
  }
}

// Each case's median against its roofline: min(the memory-read probe's median, its dtype's best rate from cache:
// what the kernels can compute, which this VM's neighbours only ever slow down). A case whose ceiling is under the
// probe is bound by arithmetic; the ceiling's multiply-adds per second say how hard: against the fp32 FMA peak's
// (%FMA), and against the peak of the dot-product instruction the dtype's kernels multiply with where the CPU has
// it (%dot: vdpbf16ps for bf16 and FP8, vpdpbusd for INT8; "-" otherwise). Tokens per second against the bf16
// cache's at the same shape: what a smaller cache buys.
void PrintRoofline(const Stats& p, const PeakResult& peak, const DotPeaks& dots, const std::vector<DecodeCase>& decodes,
                   const std::vector<std::vector<double>>& rates, const std::vector<DecodeCase>& ceilings,
                   const std::vector<std::vector<double>>& ceiling_rates) {
  std::printf("%-10s %8s %12s %11s %8s %8s %8s\n", "ceiling", "KV MiB", "GB/s best", "GB/s med", "GMAC/s", "%FMA",
              "%dot");
  bool larger = false;
  for (size_t c = 0; c < ceilings.size(); ++c) {
    const Stats s = Of(ceiling_rates[c], true);
    const double gmacs = s.median * ceilings[c].MacsPerCall() / ceilings[c].BytesPerCall();
    const v1::DataType dtype = ceilings[c].dtype();
    const double dot = dtype == v1::INT8                                                  ? dots.int8_gmacs
                       : dtype == v1::BF16 || dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2 ? dots.bf16_gmacs
                                                                                           : 0;
    const std::string dot_share = dot > 0 ? absl::StrFormat("%.0f%%", 100 * gmacs / dot) : "-";
    std::printf("%-10s %8.1f %12.1f %11.1f %8.0f %7.0f%% %8s\n", DTypeName(dtype).c_str(),
                ceilings[c].BytesPerCall() / 1048576.0, s.best, s.median, gmacs, 100 * 2 * gmacs / peak.gflops,
                dot_share.c_str());
    larger = larger || ceilings[c].BytesPerCall() > LastLevelCacheBytes();
  }
  if (larger) {
    std::printf("(the ceilings' sessions exceed the %lld MiB last-level cache: they read from memory, so each is a "
                "lower bound on its kernels' rate)\n",
                static_cast<long long>(LastLevelCacheBytes() >> 20));
  }
  std::printf("%-24s %12s %8s %10s %11s %10s\n", "decode against roofline", "tokens/s md", "x bf16", "roof GB/s",
              "bound by", "%roof md");
  const auto median_seconds = [&](size_t i) { return decodes[i].BytesPerCall() / (Of(rates[i], true).median * 1e9); };
  for (size_t i = 0; i < decodes.size(); ++i) {
    if (rates[i].empty()) continue;
    const std::string& name = decodes[i].name();
    const std::string dtype = DTypeName(decodes[i].dtype());  // "decode_1x8192_" of "decode_1x8192_fp8_e4m3"
    const std::string shape = absl::EndsWith(name, dtype) ? name.substr(0, name.size() - dtype.size()) : "";
    double ceiling = 0, bf16_tokens = 0;
    for (size_t c = 0; c < ceilings.size(); ++c) {
      if (ceilings[c].dtype() == decodes[i].dtype()) ceiling = Of(ceiling_rates[c], true).best;
    }
    for (size_t b = 0; b < decodes.size(); ++b) {
      if (rates[b].empty() || decodes[b].name() != shape + "bf16") continue;
      bf16_tokens = decodes[b].sessions() / median_seconds(b);
    }
    const double tokens = decodes[i].sessions() / median_seconds(i), roof = std::min(p.median, ceiling);
    char versus[16] = "-";
    if (bf16_tokens > 0) std::snprintf(versus, sizeof(versus), "%.2f", tokens / bf16_tokens);
    std::printf("%-24s %12.0f %8s %10.1f %11s %9.0f%%\n", decodes[i].name().c_str(), tokens, versus, roof,
                ceiling < p.median ? "arithmetic" : "memory", 100 * Of(rates[i], true).median / roof);
  }
}

void PrintPrefills(const PeakResult& peak, const std::vector<PrefillCase>& prefills,
                   const std::vector<std::vector<double>>& extend_s,
                   const std::vector<std::vector<double>>& stateless_s) {
  std::printf("%-28s %10s %10s %10s %10s %7s %7s %8s %7s %7s\n", "prefill (H=32 Hkv=8 dk=128)", "Extend ms", "med",
              "SDPA ms", "med", "ratio", "md", "GFLOP/s", "%peak", "SDPA%");
  for (size_t i = 0; i < prefills.size(); ++i) {
    if (extend_s[i].empty()) continue;
    const Stats e = Of(extend_s[i], false), st = Of(stateless_s[i], false);
    const double rate = prefills[i].Flops() / e.best / 1e9, stateless = prefills[i].Flops() / st.best / 1e9;
    std::printf("%-28s %10.2f %10.2f %10.2f %10.2f %7.2f %7.2f %8.0f %6.0f%% %6.0f%%\n", prefills[i].name().c_str(),
                e.best * 1e3, e.median * 1e3, st.best * 1e3, st.median * 1e3, st.best / e.best, st.median / e.median,
                rate, 100 * rate / peak.gflops, 100 * stateless / peak.gflops);
  }
}

int Main(int argc, char** argv) {
  const Flags flags = Parse(argc, argv);
  auto backend = CpuBackend::Create(flags.isa);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  if (flags.block_tokens < 1 || flags.block_tokens > 1024) {
    std::fprintf(stderr, "--block_tokens: %lld is not in [1, 1024]\n", static_cast<long long>(flags.block_tokens));
    return 1;
  }
  const int threads = omp_get_max_threads();
  std::vector<DecodeCase> decodes = DecodeCases(flags.block_tokens);
  std::vector<PrefillCase> prefills = PrefillCases();
  const auto wanted = [&](const std::string& name) {
    return flags.filter.empty() || name.find(flags.filter) != std::string::npos;
  };
  std::vector<bool> decode_wanted;
  for (const DecodeCase& c : decodes) decode_wanted.push_back(wanted(c.name()));
  std::vector<DecodeCase> ceilings = CeilingCases(decodes, decode_wanted, flags.block_tokens);
  std::printf("threads %d, last-level cache %lld MiB, blocks of %lld tokens; preparing caches...\n", threads,
              static_cast<long long>(LastLevelCacheBytes() >> 20), static_cast<long long>(flags.block_tokens));
  for (size_t i = 0; i < decodes.size(); ++i) {
    if (decode_wanted[i]) decodes[i].Prepare(backend->get(), flags.warm);
  }
  for (DecodeCase& c : ceilings) c.Prepare(backend->get(), true);
  for (PrefillCase& c : prefills) {
    if (wanted(c.name())) c.Prepare(backend->get());
  }
  std::vector<double> probe;
  std::vector<std::vector<double>> decode_rates(decodes.size()), ceiling_rates(ceilings.size()),
      extend_s(prefills.size()), stateless_s(prefills.size());
  for (int round = 0; round < flags.rounds; ++round) {
    probe.push_back(MeasureReadBandwidth(threads, 4).gb_per_s);
    for (size_t i = 0; i < decodes.size(); ++i) {
      if (decode_wanted[i]) TimeDecode(decodes[i], flags.seconds, &decode_rates[i]);
    }
    for (size_t c = 0; c < ceilings.size(); ++c) TimeDecode(ceilings[c], flags.seconds / 2, &ceiling_rates[c]);
    for (size_t i = 0; i < prefills.size(); ++i) {
      if (!wanted(prefills[i].name())) continue;
      prefills[i].Stateless();
      prefills[i].Extend();
      for (int k = 0; k < 3; ++k) {  // interleaved, so that both see the same neighbours
        stateless_s[i].push_back(prefills[i].Stateless());
        extend_s[i].push_back(prefills[i].Extend());
      }
    }
  }
  const Stats p = Of(probe, true);
  const PeakResult peak = MeasurePeak(threads, 0.3);
  const DotPeaks dots = MeasureDotPeaks(threads, 0.3);
  std::printf("memory-read probe: %.1f GB/s best, %.1f median (%d rounds); fp32 FMA peak %.0f GFLOP/s; "
              "vdpbf16ps %.0f, vpdpbusd %.0f GMAC/s (0: not on this CPU)\n",
              p.best, p.median, flags.rounds, peak.gflops, dots.bf16_gmacs, dots.int8_gmacs);
  PrintDecodes(p, decodes, decode_rates);
  if (!ceilings.empty()) PrintRoofline(p, peak, dots, decodes, decode_rates, ceilings, ceiling_rates);
  if (!flags.json_out.empty()) WriteJson(flags.json_out, p, decodes, decode_rates, prefills, extend_s, stateless_s);
  PrintPrefills(peak, prefills, extend_s, stateless_s);
  return 0;
}

}  // namespace
}  // namespace mha::bench

int main(int argc, char** argv) { return mha::bench::Main(argc, argv); }
