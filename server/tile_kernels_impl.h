// The body of the tile kernels (tile_kernels.h), included once per instruction set by tile_kernels_<isa>.cc
// inside namespace mha::kernels::<isa>, after that file defines `struct Isa` (vector type and operations) with:
//   kLanes; kScoreRows x kScoreVectors and kValueRows x kValueVectors, the register blocks (accumulators =
//   rows * vectors, chosen to fill the register file and cover FMA latency with independent chains).
// Deliberately free of standard-library templates: every function here is compiled with that TU's -m flags.
//
// Scores: an output block of kScoreRows x kScoreVectors vectors stays in registers for the whole reduction over
// depth; each step loads kScoreVectors vectors of one K^T row and broadcasts one Q value per output row.
// Values: the same with P values broadcast against V rows.

#define MHA_UNROLL _Pragma("GCC unroll 16")

static_assert(Isa::kScoreRows % Isa::kValueRows == 0, "a panel of kScoreRows rows splits into value blocks");

template <int kRows, int kVectors>
inline void ScoreBlock(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
                       const float* kt, int64_t ldk, float* s, int64_t lds) {
  using V = Isa::V;
  V acc[kRows][kVectors];
  const float* qr[kRows];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    qr[r] = q + (r < rows ? r : 0) * ldq;  // rows past the edge recompute row 0 and are not stored
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = Isa::Zero();
  }
  for (int64_t c = 0; c < depth; ++c) {
    V b[kVectors];
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) b[v] = Isa::Load(kt + c * ldk + v * Isa::kLanes);
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

inline void Scores(int64_t rows, int64_t cols, int64_t depth, float scale, const float* q, int64_t ldq,
                   const float* kt, int64_t ldk, float* s, int64_t lds) {
  constexpr int64_t kRows = Isa::kScoreRows, kCols = Isa::kScoreVectors * Isa::kLanes;
  // Column panels outside: one panel of K^T (depth x kCols) stays in L1 while every row block passes over it.
  for (int64_t j = 0; j < cols; j += kCols) {
    const int64_t n = cols - j < kCols ? cols - j : kCols;
    for (int64_t i = 0; i < rows; i += kRows) {
      ScoreBlock<Isa::kScoreRows, Isa::kScoreVectors>(rows - i < kRows ? rows - i : kRows, n, depth, scale,
                                                      q + i * ldq, ldq, kt + j, ldk, s + i * lds + j, lds);
    }
  }
}

template <int kRows, int kVectors>
inline void ValueBlock(int64_t rows, int64_t n, const float* p, int64_t ldp, const float* v, int64_t ldv,
                       const float* o_scale, float* o, int64_t ldo) {
  using V = Isa::V;
  V acc[kRows][kVectors];
  const float* pr[kRows];
  MHA_UNROLL for (int r = 0; r < kRows; ++r) {
    const int64_t row = r < rows ? r : 0;  // rows past the edge recompute row 0 and are not stored
    pr[r] = p + row * ldp;
    const V factor = o_scale != nullptr ? Isa::Broadcast(o_scale + row) : Isa::Zero();
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) {
      acc[r][x] = o_scale != nullptr ? Isa::Mul(factor, Isa::Load(o + row * ldo + x * Isa::kLanes)) : Isa::Zero();
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
    MHA_UNROLL for (int x = 0; x < kVectors; ++x) Isa::Store(o + r * ldo + x * Isa::kLanes, acc[r][x]);
  }
}

// One column panel of `kVectors` vectors for every row block.
template <int kVectors>
inline void ValuePanel(int64_t rows, int64_t n, const float* p, int64_t ldp, const float* v, int64_t ldv,
                       const float* o_scale, float* o, int64_t ldo) {
  constexpr int64_t kRows = Isa::kValueRows;
  for (int64_t i = 0; i < rows; i += kRows) {
    ValueBlock<Isa::kValueRows, kVectors>(rows - i < kRows ? rows - i : kRows, n, p + i * ldp, ldp, v, ldv,
                                          o_scale == nullptr ? nullptr : o_scale + i, o + i * ldo, ldo);
  }
}

inline void Values(int64_t rows, int64_t n, int64_t width, const float* p, int64_t ldp, const float* v,
                   int64_t ldv, const float* o_scale, float* o, int64_t ldo) {
  static_assert(Isa::kValueVectors == 4, "the panel dispatch below covers 1 to 4 vectors");
  for (int64_t c = 0; c < width;) {
    const int64_t vectors = (width - c) / Isa::kLanes;
    switch (vectors >= 4 ? 4 : vectors) {
      case 4: ValuePanel<4>(rows, n, p, ldp, v + c, ldv, o_scale, o + c, ldo); break;
      case 3: ValuePanel<3>(rows, n, p, ldp, v + c, ldv, o_scale, o + c, ldo); break;
      case 2: ValuePanel<2>(rows, n, p, ldp, v + c, ldv, o_scale, o + c, ldo); break;
      default: ValuePanel<1>(rows, n, p, ldp, v + c, ldv, o_scale, o + c, ldo); break;
    }
    c += (vectors >= 4 ? 4 : vectors) * Isa::kLanes;
  }
}

#undef MHA_UNROLL
