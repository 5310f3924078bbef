// The body of the tile kernels (tile_kernels.h), included once per instruction set by tile_kernels_<isa>.cc
// inside namespace mha::kernels::<isa>, after that file defines `struct Isa` (vector type and operations) with:
//   kName (the instruction set's name); kLanes; kScoreRows x kScoreVectors and kValueRows x kValueVectors, the
//   register blocks (accumulators = rows * vectors, chosen to fill the register file and cover FMA latency with
//   independent chains).
// Deliberately free of standard-library templates: every function here is compiled with that TU's -m flags.
//
// Scores: an output block of kScoreRows x kScoreVectors vectors stays in registers for the whole reduction over
// depth; each step loads kScoreVectors vectors of one K^T row and broadcasts one Q value per output row.
// Values: the same with P values broadcast against V rows; the last vector of a row may be partial (a head_dim that
// is not a multiple of kLanes).

#define MHA_UNROLL _Pragma("GCC unroll 16")

inline void Transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd);

static_assert(Isa::kScoreRows % Isa::kValueRows == 0, "a panel of kScoreRows rows splits into value blocks");
static_assert(Isa::kScoreRows % 3 == 0 && Isa::kValueRows % 3 == 0, "short blocks step by a third");

// kt: one packed panel, depth rows of kVectors * kLanes floats.
template <int kRows, int kVectors>
inline void ScoreBlock(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
                       const float* kt, float* s, int64_t lds) {
  using V = Isa::V;
  V acc[kRows][kVectors];
  const float* qr[kRows];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    qr[r] = q + (r < rows ? r : 0) * ldq;  // rows past the edge recompute row 0 and are not stored
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = Isa::Zero();
  }
  for (int64_t c = 0; c < depth; ++c) {
    V b[kVectors];
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) {
      b[v] = Isa::Load(kt + (c * kVectors + v) * Isa::kLanes);
    }
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const V a = Isa::Broadcast(qr[r] + c);
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = Isa::Fma(a, b[v], acc[r][v]);
    }
  }
  const V factor = Isa::Broadcast(&scale);
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) {
      const int64_t col = v * Isa::kLanes;
      const V x = Isa::Mul(acc[r][v], factor);
      if (col + Isa::kLanes <= cols) {
        Isa::Store(s + r * lds + col, x);
      } else if (col < cols) {
        Isa::StorePartial(s + r * lds + col, x, static_cast<int>(cols - col));
      }
    }
  }
}

// A register block's rows past `rows` are computed and dropped, so a short block (the last of a 128-row query block
// is 8 of 12 rows on AVX-512) takes the shortest register block that covers it, in steps of a third of the full
// height kFull: calls f(BlockRows<n>{}) with that height n.
template <int kRows>
struct BlockRows {
  static constexpr int kValue = kRows;
};

template <int kFull, int kRows = kFull, typename F>
inline void WithBlockRows(int64_t rows, F&& f) {
  constexpr int kStep = kFull / 3;
  if constexpr (kRows > kStep) {
    if (rows <= kRows - kStep) {
      WithBlockRows<kFull, kRows - kStep>(rows, f);
      return;
    }
  }
  f(BlockRows<kRows>{});
}

inline void Scores(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
                   const float* kt, float* s, int64_t lds) {
  constexpr int64_t kRows = Isa::kScoreRows, kCols = Isa::kScoreVectors * Isa::kLanes;
  // Column panels outside: one panel of K^T (depth x kCols, contiguous) stays in L1 while every row block passes
  // over it.
  for (int64_t j = 0; j < cols; j += kCols) {
    const int64_t n = cols - j < kCols ? cols - j : kCols;
    for (int64_t i = 0; i < rows; i += kRows) {
      const int64_t block = rows - i < kRows ? rows - i : kRows;
      WithBlockRows<Isa::kScoreRows>(block, [&](auto height) {
        ScoreBlock<decltype(height)::kValue, Isa::kScoreVectors>(block, n, depth, scale, q + i * ldq, ldq,
                                                                 kt + j * depth, s + i * lds + j, lds);
      });
    }
  }
}

