#!/usr/bin/env bash
# Builds the C++ suite with sanitizers and runs it through ctest; any sanitizer report fails the run.
#   asan: ASan+UBSan (and LeakSanitizer) in build-asan/: every GoogleTest case and cli_smoke (ctest labels cpp and
#         cpp_concurrency, tests/CMakeLists.txt), and the CUDA backend emulated on the CPU (cpp_emulated, below).
#   tsan: TSan in build-tsan/: the tests labelled cpp_concurrency (server, service, scheduler, metrics, C++ client and
#         its load generator).
# Usage: tests/sanitize/run.sh [asan|tsan|all] (default all). JOBS=n sets build and test parallelism (default 2).
# Only the targets those tests need are built: no benchmarks, no Python tests. Reconfigures nothing if the build
# folder exists. Third-party libraries (gRPC, protobuf, abseil, oneDNN, libgomp) are not instrumented.
set -euo pipefail
cd "$(dirname "$0")/../.."
supp=$PWD/tests/sanitize
mode=${1:-all}
jobs=${JOBS:-2}

# The GoogleTest executables (the mha_test(...) lines of tests/CMakeLists.txt).
all_tests=$(sed -n 's/^mha_test(\([a-z_0-9]*\).*/\1/p' tests/CMakeLists.txt)
# The set(MHA_CONCURRENCY_TESTS ...) list, which may span lines.
concurrency_tests=$(sed -n '/^set(MHA_CONCURRENCY_TESTS/,/)/p' tests/CMakeLists.txt | tr '\n' ' ' |
  sed 's/^set(MHA_CONCURRENCY_TESTS\(.*\)).*/\1/')
# Excluded everywhere: it measures the process's RSS after glibc's malloc_trim, but both sanitizers replace the
# allocator (ASan also holds freed memory in quarantine), so the number says nothing about our code.
not_sanitizable='^ServingTest\.MemoryReturnsNearItsWarmLevelAfterALargeCall$'

configure() {  # configure <dir> <sanitizers>
  if [[ ! -f $1/build.ninja ]]; then
    # -O1 -g1 (asserts on): a third less compile time than -O2, and stacks with files and lines.
    cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
      -DMHA_SANITIZE="$2" -DBUILD_TESTING=ON >/dev/null
  fi
}

build() {  # build <dir> <sanitizers> <targets...>
  local dir=$1 san=$2
  shift 2
  configure "$dir" "$san"
  cmake --build "$dir" -j "$jobs" --target "$@"
}

# The CUDA backend emulated on the CPU (tests/emulated_cuda), which the ASan build has where the CUDA toolkit's
# headers are: ASan then checks the kernels' every access to device memory (exact-size host allocations) and shared
# memory, and the backend's host code.
emulated_cuda_targets() {  # emulated_cuda_targets <dir>
  # The listing is read whole first: `grep -q` would stop reading at its match, and under pipefail the SIGPIPE that
  # ninja then gets would make the test false.
  local targets
  targets=$(ninja -C "$1" -t targets all 2>/dev/null)
  if grep -q '^backend_conformance_emulated_cuda_test:' <<<"$targets"; then
    echo cuda_kernels_emulated_test cuda_paged_quant_emulated_test cuda_backend_emulated_test \
      backend_conformance_emulated_cuda_test paged_bench_emulated
  fi
}

# Under ASan the emulation runs about 10 times slower: its slowest conformance cases (the demo-sized layers, the
# bf16 cases at Tk = 600, the head_dim 128 layer, the fp32 cases at Tk = 301 and Tk = 1100, one dtype of the
# head_dim 128 core, two contract tests that repeat calls; the session cases with 600- to 2000-token prefills, a
# minute to four each) and the emulated server's rehearsal (its warm-up alone took minutes) run in the plain build
# only; every kernel variant and the backend's host paths still run here. ctest's names of parameterized cases end
# in "  # GetParam() = ...", hence the "( |$)" after a whole case name.
slow_emulated='^emulated_cuda:.*(demo_sized|bf16_core|dk16_causal_mask_lengths|sdpa_dk128_partial_tiles_masks_fp16|causal_long_keys|ScratchFromALargeCall|ConcurrentCalls|session_heads_long_cache_split_kv|session_heads_cascade_long|session_heads_decode_cache_(fp16|bf16|int8|fp8_e4m3|fp8_e5m2)(_wire(_bf16)?|_stats)?_cuda( |$)|decode_split_cache|_deep_)|^cuda_server_emulated$|^paged_bench_emulated(_cascade)?$'

