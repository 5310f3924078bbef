#include "server/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace mha {
namespace {

using dnnl::memory;

memory::desc ToDesc(const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) {
  return memory::desc(memory::dims(dims.begin(), dims.end()), memory::data_type::f32,
                      memory::dims(strides.begin(), strides.end()));
}

void AppendKey(std::vector<int64_t>* key, const std::vector<int64_t>& values) {
  key->push_back(static_cast<int64_t>(values.size()));
  key->insert(key->end(), values.begin(), values.end());
}

// Keeps the primitive caches from growing without bound when many shapes pass through.
constexpr size_t kMaxCachedPrimitives = 512;

absl::Status FromDnnlError(const dnnl::error& e, absl::string_view what) {
  return absl::InternalError(absl::StrCat("oneDNN failed in ", what, ": ", e.what(), " (status ",
                                          static_cast<int>(e.status), ")"));
}

std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return "unknown CPU";
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create() {
  try {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(engine), std::move(stream)));
  } catch (const dnnl::error& e) {
    return absl::UnavailableError(absl::StrCat("oneDNN CPU engine: ", e.what()));
  }
}

CpuBackend::CpuBackend(dnnl::engine engine, dnnl::stream stream)
    : engine_(std::move(engine)), stream_(std::move(stream)) {}

std::string CpuBackend::device() const {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(CpuModelName(), " (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ",
                      omp_get_max_threads(), " OpenMP threads)");
}

void CpuBackend::RunMatmul(const Layout& src, const float* src_data, const Layout& weights,
                           const float* weights_data, const float* bias_data, const Layout& dst, float* dst_data,
                           float output_scale) {
  const int64_t n = dst.dims.back();
  const int64_t rank = static_cast<int64_t>(dst.dims.size());
  std::vector<int64_t> key;
  for (const Layout* l : {&src, &weights, &dst}) {
    AppendKey(&key, l->dims);
    AppendKey(&key, l->strides);
  }
  key.push_back(bias_data != nullptr);
  int32_t scale_bits;
  std::memcpy(&scale_bits, &output_scale, 4);
  key.push_back(scale_bits);

  // Bias broadcasts over every dim but the last: [1, ..., 1, n].
  std::vector<int64_t> bias_dims(rank, 1), bias_strides(rank, n);
  bias_dims.back() = n;
  bias_strides.back() = 1;
  const memory::desc bias_md = bias_data ? ToDesc(bias_dims, bias_strides) : memory::desc();

  auto it = matmuls_.find(key);
  if (it == matmuls_.end()) {
    if (matmuls_.size() >= kMaxCachedPrimitives) matmuls_.clear();
    dnnl::primitive_attr attr;
    if (output_scale != 1.0f) attr.set_output_scales(0, {output_scale});
    dnnl::matmul::primitive_desc pd(
        dnnl::matmul::desc(ToDesc(src.dims, src.strides), ToDesc(weights.dims, weights.strides), bias_md,
                           ToDesc(dst.dims, dst.strides)),
        attr, engine_);
    it = matmuls_.emplace(std::move(key), dnnl::matmul(pd)).first;
  }
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, memory(ToDesc(src.dims, src.strides), engine_, const_cast<float*>(src_data))},
      {DNNL_ARG_WEIGHTS, memory(ToDesc(weights.dims, weights.strides), engine_, const_cast<float*>(weights_data))},
      {DNNL_ARG_DST, memory(ToDesc(dst.dims, dst.strides), engine_, dst_data)}};
  if (bias_data) args.emplace(DNNL_ARG_BIAS, memory(bias_md, engine_, const_cast<float*>(bias_data)));
  it->second.execute(stream_, args);
  stream_.wait();
}

void CpuBackend::RunSoftmax(int64_t rows, int64_t cols, float* data) {
  const std::vector<int64_t> key = {rows, cols};
  const memory::desc md = ToDesc(key, {cols, 1});
  auto it = softmaxes_.find(key);
  if (it == softmaxes_.end()) {
    if (softmaxes_.size() >= kMaxCachedPrimitives) softmaxes_.clear();
    dnnl::softmax_forward::primitive_desc pd(
        dnnl::softmax_forward::desc(dnnl::prop_kind::forward_inference, md, 1), engine_);
    it = softmaxes_.emplace(key, dnnl::softmax_forward(pd)).first;
  }
  memory mem(md, engine_, data);
  it->second.execute(stream_, {{DNNL_ARG_SRC, mem}, {DNNL_ARG_DST, mem}});
  stream_.wait();
}

void CpuBackend::Linear(const float* x, int64_t m, int64_t k, int64_t ldx, const float* w, const float* bias,
                        int64_t n, float* y, int64_t ldy) {
  RunMatmul({{m, k}, {ldx, 1}}, x, {{k, n}, {n, 1}}, w, bias, {{m, n}, {ldy, 1}}, y, 1.0f);
}