// The last of the kVectors vectors of each row holds last_lanes (1..kLanes) columns of o; the rest of it is
// neither read nor written.
template <int kRows, int kVectors>
inline void ValueBlock(int64_t rows, int64_t n, const float* p, int64_t ldp, const float* v, int64_t ldv,
                       const float* o_scale, float* o, int64_t ldo, int last_lanes) {
  using V = Isa::V;
  V acc[kRows][kVectors];
  const float* pr[kRows];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    const int64_t row = r < rows ? r : 0;  // rows past the edge recompute row 0 and are not stored
    pr[r] = p + row * ldp;
    const V factor = o_scale != nullptr ? Isa::Broadcast(o_scale + row) : Isa::Zero();
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
      if (o_scale == nullptr) {
        acc[r][x] = Isa::Zero();
      } else {
        const float* old = o + row * ldo + x * Isa::kLanes;
        const bool partial = x == kVectors - 1 && last_lanes < Isa::kLanes;
        acc[r][x] = Isa::Mul(factor, partial ? Isa::LoadPartial(old, last_lanes, 0.0f) : Isa::Load(old));
      }
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    V b[kVectors];
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) b[x] = Isa::Load(v + j * ldv + x * Isa::kLanes);
    MHA_UNROLL for (int r = 0; r < kRows; ++r) {
      const V a = Isa::Broadcast(pr[r] + j);
      MHA_UNROLL for (int x = 0; x < kVectors; ++x) acc[r][x] = Isa::Fma(a, b[x], acc[r][x]);
    }
  }
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
      if (x == kVectors - 1 && last_lanes < Isa::kLanes) {
        Isa::StorePartial(o + r * ldo + x * Isa::kLanes, acc[r][x], last_lanes);
      } else {
        Isa::Store(o + r * ldo + x * Isa::kLanes, acc[r][x]);
      }
    }
  }
}

// One column panel of `kVectors` vectors for every row block.
template <int kVectors>
inline void ValuePanel(int64_t rows, int64_t n, const float* p, int64_t ldp, const float* v, int64_t ldv,
                       const float* o_scale, float* o, int64_t ldo, int last_lanes) {
  constexpr int64_t kRows = Isa::kValueRows;
  for (int64_t i = 0; i < rows; i += kRows) {
    const int64_t block = rows - i < kRows ? rows - i : kRows;
    WithBlockRows<Isa::kValueRows>(block, [&](auto height) {
      ValueBlock<decltype(height)::kValue, kVectors>(block, n, p + i * ldp, ldp, v, ldv,
                                                     o_scale == nullptr ? nullptr : o_scale + i, o + i * ldo, ldo,
                                                     last_lanes);
    });
  }
}

// A panel of min(kVectors, vectors) vectors: the widest register block that fits what is left of the width.
template <int kVectors>
inline void ValuePanelUpTo(int64_t vectors, int64_t rows, int64_t n, const float* p, int64_t ldp, const float* v,
                           int64_t ldv, const float* o_scale, float* o, int64_t ldo, int last_lanes) {
  if constexpr (kVectors > 1) {
    if (vectors < kVectors) {
      ValuePanelUpTo<kVectors - 1>(vectors, rows, n, p, ldp, v, ldv, o_scale, o, ldo, last_lanes);
      return;
    }
  }
  ValuePanel<kVectors>(rows, n, p, ldp, v, ldv, o_scale, o, ldo, last_lanes);
}

// v: packed panels of kPanel columns, rows kPanel floats apart, panels panel_stride floats apart.
inline void Values(int64_t rows, int64_t n, int64_t width, const float* p, int64_t ldp, const float* v,
                   int64_t panel_stride, const float* o_scale, float* o, int64_t ldo) {
  constexpr int64_t kPanel = Isa::kValueVectors * Isa::kLanes;
  for (int64_t c = 0; c < width; c += kPanel) {
    const int64_t left = width - c;  // columns from here on, the last vector possibly partial
    const int64_t vectors = (left + Isa::kLanes - 1) / Isa::kLanes < Isa::kValueVectors
                                ? (left + Isa::kLanes - 1) / Isa::kLanes
                                : Isa::kValueVectors;
    const int64_t last = left - (vectors - 1) * Isa::kLanes;
    ValuePanelUpTo<Isa::kValueVectors>(vectors, rows, n, p, ldp, v + (c / kPanel) * panel_stride, kPanel, o_scale,
                                       o + c, ldo, static_cast<int>(last < Isa::kLanes ? last : Isa::kLanes));
  }
}

