// What the decode kernels of every instruction set share: Ahead, their prefetches of the next part of a cache block
// spread over a loop's steps, and WithRows, the register block height as a constant. Included inside a kernel set's
// namespace (paged_kernels_impl.h, paged_kernels_avx512bf16.cc), like the kernels it serves. Free of standard-library
// templates.

// Spreads prefetches of [next, end) over a loop's steps: Step() issues the next `per_step` cache lines.
struct Ahead {
  const char* next;
  const char* end;
  int64_t per_step;

  Ahead(const void* p, int64_t bytes, int64_t steps)
      : next(static_cast<const char*>(p)), end(next + (p == nullptr ? 0 : bytes)),
        per_step(steps > 0 ? (bytes / 64 + steps - 1) / steps : 1) {}
  void Step() {
    // Into L2 (prefetcht1): its queue holds more misses in flight than the L1's fill buffers, which a prefetch to
    // L1 occupies until its line arrives.
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) __builtin_prefetch(next, 0, 2);
  }
};

template <int kN>
struct RowCount {
  static constexpr int kValue = kN;
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
