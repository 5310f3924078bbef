// Per-thread scratch buffers of the CPU backend: std::vectors whose data start on a 64-byte cache line, so that the
// rows of AMX tiles and of vector loads never straddle two lines (unaligned packed K and V ran the amx kernels at
// a third of their speed), and the helpers that grow and trim them.
//
// Not for the per-instruction-set kernel files (tile_kernels_*.cc): a template instantiated there would be
// compiled with their -m flags, and the linker may keep that copy for the whole program.
#ifndef MHA_SERVER_BACKENDS_CPU_SCRATCH_H_
#define MHA_SERVER_BACKENDS_CPU_SCRATCH_H_

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace mha::cpu {

inline constexpr std::size_t kCacheLine = 64;

// std::allocator on cache-line boundaries.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: allocators convert implicitly
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using ScratchVector = std::vector<T, CacheLineAllocator<T>>;

// v's data, grown to at least n elements.
template <typename T>
T* Grown(ScratchVector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// Frees `v` when it holds more than `kept` bytes.
template <typename T>
void ReleaseIfLarge(ScratchVector<T>& v, int64_t kept) {
  if (static_cast<int64_t>(v.capacity() * sizeof(T)) > kept) ScratchVector<T>().swap(v);
}

}  // namespace mha::cpu

#endif  // MHA_SERVER_BACKENDS_CPU_SCRATCH_H_