// K^T in panels for Scores: the keys k[n, depth] (row stride ldk) become ceil(n / kCols) panels of depth rows of
// kCols floats, one after another; columns past n are zero.
inline void PackKeys(int64_t n, int64_t depth, const float* k, int64_t ldk, float* kt) {
  constexpr int64_t kCols = Isa::kScoreVectors * Isa::kLanes;
  for (int64_t j = 0; j < n; j += kCols) {
    const int64_t cols = n - j < kCols ? n - j : kCols;
    float* panel = kt + j * depth;
    if (cols < kCols) __builtin_memset(panel, 0, depth * kCols * sizeof(float));  // the padding columns
    Transpose(cols, depth, k + j * ldk, ldk, panel, kCols);
  }
}

// V in panels for Values: v[n, width] (row stride ldv) becomes ceil(width / kPanel) panels, panel_stride floats
// apart, each n rows of kPanel floats (columns past width zero). Whole vectors, no library calls: a row of a panel
// is a couple of vectors.
inline void PackValues(int64_t n, int64_t width, const float* v, int64_t ldv, float* vp, int64_t panel_stride) {
  constexpr int64_t kPanel = Isa::kValueVectors * Isa::kLanes;
  for (int64_t c = 0; c < width; c += kPanel) {
    float* panel = vp + (c / kPanel) * panel_stride;
    for (int64_t j = 0; j < n; ++j) {
      MHA_UNROLL for (int x = 0; x < Isa::kValueVectors; ++x) {
        const int64_t col = c + x * Isa::kLanes;
        const float* src = v + j * ldv + col;
        const Isa::V x_v = col + Isa::kLanes <= width ? Isa::Load(src)
                           : col < width              ? Isa::LoadPartial(src, static_cast<int>(width - col), 0.0f)
                                                      : Isa::Zero();
        Isa::Store(panel + j * kPanel + x * Isa::kLanes, x_v);
      }
    }
  }
}

// max(x[0, n)), -inf for n == 0. Four running maxima: one would wait out vmaxps's latency on every vector.
inline float RowMax(const float* x, int64_t n) {
  Isa::V m0 = Isa::Splat(-__builtin_inff()), m1 = m0, m2 = m0, m3 = m0;
  int64_t j = 0;
  for (; j + 4 * Isa::kLanes <= n; j += 4 * Isa::kLanes) {
    m0 = Isa::Max(m0, Isa::Load(x + j));
    m1 = Isa::Max(m1, Isa::Load(x + j + Isa::kLanes));
    m2 = Isa::Max(m2, Isa::Load(x + j + 2 * Isa::kLanes));
    m3 = Isa::Max(m3, Isa::Load(x + j + 3 * Isa::kLanes));
  }
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) m0 = Isa::Max(m0, Isa::Load(x + j));
  if (j < n) m1 = Isa::Max(m1, Isa::LoadPartial(x + j, static_cast<int>(n - j), -__builtin_inff()));
  return Isa::ReduceMax(Isa::Max(Isa::Max(m0, m1), Isa::Max(m2, m3)));
}

// c[N-1] f^(N-1) + ... + c[1] f + c[0], by Horner's rule.
template <int N>
inline Isa::V Horner(Isa::V f, const float (&c)[N]) {
  Isa::V p = Isa::Splat(c[N - 1]);
  MHA_UNROLL for (int k = N - 2; k >= 0; --k) p = Isa::Fma(p, f, Isa::Splat(c[k]));
  return p;
}

