// Linked into the test executables of a TSan build only (MHA_SANITIZE=thread, tests/CMakeLists.txt).
//
// Debian's abseil is not built with TSan, so its Mutex, CondVar and Notification synchronise through atomics and
// futexes that TSan cannot see: every field our code guards with an absl::Mutex (and every hand-off through gRPC,
// whose locks are absl::Mutex too) would be reported as a race. abseil's own TSan build annotates these operations
// (absl/base/internal/tsan_mutex_interface.h); this file adds the same annotations from outside. It defines the
// exported entry points of libabsl_synchronization; the executable's definitions take precedence over the shared
// library's for every caller (our code, gRPC, abseil itself through its PLT), annotate, and call the library's own
// through dlsym(RTLD_NEXT). As in abseil's TSan build, what happens inside the library (condition evaluation
// included) is ignored by TSan, and the mutex itself is what orders the threads.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Notification;
using absl::Time;

// The library's own definition of `symbol`: Itanium names of Debian's abseil 20220623 (inline namespace debian3).
template <typename Fn>
Fn Real(const char* symbol) {
  void* fn = dlsym(RTLD_NEXT, symbol);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s is not in the shared libraries (another abseil?)\n", symbol);
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

// What an operation does to its mutex. kRelock: a wait that releases the mutex inside the library and holds it
// again on return (Await, CondVar::Wait).
enum class Op { kLock, kTryLock, kUnlock, kRelock };

// The library calls its own entry points too (AwaitWithTimeout forwards to AwaitWithDeadline, Notification locks
// its Mutex): only the outermost call on a thread is annotated.
thread_local int depth = 0;

// Runs `call` (the library's function, returning bool, or int for void ones) annotated as `op` on `mu`; `flags` is
// __tsan_mutex_read_lock for reader locks, else 0.
template <typename Call>
auto Annotated(Op op, Mutex* mu, unsigned flags, Call call) {
  struct Nesting {
    Nesting() { ++depth; }
    ~Nesting() { --depth; }
  } nesting;
  if (depth > 1) return call();
  const bool unlocks = op == Op::kUnlock || op == Op::kRelock;
  if (op == Op::kTryLock) flags |= __tsan_mutex_try_lock;
  if (unlocks) {
    __tsan_mutex_pre_unlock(mu, flags);
  } else {
    __tsan_mutex_pre_lock(mu, flags);
  }
  const auto result = call();
  if (unlocks) __tsan_mutex_post_unlock(mu, flags);
  if (op == Op::kRelock) __tsan_mutex_pre_lock(mu, flags);
  if (op != Op::kUnlock) {
    __tsan_mutex_post_lock(mu, flags | (op == Op::kTryLock && !result ? __tsan_mutex_try_lock_failed : 0), 0);
  }
  return result;
}

// Notification publishes through its flag (the member after the Mutex): Notify releases it, and both a waiter and
// the inline HasBeenNotified (an acquire load in our instrumented code) acquire it.
static_assert(sizeof(Notification) == sizeof(Mutex) + 8, "Notification is a Mutex and its flag");
void* Flag(const Notification* n) { return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(Mutex)); }

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex4LockEv");
  Annotated(Op::kLock, this, 0, [&] { return real(this), 0; });
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex10ReaderLockEv");
  Annotated(Op::kLock, this, __tsan_mutex_read_lock, [&] { return real(this), 0; });
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex7TryLockEv");
  return Annotated(Op::kTryLock, this, 0, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex13ReaderTryLockEv");
  return Annotated(Op::kTryLock, this, __tsan_mutex_read_lock, [&] { return real(this); });
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex6UnlockEv");
  Annotated(Op::kUnlock, this, 0, [&] { return real(this), 0; });
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex12ReaderUnlockEv");
  Annotated(Op::kUnlock, this, __tsan_mutex_read_lock, [&] { return real(this), 0; });
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  Annotated(Op::kLock, this, 0, [&] { return real(this, cond), 0; });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Annotated(Op::kLock, this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Annotated(Op::kLock, this, 0, [&] { return real(this, cond, deadline); });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Annotated(Op::kLock, this, __tsan_mutex_read_lock, [&] { return real(this, cond), 0; });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Annotated(Op::kLock, this, __tsan_mutex_read_lock, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Annotated(Op::kLock, this, __tsan_mutex_read_lock, [&] { return real(this, cond, deadline); });
}

// Await under a reader lock is not annotated as such: nothing here awaits with a reader lock.
void Mutex::Await(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  Annotated(Op::kRelock, this, 0, [&] { return real(this, cond), 0; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Annotated(Op::kRelock, this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Annotated(Op::kRelock, this, 0, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  Annotated(Op::kRelock, mu, 0, [&] { return real(this, mu), 0; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return Annotated(Op::kRelock, mu, 0, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Annotated(Op::kRelock, mu, 0, [&] { return real(this, mu, deadline); });
}

// Notification's own Mutex operations happen inside these calls, so they are not annotated (depth > 0); the flag
// carries the happens-before edge instead.
void Notification::Notify() {
  static const auto real = Real<void (*)(Notification*)>("_ZN4absl7debian312Notification6NotifyEv");
  __tsan_release(Flag(this));
  ++depth;
  real(this);
  --depth;
}

void Notification::WaitForNotification() const {
  static const auto real =
      Real<void (*)(const Notification*)>("_ZNK4absl7debian312Notification19WaitForNotificationEv");
  ++depth;
  real(this);
  --depth;
  __tsan_acquire(Flag(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const auto real = Real<bool (*)(const Notification*, Duration)>(
      "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  ++depth;
  const bool notified = real(this, timeout);
  --depth;
  if (notified) __tsan_acquire(Flag(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const auto real = Real<bool (*)(const Notification*, Time)>(
      "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  ++depth;
  const bool notified = real(this, deadline);
  --depth;
  if (notified) __tsan_acquire(Flag(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
