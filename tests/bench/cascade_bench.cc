// Cascade decode on the CPU backend, in process (no gRPC), as ratios measured in one run: a decode step of sessions
// that share a prompt's blocks (forks of one prefilled session, as prefix keys attach them) against the same
// sessions sharing nothing (each its own copy of the prompt), beside the step's roofline: the larger of the bytes it
// must read once (the prompt once, every session's own tokens) over the memory-read probe's median and its FLOPs
// over the FMA peak. Each call's sessions are a copy no other call touched since (copies rotate over at least 4x the
// last-level cache: RotationBytes). Rounds interleave the probe and the cases; best and median are printed.
//   build/bin/cascade_bench [--rounds 3] [--seconds 0.5] [--filter "32x(2048"] (a part of the cases' names)
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cpu/cpu_backend.h"
#include "server/sessions/session_store.h"
#include "tests/bench/bench_util.h"
#include "tests/bench/decode_step.h"
#include "tests/bench/fma_probe.h"
#include "tests/bench/memory_probe.h"

namespace mha::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kBlockTokens = 32;

// `sessions` sessions of `prefix` shared (or copied) tokens and `own` tokens each, bf16, H=32 Hkv=8 d_k=128.
class CascadeCase {
 public:
  CascadeCase(int sessions, int64_t prefix, int64_t own, bool shared)
      : sessions_(sessions), prefix_(prefix), own_(own), shared_(shared) {}

  std::string name() const {
    return absl::StrCat(sessions_, "x(", prefix_, "+", own_, ")", shared_ ? " shared" : " apart");
  }
  double TokenBytes() const { return KvCacheBytes(heads_, 1, v1::BF16, kBlockTokens); }
  // What a step must read at least: the prefix once when shared, and every session's own tokens.
  double BytesOnce() const { return TokenBytes() * ((shared_ ? prefix_ : sessions_ * prefix_) + sessions_ * own_); }
  double Flops() const {
    return 4.0 * sessions_ * (prefix_ + own_ + 1) * heads_.num_heads * heads_.head_dim;  // QK^T and PV
  }

  void Prepare(CpuBackend* backend) {
    backend_ = backend;
    const int64_t evict = RotationBytes();
    copies_ = static_cast<int>(std::max<double>(1, std::ceil(evict / BytesOnce())));
    SessionStoreOptions options;
    options.capacity_bytes = static_cast<int64_t>(copies_ * BytesOnce() * 1.2) + (int64_t{256} << 20);
    options.max_sessions = copies_ * (sessions_ + 1);
    options.max_tokens = prefix_ + own_ + 64;
    options.block_tokens = kBlockTokens;
    store_ = std::make_unique<SessionStore>(options, nullptr);
    const KvCacheLayout layout{heads_.num_kv_heads, heads_.head_dim, kBlockTokens, v1::BF16};
    const std::vector<float> values = Random(layout.BlockElements(), 7);
    block_.assign(layout.BlockBytes(), '\0');
    EncodeFromFloat(v1::BF16, values.data(), values.size(), block_.data());
    SessionConfig config;
    config.heads = heads_;
    config.cache_dtype = v1::BF16;
    for (int copy = 0; copy < copies_; ++copy) {
      const std::string prompt = store_->Create(config, "", {})->session_id();
      Fill(prompt, prefix_);
      for (int s = 0; s < sessions_; ++s) {
        std::string id;
        if (shared_) {
          id = store_->Fork(prompt, "", {})->session_id();
        } else {
          id = store_->Create(config, "", {})->session_id();
          Fill(id, prefix_);
        }
        Fill(id, own_);
        ids_.push_back(id);
      }
      store_->Close(prompt, {}).IgnoreError();  // forks keep its blocks
    }
    q_ = Random(heads_.q_width(), 1);
    kv_ = Random(heads_.kv_width(), 2);
    out_.resize(sessions_ * heads_.q_width());
  }

  // One decode step on the next copy's sessions; its seconds.
  double Call() {
    const int copy = next_++ % copies_;
    return DecodeStep(*backend_, *store_, absl::MakeConstSpan(ids_).subspan(copy * sessions_, sessions_), heads_,
                      {heads_.num_kv_heads, heads_.head_dim, kBlockTokens, v1::BF16}, q_.data(), kv_.data(),
                      out_.data(), name());
  }