// exp(x) for x <= 88 (-inf included): 2^n p(f) with n = round(x log2 e), f = x - n ln 2 (ln 2 in two parts), p the
// polynomial c fitted to e^f on [-ln2/2, ln2/2] for relative error. Below -87.3 (-inf included): 0.
template <int N>
inline Isa::V Exp(Isa::V x, const float (&c)[N]) {
  const Isa::V n = Isa::RoundNearest(Isa::Mul(x, Isa::Splat(1.44269504088896341f)));
  Isa::V f = Isa::Fnmadd(n, Isa::Splat(0.693359375f), x);
  f = Isa::Fnmadd(n, Isa::Splat(-2.12194440e-4f), f);
  return Isa::Pow2Live(Horner(f, c), n, x, -87.33654f);
}

// 2^x for x <= 127 (-inf included): 2^n p(f) with n = round(x) and f = x - n (exact), p the polynomial c fitted to
// 2^f on [-1/2, 1/2]. Below -126 (-inf included): 0. For scores in log2 units: no multiply by log2 e and one
// reduction step fewer than Exp.
template <int N>
inline Isa::V Exp2(Isa::V x, const float (&c)[N]) {
  const Isa::V n = Isa::RoundNearest(x);
  return Isa::Pow2Live(Horner(Isa::Sub(x, n), c), n, x, -126.0f);
}

// Degree 5, for fp32 weights: within 2.0e-7 of double exp over [-87, 0], and (Exp's coefficients times ln2^k)
// within 1.8e-7 of double exp2 over [-125, 0].
constexpr float kExpFp32[6] = {1.000000119e+0f, 9.999997020e-1f, 4.999889433e-1f,
                               1.666757464e-1f, 4.191538319e-2f, 8.297654800e-3f};
constexpr float kExp2Fp32[6] = {1.000000119e+0f, 6.931470037e-1f, 2.402211875e-1f,
                                5.550713092e-2f, 9.675541893e-3f, 1.327647129e-3f};
// Degree 3, for weights that the bf16 sets round to bf16 (2^-9 relative) before their products: within 7.5e-5 of
// double exp and exp2 over the same ranges, and cheaper than degree 5.
constexpr float kExpBf16[4] = {9.999280572e-1f, 1.000164151e+0f, 5.049633384e-1f, 1.656685919e-1f};
constexpr float kExp2Bf16[4] = {9.999280572e-1f, 6.932609677e-1f, 2.426111549e-1f, 5.517172441e-2f};

// The weight of a score x below the row's max: 2^x for scores in log2 units (kLog2), else e^x; to bf16's
// precision with kBf16.
template <bool kLog2, bool kBf16 = false>
inline Isa::V Weight(Isa::V x) {
  if constexpr (kLog2) {
    return kBf16 ? Exp2(x, kExp2Bf16) : Exp2(x, kExp2Fp32);
  } else {
    return kBf16 ? Exp(x, kExpBf16) : Exp(x, kExpFp32);
  }
}

template <bool kLog2>
inline float ScalarWeight(float x) {
  return kLog2 ? __builtin_exp2f(x) : __builtin_expf(x);
}

// x[j] = Weight(x[j] - shift) for j in [0, n); returns their sum. shift is finite.
// Two vectors per step with a sum each, so that the polynomials of neighbouring vectors overlap.
template <bool kLog2, bool kBf16 = false>
inline float WeightShiftSum(float* x, int64_t n, float shift) {
  const Isa::V s = Isa::Splat(shift);
  Isa::V sum = Isa::Zero(), sum1 = Isa::Zero();
  int64_t j = 0;
  for (; j + 2 * Isa::kLanes <= n; j += 2 * Isa::kLanes) {
    const Isa::V e0 = Weight<kLog2, kBf16>(Isa::Sub(Isa::Load(x + j), s));
    const Isa::V e1 = Weight<kLog2, kBf16>(Isa::Sub(Isa::Load(x + j + Isa::kLanes), s));
    Isa::Store(x + j, e0);
    Isa::Store(x + j + Isa::kLanes, e1);
    sum = Isa::Add(sum, e0);
    sum1 = Isa::Add(sum1, e1);
  }
  sum = Isa::Add(sum, sum1);
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) {
    const Isa::V e = Weight<kLog2, kBf16>(Isa::Sub(Isa::Load(x + j), s));
    Isa::Store(x + j, e);
    sum = Isa::Add(sum, e);
  }
  if (j < n) {
    const int tail = static_cast<int>(n - j);
    const Isa::V e = Weight<kLog2, kBf16>(Isa::Sub(Isa::LoadPartial(x + j, tail, -__builtin_inff()), s));  // weight 0
    Isa::StorePartial(x + j, e, tail);
    sum = Isa::Add(sum, e);
  }
  return Isa::ReduceAdd(sum);
}

