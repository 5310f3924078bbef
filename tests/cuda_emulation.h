// Runs CUDA device code on the host, for tests on machines without a GPU. Each CUDA thread of a block is a fiber on the
// calling thread (its own stack, entered with ucontext, switched with __builtin_setjmp/longjmp), blocks run one after
// another, and `__shared__` arrays are static (the running block owns them). A fiber runs until it reaches
// __syncthreads, __syncwarp or a warp-wide instruction, and the lowest-numbered thread that can go on goes next, so
// threads and warps run as far ahead of the others as the code lets them: a read of shared memory that lacks its
// barrier sees what was there before, not what another warp was to write. The warp-wide instructions the kernels use
// are computed from their definitions in NVIDIA's PTX ISA: mma.sync.aligned.m16n8k16.row.col (bf16 or fp16 inputs, fp32
// accumulators, the fragment layouts), ldmatrix.sync.aligned.m8n8.x4 (plain and .trans), shuffles; and cp.async, whose
// copies land at the thread's wait_group, not before. What this cannot show: speed, the hardware's order of
// accumulation, and races between threads that do not meet at a barrier (they run one after another here).
//
// Under ASan the switches between stacks are announced to it, so that it checks the kernels' accesses to global and
// `__shared__` memory as it checks any code's.
//
// Define MHA_CUDA_EMULATION and include this before the kernels' header. Not thread-safe: one Launch at a time.
#ifndef MHA_TESTS_CUDA_EMULATION_H_
#define MHA_TESTS_CUDA_EMULATION_H_

#ifndef MHA_CUDA_EMULATION
#error "define MHA_CUDA_EMULATION before including tests/cuda_emulation.h"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#include <vector_functions.h>
#include <vector_types.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "proto/mha/v1/tensor_codec.h"

// The CUDA host headers define the space qualifiers as nothing for a host compiler; here shared arrays must be
// shared by the block's threads.
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

// The built-in variables of the running fiber.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace mha {
namespace emulation {

// One block's fibers and what they wait for.
class Block {
 public:
  static constexpr size_t kStackBytes = 256 * 1024;

  // Runs `body` once per thread of a block of `threads` (a multiple of 32). Returns an empty string, or why the
  // block could not finish (its threads wait at barriers that never complete).
  std::string Run(unsigned threads, const std::function<void()>& body) {
    body_ = &body;
    fibers_.clear();
    fibers_.resize(threads);
    warps_.assign((threads + 31) / 32, Warp());
    for (unsigned w = 0; w < warps_.size(); ++w) warps_[w].live = threads - 32 * w < 32 ? threads - 32 * w : 32;
    live_ = threads;
    lowest_ = 0;
    block_barrier_ = Barrier();
    if (stacks_.size() < threads) stacks_.resize(threads);  // kept from block to block of a launch
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = fibers_[t];
      if (stacks_[t] == nullptr) stacks_[t] = std::make_unique<char[]>(kStackBytes);
#if defined(__SANITIZE_ADDRESS__)
      // A block that deadlocked left its fibers' frames (and ASan's poisoned redzones in them) on these stacks.
      if (abandoned_) ASAN_UNPOISON_MEMORY_REGION(stacks_[t].get(), kStackBytes);
#endif
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stacks_[t].get();
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = nullptr;  // the body never returns: Trampoline jumps back to the scheduler
      makecontext(&f.context, &Block::Trampoline, 0);
    }
    // Always the lowest runnable thread next: warp 0 runs through its warp-wide steps as far as it can before warp
    // 1 starts, so that the warps drift as far apart as the code allows and a missing __syncthreads shows. No thread
    // below lowest_ can run (the search starts there; a completed barrier moves it down to its first thread).
    abandoned_ = false;
    for (;;) {
      if (live_ == 0) return "";
      unsigned next = lowest_;
      while (next < threads && (fibers_[next].finished_body || !Runnable(next))) ++next;
      if (next == threads) {
        abandoned_ = true;
        return "deadlock: every live thread waits at a barrier that cannot complete";
      }
      lowest_ = next;
      current_ = next;
      threadIdx = make_uint3(next, 0, 0);
      Resume(fibers_[next]);
    }
  }

  // __syncthreads: every thread of the block that has not exited.
  void SyncThreads() { Wait(&block_barrier_, live_, 0); }
  // __syncwarp (full mask): the warp's threads that have not exited.
  void SyncWarp() { Wait(&warps_[current_ / 32].barrier, warps_[current_ / 32].live, current_ / 32 * 32); }

  // The exchange behind the warp-wide instructions: each lane of this thread's warp gives `value` (trivially
  // copyable) and gets all 32 lanes' values, indexed by lane, once every lane has given its own.
  template <typename Value>
  std::array<Value, 32> Exchange(const Value& value) {
    Warp& warp = warps_[current_ / 32];
    auto& slots = warp.slots;
    if (slots.size() < 32 * sizeof(Value)) slots.resize(32 * sizeof(Value));
    std::memcpy(slots.data() + (current_ % 32) * sizeof(Value), &value, sizeof(Value));
    SyncWarp();
    std::array<Value, 32> all;
    std::memcpy(all.data(), slots.data(), 32 * sizeof(Value));
    SyncWarp();  // nobody overwrites the slots before every lane has read them
    return all;
  }