run_asan() {
  configure build-asan address,undefined
  build build-asan address,undefined $all_tests mha_server mha_client $(emulated_cuda_targets build-asan)
  local options="halt_on_error=1:detect_leaks=1:strict_string_checks=1"
  export ASAN_OPTIONS="$options:detect_stack_use_after_return=1"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  # The single-threaded tests in parallel; then the serving ones alone, whose timing (admission estimates, queue
  # waits) suffers when another sanitized test takes the second core.
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -L "^cpp$"
  ctest --test-dir build-asan --output-on-failure -L cpp_concurrency -E "$not_sanitizable"
  if [[ -n $(emulated_cuda_targets build-asan) ]]; then
    # The emulated device runs every CUDA thread as a call of its own: use-after-return's fake stacks made it more
    # than twice as slow, for device code that returns no pointers (the host code is checked with it above).
    export ASAN_OPTIONS="$options:detect_stack_use_after_return=0"
    ctest --test-dir build-asan --output-on-failure -j "$jobs" -L cpp_emulated -E "$slow_emulated"
    # The paged kernels' planner paths on the emulated device: unaligned lengths, two key splits, several sessions
    # (ctest's 32 sessions take the same path as 4 and ten times as long here), sessions sharing a block (the
    # cascade kernel).
    build-asan/bin/paged_bench_emulated --shape 2:100 --shape 1:600 --shape 4:64 --cache_dtype bf16,int8 \
      --shared_prefix 32 --copy_mib 1 --reps 1
  fi
}

run_tsan() {
  build build-tsan thread $concurrency_tests
  # One OpenMP thread per team: libgomp (not instrumented) hands a parallel region's data to its pool threads
  # through its own futex barriers, which TSan cannot see, so every region of the CPU backend would be reported
  # (attention_core.cc, read by a libgomp thread of what the compute thread wrote before the region). With a
  # limit of 1 the regions run on the thread that calls them, and everything our own threads share (scheduler,
  # gRPC handlers, client streams) is still checked. The kernels' split across threads is not (ASan+UBSan and the
  # conformance tests run it with 2 threads). tsan.supp says what else is suppressed and why.
  export OMP_THREAD_LIMIT=1
  # ignore_noninstrumented_modules: memcpy, new and delete called from inside gRPC, protobuf or abseil (which
  # synchronise through atomics TSan cannot see) are not checked; our code's accesses are.
  # history_size=7 (the most): TSan keeps enough of each thread's past to restore the earlier access's stack, which
  # tsan.supp's gRPC hand-off entries match on (with the default, a report's writing stack may be "failed to
  # restore" and escape them).
  export TSAN_OPTIONS="history_size=7:halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$supp/tsan.supp"
  # In parallel: with one OpenMP thread per team the tests leave a core free (half the serial time; the admission
  # and queue timings the ASan run keeps alone hold here).
  ctest --test-dir build-tsan --output-on-failure -j "$jobs" -L cpp_concurrency -E "$not_sanitizable"
}

case $mode in
  asan) run_asan ;;
  tsan) run_tsan ;;
  # Each a command of its own: a function on the left of && runs with errexit off, so a failed ctest inside it
  # would go on, and only its last command's status would count.
  all) run_asan; run_tsan ;;
  *) echo "usage: $0 [asan|tsan|all]" >&2; exit 2 ;;
esac