// 0, 1, 2, ...: the key offsets of a block's lanes, loaded rather than counted (a load port, not an ALU op).
inline constexpr int64_t kIotaSize = 4096;
struct IotaTable {
  float values[kIotaSize];
  constexpr IotaTable() : values() {
    for (int64_t j = 0; j < kIotaSize; ++j) values[j] = static_cast<float>(j);
  }
};
inline constexpr IotaTable kIota{};

// WeightShiftSum, also accumulating the softmax statistics' sums (tile_kernels.h's SoftmaxStatsBlock) of these
// weights w_j: *entropy += sum w_j (x[j] - shift), *distance += sum w_j |pos - j|. `masked`: x may hold -inf (an
// additive mask) whose x - shift, times its weight 0, must not make NaN. Keys all at or before pos (causal rows,
// and every block before the query's) take |pos - j| = pos - j: sum w_j j is one FMA on the loaded offsets, and
// pos sum w_j - sum w_j j, with block-relative positions, cancels only where the block holds the query (pos < its
// length, so no precision is lost); other blocks compute |pos - j| per lane.
template <bool kLog2, bool kBf16 = false>
inline float WeightShiftSumStats(float* x, int64_t n, float shift, float pos, bool masked, float* entropy,
                                 float* distance) {
  const Isa::V s = Isa::Splat(shift), floor = Isa::Splat(-1000.0f);
  const bool before = pos >= static_cast<float>(n - 1) && n <= kIotaSize;
  Isa::V sum = Isa::Zero(), ent = Isa::Zero(), dist = Isa::Zero();
  Isa::V ahead = Isa::Sub(Isa::Splat(pos), Isa::Load(kIota.values)), step = Isa::Splat(Isa::kLanes);
  const auto one = [&](Isa::V scores, int64_t j, int tail) {
    Isa::V d = Isa::Sub(scores, s);
    const Isa::V e = Weight<kLog2, kBf16>(d);
    if (tail == 0) {
      Isa::Store(x + j, e);
    } else {
      Isa::StorePartial(x + j, e, tail);
    }
    sum = Isa::Add(sum, e);
    if (masked || tail != 0) d = Isa::Max(d, floor);  // -inf where e is 0
    ent = Isa::Fma(e, d, ent);
    if (before) {
      dist = Isa::Fma(e, Isa::Load(kIota.values + j), dist);  // sum w_j j
    } else {
      dist = Isa::Fma(e, Isa::Max(ahead, Isa::Sub(Isa::Zero(), ahead)), dist);
      ahead = Isa::Sub(ahead, step);
    }
  };
  int64_t j = 0;
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) one(Isa::Load(x + j), j, 0);
  if (j < n) one(Isa::LoadPartial(x + j, static_cast<int>(n - j), -__builtin_inff()), j, static_cast<int>(n - j));
  const float total = Isa::ReduceAdd(sum);
  *entropy += Isa::ReduceAdd(ent);
  *distance += before ? pos * total - Isa::ReduceAdd(dist) : Isa::ReduceAdd(dist);
  return total;
}

// Whether any of x[0, n) is NaN; only asked on the rare path of a row whose visible scores have no maximum.
inline bool AnyNaN(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] != x[j]) return true;
  }
  return false;
}

inline void ScaleRow(float* x, int64_t n, float factor) {
  const Isa::V f = Isa::Splat(factor);
  int64_t j = 0;
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) Isa::Store(x + j, Isa::Mul(Isa::Load(x + j), f));
  for (; j < n; ++j) x[j] *= factor;
}