 private:
  // Appends n tokens of the same block contents to `id` (written, not computed: what decode reads is the same).
  void Fill(const std::string& id, int64_t n) {
    ExtendReservation r = *store_->Reserve({ReserveItem{id, 0, n, "", {}}});
    const ExtendReservation::Item& item = r.items()[0];
    for (char* block : item.fresh) std::memcpy(block, block_.data(), block_.size());
    r.Commit();
  }

  const int sessions_;
  const int64_t prefix_, own_;
  const bool shared_;
  const HeadSpec heads_ = Heads(32, 8, 128);
  CpuBackend* backend_ = nullptr;
  int copies_ = 1, next_ = 0;
  std::unique_ptr<SessionStore> store_;
  std::vector<std::string> ids_;
  std::string block_;
  std::vector<float> q_, kv_, out_;
};

struct Flags {
  int rounds = 3;
  double seconds = 0.5;
  std::string filter;
};

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--rounds") f.rounds = std::max(1, std::atoi(value.c_str()));
    if (name == "--seconds") f.seconds = std::atof(value.c_str());
    if (name == "--filter") f.filter = value;
  }
  return f;
}

// Calls `c` for about `seconds` (at least 3 calls), appending each call's seconds.
void Time(CascadeCase& c, double seconds, std::vector<double>* times) {
  const auto start = Clock::now();
  for (int k = 0; k < 3 || std::chrono::duration<double>(Clock::now() - start).count() < seconds; ++k) {
    times->push_back(c.Call());
  }
}

int Main(int argc, char** argv) {
  const Flags flags = Parse(argc, argv);
  auto backend = CpuBackend::Create("auto");
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  const int threads = omp_get_max_threads();
  std::vector<CascadeCase> cases;  // pairs: shared, apart
  for (int sessions : {32, 64}) {
    for (int64_t prefix : {2048, 8192}) {
      for (int64_t own : {64, 256}) {
        const CascadeCase probe_name(sessions, prefix, own, true);
        if (!flags.filter.empty() && probe_name.name().find(flags.filter) == std::string::npos) continue;
        cases.emplace_back(sessions, prefix, own, true);
        cases.emplace_back(sessions, prefix, own, false);
      }
    }
  }
  std::printf("threads %d, last-level cache %lld MiB; preparing %zu cases...\n", threads,
              static_cast<long long>(LastLevelCacheBytes() >> 20), cases.size());
  std::vector<std::vector<double>> times(cases.size());
  std::vector<double> probe;
  for (CascadeCase& c : cases) c.Prepare(backend->get());
  for (int round = 0; round < flags.rounds; ++round) {
    probe.push_back(MeasureReadBandwidth(threads, 4).gb_per_s);
    for (size_t i = 0; i < cases.size(); ++i) Time(cases[i], flags.seconds, &times[i]);
  }
  const Stats p = Of(probe, true);
  const PeakResult peak = MeasurePeak(threads, 0.3);
  std::printf("memory-read probe: %.1f GB/s best, %.1f median (%d rounds); fp32 FMA peak %.0f GFLOP/s\n", p.best,
              p.median, flags.rounds, peak.gflops);
  std::printf("%-22s %9s %9s %9s %9s %8s %9s %7s %7s %9s\n", "sessions x (prefix+own)", "shared", "median",
              "apart", "median", "speedup", "roofline", "% roof", "bound", "MB once");
  for (size_t i = 0; i + 1 < cases.size(); i += 2) {
    const Stats shared = Of(times[i], false), apart = Of(times[i + 1], false);
    const double memory_s = cases[i].BytesOnce() / (p.median * 1e9), compute_s = cases[i].Flops() / (peak.gflops * 1e9);
    const double roof = std::max(memory_s, compute_s);
    std::string name = cases[i].name();
    name.resize(name.size() - 7);  // " shared"
    std::printf("%-22s %7.2fms %7.2fms %7.2fms %7.2fms %7.2fx %7.2fms %6.0f%% %7s %9.1f\n", name.c_str(),
                shared.best * 1e3, shared.median * 1e3, apart.best * 1e3, apart.median * 1e3,
                apart.median / shared.median, roof * 1e3, 100 * roof / shared.median,
                memory_s > compute_s ? "memory" : "FMA", cases[i].BytesOnce() / 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace mha::bench

int main(int argc, char** argv) { return mha::bench::Main(argc, argv); }