void CpuBackend::Attend(const AttentionDims& d, const AttentionMask& mask, Packed q, Packed k, Packed v,
                        float* out, int64_t out_stride, float* weights) {
  const int64_t B = d.batch, Tq = d.q_len, Tk = d.kv_len, H = d.num_heads, Hkv = d.num_kv_heads,
                G = d.group_size(), dk = d.head_dim;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // Tile: whole sequences for a chunk of batch items when they fit, else blocks of query rows of one item.
  const int64_t row_bytes = H * Tk * static_cast<int64_t>(sizeof(float));  // one query row, all heads
  int64_t batch_chunk = 1, q_block = Tq;
  if (row_bytes * Tq <= kScoreTileBytes) {
    batch_chunk = std::min(B, std::max<int64_t>(1, kScoreTileBytes / (row_bytes * Tq)));
  } else {
    q_block = std::max<int64_t>(1, kScoreTileBytes / row_bytes);
  }

  for (int64_t b0 = 0; b0 < B; b0 += batch_chunk) {
    const int64_t bc = std::min(batch_chunk, B - b0);
    for (int64_t i0 = 0; i0 < Tq; i0 += q_block) {
      const int64_t tb = std::min(q_block, Tq - i0);
      // Keys beyond the last one any row of this tile may see are skipped (visible counts grow with i).
      int64_t n = 0;
      for (int64_t b = b0; b < b0 + bc; ++b) n = std::max(n, VisibleKeyCount(d, mask, b, i0 + tb - 1));
      const int64_t rows = bc * H * tb;
      if (n == 0) {  // Nothing visible: zero outputs (and weights) for the whole tile.
        for (int64_t b = b0; b < b0 + bc; ++b) {
          for (int64_t i = i0; i < i0 + tb; ++i) {
            for (int64_t h = 0; h < H; ++h) {
              std::fill_n(out + (b * Tq + i) * out_stride + h * dk, dk, 0.0f);
              if (weights) std::fill_n(weights + ((b * H + h) * Tq + i) * Tk, Tk, 0.0f);
            }
          }
        }
        continue;
      }
      n = std::min(Tk, (n + 15) / 16 * 16);  // fewer distinct primitive shapes; the extra keys are masked

      // The head-packed layout read as [bc, Hkv, G, T, d_k]; K and V broadcast over G.
      const Layout q_layout{{bc, Hkv, G, tb, dk}, {Tq * q.row_stride, G * dk, dk, q.row_stride, 1}};
      const Layout kt_layout{{bc, Hkv, 1, dk, n}, {Tk * k.row_stride, dk, dk, 1, k.row_stride}};
      const Layout v_layout{{bc, Hkv, 1, n, dk}, {Tk * v.row_stride, dk, dk, v.row_stride, 1}};
      const Layout s_layout{{bc, Hkv, G, tb, n}, {Hkv * G * tb * n, G * tb * n, tb * n, n, 1}};
      const Layout o_layout{{bc, Hkv, G, tb, dk}, {Tq * out_stride, G * dk, dk, out_stride, 1}};

      // Scores go straight into the returned weights when the tile covers them densely.
      const bool direct = weights != nullptr && tb == Tq && n == Tk;
      float* s;
      if (direct) {
        s = weights + b0 * H * Tq * Tk;
      } else {
        if (static_cast<int64_t>(scores_.size()) < rows * n) scores_.resize(rows * n);
        s = scores_.data();
      }
      if (static_cast<int64_t>(dead_rows_.size()) < rows) dead_rows_.resize(rows);

      RunMatmul(q_layout, q.data + (b0 * Tq + i0) * q.row_stride, kt_layout, k.data + b0 * Tk * k.row_stride,
                nullptr, s_layout, s, d.scale);

      // Masks: hide invisible keys with -inf, add the additive mask, and note rows left with nothing visible.
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = b0 + r / (H * tb), i = i0 + r % tb;
        float* row = s + r * n;
        const int64_t visible = std::min(n, VisibleKeyCount(d, mask, b, i));
        bool any = false;
        if (mask.additive != nullptr) {
          const float* add = mask.additive + (mask.additive_per_batch ? b * Tq * Tk : 0) + i * Tk;
          for (int64_t j = 0; j < visible; ++j) {
            row[j] += add[j];
            any |= row[j] != kNegInf;
          }
        } else {
          any = visible > 0;
        }
        std::fill(row + visible, row + n, kNegInf);
        dead_rows_[r] = !any;
      }
      RunSoftmax(rows, n, s);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        if (dead_rows_[r]) std::fill_n(s + r * n, n, 0.0f);  // softmax of all -inf is NaN; we promise zeros
      }

      if (weights != nullptr && !direct) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t bh = r / tb, i = i0 + r % tb;  // bh = (b - b0) * H + h
          float* dst = weights + ((b0 * H + bh) * Tq + i) * Tk;
          std::memcpy(dst, s + r * n, n * sizeof(float));
          std::fill(dst + n, dst + Tk, 0.0f);
        }
      }

      RunMatmul(s_layout, s, v_layout, v.data + b0 * Tk * v.row_stride, nullptr, o_layout,
                out + (b0 * Tq + i0) * out_stride, 1.0f);
    }
  }
}

