// What the decode kernels of every instruction set share: Ahead, their prefetches of the next part of a cache block
// spread over a loop's steps; WithRows, the register block height as a constant; and the 8-bit caches' prefill
// kernels made of their decode kernels. Included inside a kernel set's
// namespace (paged_kernels_impl.h, paged_kernels_avx512bf16.cc), like the kernels it serves. Free of standard-library
// templates.

// Spreads prefetches over a loop's steps: Step() issues the next `per_step` cache lines of [next, end) into L2 and,
// where the kernel names the part it reads (`here`), as many lines of that part from kHereLead bytes on into L1.
// Why both: the lines far ahead keep the memory busy while a part computes, and the near ones turn its loads from L2
// hits into L1 hits, which on fast memory is what the load-bound kernels wait on (docs/PERFORMANCE.md).
struct Ahead {
  static constexpr int64_t kHereLead = 1024;
  const char* next;
  const char* end;
  int64_t per_step;
  const char* here;
  const char* here_end;

  Ahead(const void* p, int64_t bytes, int64_t steps, const void* part = nullptr)
      : next(static_cast<const char*>(p)), end(next + (p == nullptr ? 0 : bytes)),
        per_step(steps > 0 ? (bytes / 64 + steps - 1) / steps : 1),
        here(part == nullptr ? nullptr : static_cast<const char*>(part) + kHereLead),
        here_end(part == nullptr ? nullptr : static_cast<const char*>(part) + bytes) {}
  void Step() {
    // Into L2 (prefetcht1): its queue holds more misses in flight than the L1's fill buffers, which a prefetch to
    // L1 occupies until its line arrives.
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) __builtin_prefetch(next, 0, 2);
    for (int64_t i = 0; i < per_step && here < here_end; ++i, here += 64) __builtin_prefetch(here, 0, 3);
  }
};

template <int kN>
struct RowCount {
  static constexpr int kValue = kN;
};

// A constant bool passed as a value, as RowCount passes an int: a generic lambda's compile-time switch.
template <bool kB>
struct Flag {
  static constexpr bool kValue = kB;
};

// Calls f(RowCount<n>{}) with the register block height n = rows (1..kMax).
template <int kMax, typename F>
inline void WithRows(int64_t rows, F&& f) {
  if constexpr (kMax > 1) {
    if (rows < kMax) {
      WithRows<kMax - 1>(rows, f);
      return;
    }
  }
  f(RowCount<kMax>{});
}

// PagedKernels::prefill_scores of an 8-bit cache: its decode kernel over groups of kQuantizedMaxRows rows (the size
// of its per-row buffers).
template <auto kScores>
void ScoresInRowGroups(int64_t rows, int64_t keys, int64_t depth, const float* q, int64_t ldq, const void* kt,
                       int64_t ldk, const uint16_t* key_scales, float* s, int64_t lds, const void* ahead,
                       int64_t ahead_size) {
  for (int64_t r = 0; r < rows; r += kQuantizedMaxRows) {
    const int64_t n = rows - r < kQuantizedMaxRows ? rows - r : kQuantizedMaxRows;
    kScores(n, keys, depth, q + r * ldq, ldq, kt, ldk, key_scales, s + r * lds, lds, r == 0 ? ahead : nullptr,
            ahead_size);
  }
}

// PagedKernels::prefill_values of an 8-bit cache: its decode kernel part after part (the first rescaling the
// outputs, the later adding to them), over groups of kQuantizedMaxRows rows.
template <auto kValues>
void ValuesPartByPart(int64_t rows, const void* const* parts, const uint16_t* const* value_scales, int64_t blocks,
                      int64_t block_keys, int64_t last_keys, int64_t width, const float* p, int64_t ldp,
                      const float* o_scale, float* o, int64_t ldo, const void* ahead, int64_t ahead_size) {
  for (int64_t b = 0; b < blocks; ++b) {
    const void* next = b + 1 < blocks ? parts[b + 1] : ahead;
    for (int64_t r = 0; r < rows; r += kQuantizedMaxRows) {
      const int64_t n = rows - r < kQuantizedMaxRows ? rows - r : kQuantizedMaxRows;
      kValues(n, b + 1 < blocks ? block_keys : last_keys, width, p + r * ldp + b * block_keys, ldp, parts[b],
              value_scales[b], b == 0 && o_scale != nullptr ? o_scale + r : nullptr, o + r * ldo, ldo,
              r == 0 ? next : nullptr, ahead_size);
    }
  }
}