  unsigned lane() const { return current_ % 32; }

  // cp.async: the copy waits in this thread's list until WaitCopies.
  void CopyAsync(void* to, const void* from, size_t bytes) {
    Fiber& f = fibers_[current_];
    f.pending.push_back({to, from, bytes});
  }
  void WaitCopies() {
    Fiber& f = fibers_[current_];
    for (const Copy& c : f.pending) std::memcpy(c.to, c.from, c.bytes);
    f.pending.clear();
  }

  static Block*& Current() {
    static Block* block = nullptr;
    return block;
  }

 private:
  struct Barrier {
    uint64_t generation = 0;
    unsigned arrived = 0;
  };
  struct Warp {
    Barrier barrier;
    std::vector<char> slots;
    unsigned live = 0;  // lanes that have not exited
  };
  struct Copy {
    void* to;
    const void* from;
    size_t bytes;
  };

  // A context switch: __builtin_setjmp saved `buffer` (stack, frame and resume address; the compiler spills every
  // other register around the setjmp). Unlike swapcontext it makes no system call for the signal mask, which took
  // three quarters of the emulation's time. Not inlined: GCC forbids the longjmp in the setjmp's own function.
  [[gnu::noinline]] static void Jump(void** buffer) { __builtin_longjmp(buffer, 1); }

  struct Fiber {
    ucontext_t context;  // where the fiber starts (Trampoline on its stack)
    void* resume[5];     // where it goes on after a switch
    bool entered = false;
    void* fake_stack = nullptr;  // ASan's, while the fiber is switched out
    bool finished_body = false;
    const Barrier* waiting = nullptr;  // null: runnable
    uint64_t waiting_generation = 0;
    std::vector<Copy> pending;
  };

  // Runs fiber `f` until it waits or finishes. Nothing after the setjmp reads a local: the jump back may have
  // clobbered them.
  [[gnu::noinline]] void Resume(Fiber& f) {
    if (__builtin_setjmp(scheduler_) == 0) {
      StartSwitch(&scheduler_fake_stack_, stacks_[current_].get(), kStackBytes);
      if (!f.entered) {
        f.entered = true;
        setcontext(&f.context);  // onto the fiber's own stack, the first time
      }
      Jump(f.resume);
    }
    FinishSwitch(Current()->scheduler_fake_stack_, nullptr, nullptr);
  }

  static void Trampoline() {
    Block* block = Current();
    block->FinishSwitch(nullptr, &block->scheduler_bottom_, &block->scheduler_size_);
    (*block->body_)();
    block->fibers_[block->current_].finished_body = true;
    --block->live_;
    --block->warps_[block->current_ / 32].live;
    block->StartSwitch(nullptr, block->scheduler_bottom_, block->scheduler_size_);  // this fiber is done
    Jump(block->scheduler_);
  }

  // ASan follows the switches between the scheduler's stack and the fibers' (__sanitizer_*_switch_fiber: its
  // fake stacks, and its idea of the current stack's bounds); without ASan these do nothing.
  void StartSwitch(void** fake_stack, const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#else
    (void)fake_stack, (void)bottom, (void)size;
#endif
  }
  void FinishSwitch(void* fake_stack, const void** from_bottom, size_t* from_size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, from_bottom, from_size);
#else
    (void)fake_stack, (void)from_bottom, (void)from_size;
#endif
  }

  bool Runnable(unsigned t) const {
    const Fiber& f = fibers_[t];
    return f.waiting == nullptr || f.waiting->generation != f.waiting_generation;
  }

  // Arrives at `barrier` of `participants` threads, the first of them `first`, and returns once it has completed.
  void Wait(Barrier* barrier, unsigned participants, unsigned first) {
    Fiber& f = fibers_[current_];
    if (++barrier->arrived == participants) {
      barrier->arrived = 0;
      ++barrier->generation;
      if (first < lowest_) lowest_ = first;  // its waiters may run again
      return;
    }
    f.waiting = barrier;
    f.waiting_generation = barrier->generation;
    if (__builtin_setjmp(f.resume) == 0) {
      StartSwitch(&f.fake_stack, scheduler_bottom_, scheduler_size_);
      Jump(scheduler_);  // back when the barrier's generation has moved on
    }
    // current_ is this fiber again; `f` may not have survived the jump.
    FinishSwitch(fibers_[current_].fake_stack, &scheduler_bottom_, &scheduler_size_);
    fibers_[current_].waiting = nullptr;
  }

  const std::function<void()>* body_ = nullptr;
  std::vector<Fiber> fibers_;
  std::vector<std::unique_ptr<char[]>> stacks_;
  std::vector<Warp> warps_;
  unsigned live_ = 0;    // threads that have not exited
  unsigned lowest_ = 0;  // no thread below it can run
  Barrier block_barrier_;
  void* scheduler_[5];
  void* scheduler_fake_stack_ = nullptr;  // ASan's, while a fiber runs
  const void* scheduler_bottom_ = nullptr;
  size_t scheduler_size_ = 0;
  bool abandoned_ = false;  // the last block deadlocked
  unsigned current_ = 0;
};