template <bool kLog2, bool kBf16>
inline void OnlineSoftmaxIn(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, float* row_max,
                            float* row_sum, float* factor) {
  // Two passes: every row's new max (held in factor[] until the second pass), then the weights. Row by row, each
  // row's exps would wait on its own max's reduction; with the maxima known, consecutive rows overlap.
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    const int64_t count = visible[r];
    if (count < n) __builtin_memset(row + count, 0, (n - count) * sizeof(float));
    const float block_max = RowMax(row, count);
    factor[r] = row_max[r] > block_max ? row_max[r] : block_max;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    const int64_t count = visible[r];
    const float new_max = factor[r];
    if (new_max == -__builtin_inff()) {  // nothing visible yet: this block contributes nothing
      // ... unless its scores were NaN (which the max skips): then the row's sum, and so its output, is NaN.
      if (AnyNaN(row, count)) row_sum[r] = __builtin_nanf("");
      __builtin_memset(row, 0, count * sizeof(float));
      factor[r] = 1.0f;
      continue;
    }
    // weight(0) is exactly 1: a max that did not move (most rows after the first blocks) needs no exp.
    factor[r] = row_max[r] == -__builtin_inff() ? 0.0f
                : row_max[r] == new_max        ? 1.0f
                                               : ScalarWeight<kLog2>(row_max[r] - new_max);
    row_sum[r] = row_sum[r] * factor[r] + WeightShiftSum<kLog2, kBf16>(row, count, new_max);
    row_max[r] = new_max;
  }
}

// OnlineSoftmaxIn with the statistics of SoftmaxStatsBlock, rescaled with each row's sum: when a row's max moves
// from m to m' by the factor f = weight(m - m'), each weight w becomes f w and each x - m becomes (x - m') + (m - m'),
// so the entropy sum becomes f (acc + sum (m - m')) and the others f acc.
template <bool kLog2, bool kBf16>
inline void OnlineSoftmaxStatsIn(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds,
                                 float* row_max, float* row_sum, float* factor, const SoftmaxStatsBlock& stats) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    const int64_t count = visible[r];
    if (count < n) __builtin_memset(row + count, 0, (n - count) * sizeof(float));
    const float block_max = RowMax(row, count);
    const float new_max = row_max[r] > block_max ? row_max[r] : block_max;
    float* acc = stats.acc + r * kStatsPerRow;
    if (new_max == -__builtin_inff()) {  // as OnlineSoftmaxIn
      if (AnyNaN(row, count)) row_sum[r] = __builtin_nanf("");
      __builtin_memset(row, 0, count * sizeof(float));
      factor[r] = 1.0f;
      continue;
    }
    float f = 0.0f;
    if (row_max[r] == new_max) {
      f = 1.0f;
    } else if (row_max[r] != -__builtin_inff()) {
      f = ScalarWeight<kLog2>(row_max[r] - new_max);
      acc[0] = f * (acc[0] + row_sum[r] * (row_max[r] - new_max));
      acc[1] *= f;
      acc[2] *= f;
    }
    factor[r] = f;
    const float pos = stats.query_pos[r] - static_cast<float>(stats.first_key);
    row_sum[r] = row_sum[r] * f +
                 WeightShiftSumStats<kLog2, kBf16>(row, count, new_max, pos, stats.masked, &acc[0], &acc[1]);
    row_max[r] = new_max;
    for (int64_t j = 0; j < count && stats.first_key + j < stats.sink_tokens; ++j) acc[2] += row[j];
  }
}

// x[0, n) = 0, for the masked keys of returned weights, which nothing here reads again: long runs with
// non-temporal stores from their first whole cache line on, which skip reading each line before writing it (half
// the memory traffic of a causal call's weights); short ones with memset. The caller issues
// Isa::StreamFence() before the row may be read by another thread.
inline void ZeroMaskedTail(float* x, int64_t n) {
  constexpr int64_t kStreamFrom = 256;  // floats (1 KiB)
  if (n < kStreamFrom) {
    __builtin_memset(x, 0, n * sizeof(float));
    return;
  }
  const int64_t head = static_cast<int64_t>((0 - reinterpret_cast<uintptr_t>(x)) % 64) / sizeof(float);
  __builtin_memset(x, 0, head * sizeof(float));
  int64_t j = head;
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) Isa::StoreStream(x + j, Isa::Zero());
  __builtin_memset(x + j, 0, (n - j) * sizeof(float));
}