absl::Status CpuBackend::ScaledDotProductAttention(const SdpaArgs& a) {
  const AttentionDims& d = a.dims;
  try {
    Attend(d, a.mask, {a.q, d.num_heads * d.head_dim}, {a.k, d.num_kv_heads * d.head_dim},
           {a.v, d.num_kv_heads * d.head_dim}, a.out, d.num_heads * d.head_dim, a.weights);
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, "scaled dot-product attention");
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MultiHeadAttention(const MhaArgs& a) {
  const AttentionDims& d = a.dims;
  const LayerWeights& w = a.weights;
  const int64_t q_width = d.num_heads * d.head_dim, kv_width = d.num_kv_heads * d.head_dim;
  const int64_t q_rows = d.batch * d.q_len, kv_rows = d.batch * d.kv_len;
  try {
    Packed q, k, v;
    if (a.self_attention) {
      // One matmul projects Q|K|V; each is then read in place through the row stride of the fused output.
      const int64_t width = q_width + 2 * kv_width;
      const float* w_qkv = w.w_qkv;
      const float* b_qkv = w.b_qkv;
      if (w_qkv == nullptr) {
        const bool has_bias = w.b_q || w.b_k || w.b_v;
        fused_w_.assign(w.d_model * width + (has_bias ? width : 0), 0.0f);
        for (int64_t r = 0; r < w.d_model; ++r) {
          float* row = fused_w_.data() + r * width;
          std::memcpy(row, w.w_q + r * q_width, q_width * sizeof(float));
          std::memcpy(row + q_width, w.w_k + r * kv_width, kv_width * sizeof(float));
          std::memcpy(row + q_width + kv_width, w.w_v + r * kv_width, kv_width * sizeof(float));
        }
        w_qkv = fused_w_.data();
        b_qkv = nullptr;
        if (has_bias) {
          float* bias = fused_w_.data() + w.d_model * width;
          if (w.b_q) std::memcpy(bias, w.b_q, q_width * sizeof(float));
          if (w.b_k) std::memcpy(bias + q_width, w.b_k, kv_width * sizeof(float));
          if (w.b_v) std::memcpy(bias + q_width + kv_width, w.b_v, kv_width * sizeof(float));
          b_qkv = bias;
        }
      }
      if (static_cast<int64_t>(projected_.size()) < q_rows * width) projected_.resize(q_rows * width);
      Linear(a.query, q_rows, w.d_model, w.d_model, w_qkv, b_qkv, width, projected_.data(), width);
      q = {projected_.data(), width};
      k = {projected_.data() + q_width, width};
      v = {projected_.data() + q_width + kv_width, width};
    } else {
      const int64_t total = q_rows * q_width + 2 * kv_rows * kv_width;
      if (static_cast<int64_t>(projected_.size()) < total) projected_.resize(total);
      float* qp = projected_.data();
      float* kp = qp + q_rows * q_width;
      float* vp = kp + kv_rows * kv_width;
      Linear(a.query, q_rows, w.d_model, w.d_model, w.w_q, w.b_q, q_width, qp, q_width);
      Linear(a.key, kv_rows, w.d_kv_in, w.d_kv_in, w.w_k, w.b_k, kv_width, kp, kv_width);
      Linear(a.value, kv_rows, w.d_v_in, w.d_v_in, w.w_v, w.b_v, kv_width, vp, kv_width);
      q = {qp, q_width};
      k = {kp, kv_width};
      v = {vp, kv_width};
    }

    if (static_cast<int64_t>(heads_.size()) < q_rows * q_width) heads_.resize(q_rows * q_width);
    Attend(d, a.mask, q, k, v, heads_.data(), q_width, a.attention_weights);

    if (!a.head_mask.empty()) {
      float* heads = heads_.data();
      const int64_t H = d.num_heads, dk = d.head_dim;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < q_rows; ++r) {
        for (int64_t h = 0; h < H; ++h) {
          const float factor = a.head_mask[h];
          for (int64_t c = 0; c < dk; ++c) heads[r * q_width + h * dk + c] *= factor;
        }
      }
    }
    Linear(heads_.data(), q_rows, q_width, q_width, w.w_o, w.b_o, w.d_model, a.out, w.d_model);
  } catch (const dnnl::error& e) {
    return FromDnnlError(e, "multi-head attention");
  }
  return absl::OkStatus();
}

}  // namespace mha
