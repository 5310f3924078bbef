#include "server/backends/cpu/bf16_matmul.h"

#include <algorithm>
#include <list>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {
namespace cpu {
namespace {

using dt = dnnl::memory::data_type;
using Dims = dnnl::memory::dims;

// Packed weights kept at most (least recently used dropped beyond): the fp32 layer store's default limit halved.
constexpr int64_t kCacheBytes = int64_t{512} << 20;
// A projection runs in slices of rows of about this many FLOPs, polling its StopSignal between them.
constexpr double kSliceFlops = 2e10;

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

dnnl::matmul::primitive_desc Describe(int64_t m, int64_t k, int64_t n, int64_t ldx, bool bias, dt y_type,
                                      int64_t ldy) {
  const dnnl::memory::desc src(Dims{m, k}, dt::bf16, Dims{ldx, 1});
  const dnnl::memory::desc weights(Dims{k, n}, dt::bf16, dnnl::memory::format_tag::any);
  const dnnl::memory::desc dst(Dims{m, n}, y_type, Dims{ldy, 1});
  if (bias) {
    const dnnl::memory::desc b(Dims{1, n}, dt::f32, dnnl::memory::format_tag::ab);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, b, dst), Engine());
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), Engine());
}

// A matmul primitive with its description, for one shape.
struct Primitive {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul matmul;
};

// The primitives of the shapes seen lately, each created once: describing a matmul costs more than a small
// request's projection computes. Bounded: emptied when it reaches kMaxEntries
// (shapes come from requests). Thread-safe; oneDNN primitives may execute on several threads at once.
class PrimitiveCache {
 public:
  static constexpr size_t kMaxEntries = 256;

  std::shared_ptr<const Primitive> Get(int64_t m, int64_t k, int64_t n, int64_t ldx, bool bias, dt y_type,
                                       int64_t ldy) {
    const Key key{m, k, n, ldx, ldy, bias, static_cast<int>(y_type)};
    {
      absl::MutexLock lock(&mu_);
      const auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
    }
    // Created outside the lock; two threads may both create one, and the second insert keeps the first.
    auto made = std::make_shared<Primitive>();
    made->pd = Describe(m, k, n, ldx, bias, y_type, ldy);
    made->matmul = dnnl::matmul(made->pd);
    absl::MutexLock lock(&mu_);
    if (entries_.size() >= kMaxEntries) entries_.clear();
    return entries_.emplace(key, std::move(made)).first->second;
  }

 private:
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, int>;
  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<const Primitive>> entries_ ABSL_GUARDED_BY(mu_);
};

PrimitiveCache& Primitives() {
  static PrimitiveCache* cache = new PrimitiveCache();
  return *cache;
}

// Layer weights packed for a weights layout, least recently used dropped beyond kCacheBytes. A layer's matrices
// are told apart by their address, which is stable for as long as the layer lives; the resident id, never reused,
// keeps a later layer at the same address from matching.
class PackedCache {
 public:
  absl::StatusOr<dnnl::memory> Get(const Bf16Weights& w, int64_t k, int64_t n, const dnnl::memory::desc& packed) {
    const Key key{w.resident_id, w.w, k, n};
    {
      absl::MutexLock lock(&mu_);
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->key == key && it->memory.get_desc() == packed) {
          entries_.splice(entries_.begin(), entries_, it);
          return entries_.front().memory;
        }
      }
    }
    dnnl::memory memory = Pack(w, k, n, packed);
    absl::MutexLock lock(&mu_);
    entries_.push_front({key, memory});
    bytes_ += static_cast<int64_t>(packed.get_size());
    while (bytes_ > kCacheBytes && entries_.size() > 1) {
      bytes_ -= static_cast<int64_t>(entries_.back().memory.get_desc().get_size());
      entries_.pop_back();
    }
    return memory;
  }

  static dnnl::memory Pack(const Bf16Weights& w, int64_t k, int64_t n, const dnnl::memory::desc& packed) {
    const dnnl::memory::desc plain(Dims{k, n}, dt::f32, Dims{w.ld, 1});
    dnnl::memory source(plain, Engine(), const_cast<float*>(w.w));
    dnnl::memory memory(packed, Engine());
    dnnl::stream stream(Engine());
    dnnl::reorder(source, memory).execute(stream, source, memory);
    stream.wait();
    return memory;
  }

  int64_t bytes() {
    absl::MutexLock lock(&mu_);
    return bytes_;
  }

 private:
  using Key = std::tuple<uint64_t, const float*, int64_t, int64_t>;
  struct Entry {
    Key key;
    dnnl::memory memory;
  };
  absl::Mutex mu_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mu_);  // most recently used first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