// SoftmaxIn, also writing each row's max and sum of weights (before normalising) and the statistics of
// SoftmaxStatsBlock (set, not accumulated), for rows whose weights are returned.
template <bool kLog2>
inline void SoftmaxStatsIn(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds,
                           const SoftmaxStatsBlock& stats, float* row_max, float* row_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    const int64_t count = visible[r];
    float* acc = stats.acc + r * kStatsPerRow;
    acc[0] = acc[1] = acc[2] = 0.0f;
    const float max = RowMax(row, count);
    row_max[r] = max;
    if (max == -__builtin_inff()) {
      const bool nan = AnyNaN(row, count);
      row_sum[r] = nan ? __builtin_nanf("") : 0.0f;
      for (int64_t j = 0; j < count; ++j) row[j] = nan ? __builtin_nanf("") : 0.0f;
      __builtin_memset(row + count, 0, (n - count) * sizeof(float));
      continue;
    }
    const float pos = stats.query_pos[r] - static_cast<float>(stats.first_key);
    const float sum = WeightShiftSumStats<kLog2>(row, count, max, pos, stats.masked, &acc[0], &acc[1]);
    row_sum[r] = sum;
    for (int64_t j = 0; j < count && stats.first_key + j < stats.sink_tokens; ++j) acc[2] += row[j];
    ScaleRow(row, count, 1.0f / sum);
    ZeroMaskedTail(row + count, n - count);
  }
  Isa::StreamFence();
}

template <bool kLog2>
inline void SoftmaxIn(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * lds;
    const int64_t count = visible[r];
    const float max = RowMax(row, count);
    if (max == -__builtin_inff()) {  // nothing visible: zero weights; NaN scores (which the max skips): NaN ones
      const float fill = AnyNaN(row, count) ? __builtin_nanf("") : 0.0f;
      for (int64_t j = 0; j < count; ++j) row[j] = fill;
      __builtin_memset(row + count, 0, (n - count) * sizeof(float));
      continue;
    }
    ScaleRow(row, count, 1.0f / WeightShiftSum<kLog2>(row, count, max));
    ZeroMaskedTail(row + count, n - count);
  }
  Isa::StreamFence();
}

// TileKernels::online_softmax; with kBf16, its weights to bf16's precision (degree-3 exps), for the bf16 sets.
template <bool kBf16>
inline void OnlineSoftmax(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, float* row_max,
                          float* row_sum, float* factor, bool log2) {
  if (log2) {
    OnlineSoftmaxIn<true, kBf16>(rows, n, visible, s, lds, row_max, row_sum, factor);
  } else {
    OnlineSoftmaxIn<false, kBf16>(rows, n, visible, s, lds, row_max, row_sum, factor);
  }
}

// TileKernels::online_softmax_stats.
template <bool kBf16>
inline void OnlineSoftmaxStats(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds,
                               float* row_max, float* row_sum, float* factor, bool log2,
                               const SoftmaxStatsBlock& stats) {
  if (log2) {
    OnlineSoftmaxStatsIn<true, kBf16>(rows, n, visible, s, lds, row_max, row_sum, factor, stats);
  } else {
    OnlineSoftmaxStatsIn<false, kBf16>(rows, n, visible, s, lds, row_max, row_sum, factor, stats);
  }
}

inline void SoftmaxStats(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, bool log2,
                         const SoftmaxStatsBlock& stats, float* row_max, float* row_sum) {
  if (log2) {
    SoftmaxStatsIn<true>(rows, n, visible, s, lds, stats, row_max, row_sum);
  } else {
    SoftmaxStatsIn<false>(rows, n, visible, s, lds, stats, row_max, row_sum);
  }
}

inline void Softmax(int64_t rows, int64_t n, const int64_t* visible, float* s, int64_t lds, bool log2) {
  if (log2) {
    SoftmaxIn<true>(rows, n, visible, s, lds);
  } else {
    SoftmaxIn<false>(rows, n, visible, s, lds);
  }
}