// Runs `kernel(args...)` over `grid` blocks of `threads`, blocks one after another. Returns "" or why a block could
// not finish.
template <typename... Args>
std::string Launch(void (*kernel)(Args...), dim3 grid, unsigned threads, Args... args) {
  Block block;
  Block::Current() = &block;
  gridDim = grid;
  blockDim = dim3(threads);
  const std::function<void()> body = [&] { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        std::string error = block.Run(threads, body);
        if (!error.empty()) {
          Block::Current() = nullptr;
          return error;
        }
      }
    }
  }
  Block::Current() = nullptr;
  return "";
}

// A 16-bit element of a register: the lower address in the low half.
inline uint16_t Half(uint32_t reg, int high) { return static_cast<uint16_t>(high ? reg >> 16 : reg & 0xffff); }

// A 16-bit element's value (the codec's conversions, independent of CUDA's types).
template <typename T>
float Widen(uint16_t bits) {
  return std::is_same_v<T, __half> ? HalfToFloat(bits) : Bf16ToFloat(bits);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, from the PTX ISA's fragment layouts: with
// g = lane / 4 and t = lane % 4, register i of A holds row g (i = 0, 2) or g + 8 (i = 1, 3), columns 2t, 2t + 1,
// plus 8 for i = 2, 3; register i of B holds rows (k) 2t, 2t + 1, plus 8 for i = 1, of column (n) g; C's c0, c1 are
// row g, columns 2t, 2t + 1, and c2, c3 row g + 8. Products and sums in fp32.
template <typename T>
void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct Fragments {
    uint32_t a[4], b[2];
  };
  Fragments mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  const std::array<Fragments, 32> all = Block::Current()->Exchange(mine);
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i % 2) * 8, col = 2 * t + (i / 2) * 8;
      A[row][col] = Widen<T>(Half(all[lane].a[i], 0));
      A[row][col + 1] = Widen<T>(Half(all[lane].a[i], 1));
    }
    for (int i = 0; i < 2; ++i) {
      const int row = 2 * t + i * 8;
      B[row][g] = Widen<T>(Half(all[lane].b[i], 0));
      B[row + 1][g] = Widen<T>(Half(all[lane].b[i], 1));
    }
  }
  const int lane = static_cast<int>(Block::Current()->lane()), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i / 2) * 8, col = 2 * t + (i % 2);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    c[i] += sum;
  }
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane i gives the address of row i % 8 of matrix i / 8; lane l receives
// in r[j] row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j, or with .trans rows 2 (l % 4) and
// 2 (l % 4) + 1 of column l / 4.
inline void LoadMatrix(uint32_t (&r)[4], const void* shared, bool transposed) {
  const std::array<const char*, 32> rows = Block::Current()->Exchange(static_cast<const char*>(shared));
  const int lane = static_cast<int>(Block::Current()->lane());
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!transposed) {
      std::memcpy(&lo, rows[8 * j + lane / 4] + 2 * (2 * (lane % 4)), 2);
      std::memcpy(&hi, rows[8 * j + lane / 4] + 2 * (2 * (lane % 4) + 1), 2);
    } else {
      std::memcpy(&lo, rows[8 * j + 2 * (lane % 4)] + 2 * (lane / 4), 2);
      std::memcpy(&hi, rows[8 * j + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
    }
    r[j] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
  }
}

}  // namespace emulation
}  // namespace mha

inline void __syncthreads() { mha::emulation::Block::Current()->SyncThreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { mha::emulation::Block::Current()->SyncWarp(); }
inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  const std::array<float, 32> all = mha::emulation::Block::Current()->Exchange(value);
  return all[mha::emulation::Block::Current()->lane() ^ static_cast<unsigned>(lane_mask)];
}
inline float __shfl_sync(unsigned, float value, int src_lane) {
  const std::array<float, 32> all = mha::emulation::Block::Current()->Exchange(value);
  return all[static_cast<unsigned>(src_lane) % 32];
}

// What attention_kernels.cuh leaves out under MHA_CUDA_EMULATION: its inline PTX, one function each.
namespace mha {
namespace cuda {
namespace device {
inline void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::Mma<__nv_bfloat16>(c, a, b0, b1);
}
inline void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::Mma<__half>(c, a, b0, b1);
}
inline void LoadMatrices(uint32_t (&r)[4], const void* shared) { emulation::LoadMatrix(r, shared, false); }
inline void LoadMatricesTransposed(uint32_t (&r)[4], const void* shared) { emulation::LoadMatrix(r, shared, true); }
inline void CopyAsync16(void* shared, const void* global) {
  emulation::Block::Current()->CopyAsync(shared, global, 16);
}
inline void CommitCopies() {}
inline void WaitCopies() { emulation::Block::Current()->WaitCopies(); }
}  // namespace device
}  // namespace cuda
}  // namespace mha

#endif  // MHA_TESTS_CUDA_EMULATION_H_