PackedCache& Cache() {
  static PackedCache* cache = new PackedCache();
  return *cache;
}

std::string FindNativeBf16() {
  try {
    const int isa = static_cast<int>(dnnl::get_effective_cpu_isa());
    const int bf16 = static_cast<int>(dnnl::cpu_isa::avx512_core_bf16);
    if ((isa & bf16) != bf16) return "";
    return Describe(64, 64, 64, 64, false, dt::f32, 64).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

}  // namespace

const std::string& NativeBf16Matmul() {
  static const std::string* impl = new std::string(FindNativeBf16());
  return *impl;
}

absl::Status MatmulBf16(const void* x, int64_t m, int64_t k, int64_t ldx, const Bf16Weights& w, const float* bias,
                        int64_t n, void* y, MatmulOut y_type, int64_t ldy, const StopSignal* stop) {
  if (m == 0 || n == 0) return absl::OkStatus();
  const dt out = y_type == MatmulOut::kBF16 ? dt::bf16 : dt::f32;
  const int64_t out_size = y_type == MatmulOut::kBF16 ? 2 : 4;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
  const int64_t slices = stop == nullptr ? 1 : std::max<int64_t>(1, static_cast<int64_t>(flops / kSliceFlops));
  const int64_t rows = (m + slices - 1) / slices;
  try {
    dnnl::stream stream(Engine());
    dnnl::memory packed;
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      if (stop != nullptr) {
        if (absl::Status status = stop->Check(); !status.ok()) return status;
      }
      const int64_t r = std::min(rows, m - r0);
      const std::shared_ptr<const Primitive> primitive = Primitives().Get(r, k, n, ldx, bias != nullptr, out, ldy);
      const dnnl::matmul::primitive_desc& pd = primitive->pd;
      if (!packed || packed.get_desc() != pd.weights_desc()) {
        if (w.resident_id != 0) {
          absl::StatusOr<dnnl::memory> cached = Cache().Get(w, k, n, pd.weights_desc());
          if (!cached.ok()) return cached.status();
          packed = *cached;
        } else {
          packed = PackedCache::Pack(w, k, n, pd.weights_desc());
        }
      }
      dnnl::memory src(pd.src_desc(), Engine(),
                       const_cast<char*>(static_cast<const char*>(x) + r0 * ldx * 2));
      dnnl::memory dst(pd.dst_desc(), Engine(), static_cast<char*>(y) + r0 * ldy * out_size);
      std::unordered_map<int, dnnl::memory> args = {
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, packed}, {DNNL_ARG_DST, dst}};
      if (bias != nullptr) {
        args[DNNL_ARG_BIAS] = dnnl::memory(pd.bias_desc(), Engine(), const_cast<float*>(bias));
      }
      primitive->matmul.execute(stream, args);
      stream.wait();
    }
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN's bf16 matmul failed in a ", m, "x", k, "x", n,
                                            " projection: ", e.what(), " (dnnl_status_t ",
                                            static_cast<int>(e.status), ")"));
  }
  return absl::OkStatus();
}

int64_t PackedWeightBytes() { return Cache().bytes(); }

}  // namespace cpu
}  // namespace mha