// dst[c, r] = src[r, c] for r < rows, c < cols: in 8 x 8 blocks through AVX registers where the instruction set has
// them, the edges (and everything on the portable set) one element at a time.
inline void Transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd) {
  int64_t r = 0;
#ifdef __AVX__
  for (; r + 8 <= rows; r += 8) {
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      __m256 x[8], y[8];
      MHA_UNROLL for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_ps(src + (r + i) * lds + c);
      MHA_UNROLL for (int i = 0; i < 8; i += 2) {
        y[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
        y[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
      }
      MHA_UNROLL for (int i = 0; i < 8; i += 4) {
        x[i] = _mm256_shuffle_ps(y[i], y[i + 2], 0x44);
        x[i + 1] = _mm256_shuffle_ps(y[i], y[i + 2], 0xEE);
        x[i + 2] = _mm256_shuffle_ps(y[i + 1], y[i + 3], 0x44);
        x[i + 3] = _mm256_shuffle_ps(y[i + 1], y[i + 3], 0xEE);
      }
      MHA_UNROLL for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (c + i) * ldd + r, _mm256_permute2f128_ps(x[i], x[i + 4], 0x20));
        _mm256_storeu_ps(dst + (c + i + 4) * ldd + r, _mm256_permute2f128_ps(x[i], x[i + 4], 0x31));
      }
    }
    for (; c < cols; ++c) {
      for (int64_t i = 0; i < 8; ++i) dst[c * ldd + r + i] = src[(r + i) * lds + c];
    }
  }
#endif
  for (; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

// dst[r, c] = scale * src[r, c].
inline void CopyScaled(int64_t rows, int64_t cols, float scale, const float* src, int64_t lds, float* dst,
                       int64_t ldd) {
  const Isa::V f = Isa::Splat(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * lds;
    float* out = dst + r * ldd;
    int64_t c = 0;
    for (; c + Isa::kLanes <= cols; c += Isa::kLanes) Isa::Store(out + c, Isa::Mul(f, Isa::Load(in + c)));
    for (; c < cols; ++c) out[c] = scale * in[c];
  }
}

// x[j] += y[j].
inline void AddRow(int64_t n, const float* y, float* x) {
  int64_t j = 0;
  for (; j + Isa::kLanes <= n; j += Isa::kLanes) Isa::Store(x + j, Isa::Add(Isa::Load(x + j), Isa::Load(y + j)));
  for (; j < n; ++j) x[j] += y[j];
}

// This instruction set's entry of the table tile_kernels.cc hands out.
#include "server/backends/cpu/paged_kernels_impl.h"  // defines kPagedKernels

extern const TileKernels kKernels = {Isa::kName,
                                     Isa::kLanes,
                                     Isa::kScoreVectors * Isa::kLanes,
                                     Isa::kValueVectors * Isa::kLanes,
                                     Isa::kScoreRows,
                                     /*elements_per_float=*/1,
                                     /*key_multiple=*/1,
                                     /*key_block=*/512,
                                     &PackKeys,
                                     &PackValues,
                                     &Scores,
                                     &Values,
                                     &OnlineSoftmax</*kBf16=*/false>,
                                     &Softmax,
                                     &OnlineSoftmaxStats</*kBf16=*/false>,
                                     &SoftmaxStats,
                                     &CopyScaled,
                                     &AddRow,
                                     /*to_bf16=*/nullptr,
                                     /*pack_keys_bf16=*/nullptr,
                                     /*pack_values_bf16=*/nullptr,
                                     /*copy_scaled_bf16=*/nullptr,
                                     /*copy_scaled_to_bf16=*/nullptr,
                                     kPagedKernels};

// The online softmax of the bf16 sets built on this set's kernels (tile_kernels.cc).
extern const decltype(TileKernels::online_softmax) kBf16OnlineSoftmax = &OnlineSoftmax</*kBf16=*/true>;
extern const decltype(TileKernels::online_softmax_stats) kBf16OnlineSoftmaxStats =
    &OnlineSoftmaxStats</*kBf16=*/true>;

#undef MHA_UNROLL
