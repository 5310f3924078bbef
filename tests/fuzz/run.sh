#!/usr/bin/env bash
# Builds the libFuzzer targets in build-fuzz/ (clang, ASan + UBSan, -DMHA_FUZZ=ON), writes their seed corpora and runs
# every target in turn (docs/FUZZING.md).
#
#   tests/fuzz/run.sh --ci            each target for a bounded time: 12 s each, about 120 s of fuzzing in all (CI)
#   tests/fuzz/run.sh --execs N       each target for N executions (by hand: --execs 1000000)
#   tests/fuzz/run.sh --seconds S     each target for S seconds
#   tests/fuzz/run.sh ... -- ARGS     ARGS go to every libFuzzer run (e.g. -- -jobs=2)
#   MHA_FUZZ_TARGETS="fuzz_npy fuzz_safetensors" tests/fuzz/run.sh --ci     only those targets
#   MHA_FUZZ_STATS=1 tests/fuzz/run.sh ...     also how many inputs parsed, passed validation and were computed
#
# Exits non-zero when any target finds a crash, a sanitizer report, a leak, a timeout (-timeout) or runs out of memory
# (-rss_limit_mb); the input is kept in build-fuzz/fuzz-artifacts/<target>/ and the command that replays it is
# printed. New coverage accumulates in build-fuzz/fuzz-corpus/<target>/ between runs; the seeds are rewritten each run
# into build-fuzz/fuzz-seeds/<target>/. Prints executions, coverage and peak memory per target at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${MHA_FUZZ_BUILD_DIR:-build-fuzz}

mode=ci
value=12
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ci) mode=ci; value=12; shift ;;
    --execs) mode=execs; value=${2:?--execs needs a count}; shift 2 ;;
    --seconds) mode=seconds; value=${2:?--seconds needs a count}; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [--ci | --execs N | --seconds S] [-- libFuzzer args]" >&2; exit 2 ;;
  esac
done

targets=(${MHA_FUZZ_TARGETS:-fuzz_tensor_codec fuzz_request_reader fuzz_npy fuzz_safetensors fuzz_load_layer_request
  fuzz_sdpa_request fuzz_extend_request fuzz_create_session fuzz_mha_request fuzz_kserve_request})

if [[ ! -f $build/build.ninja ]]; then
  # -O1: the targets run seconds each in CI, where compile time matters more than executions per second.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1" \
    -DCMAKE_CXX_COMPILER=clang++ -DMHA_FUZZ=ON \
    -DBUILD_TESTING=OFF
fi
cmake --build "$build" --target fuzz_all

rm -rf "$build/fuzz-seeds"
"$build/bin/fuzz_seeds" "$build/fuzz-seeds" >/dev/null

# The backends compute single-threaded at the sizes the targets run (fuzz_env.h); one OpenMP thread keeps it so.
export OMP_NUM_THREADS=1
# Report every UBSan finding with its stack; libFuzzer's own handler takes the signals.
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}

case "$mode" in
  ci | seconds) limit=(-max_total_time="$value") ;;
  execs) limit=(-runs="$value") ;;
esac

failed=()
summary=()
for target in "${targets[@]}"; do
  corpus=$build/fuzz-corpus/$target
  artifacts=$build/fuzz-artifacts/$target
  log=$build/fuzz-logs/$target.log
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  dict=()
  [[ -f tests/fuzz/$target.dict ]] && dict=(-dict="tests/fuzz/$target.dict")
  echo "== $target (${limit[*]})"
  start=$(date +%s)
  status=0
  "$build/bin/$target" "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "${dict[@]}" "${extra[@]}" "$corpus" "$build/fuzz-seeds/$target" >"$log" 2>&1 ||
    status=$?
  seconds=$(($(date +%s) - start))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
  cov=$({ grep -oE '^#[0-9]+[[:space:]]+[A-Za-z]+[[:space:]]+cov: [0-9]+ ft: [0-9]+' "$log" || true; } | tail -1 |
    sed -E 's/.*cov: ([0-9]+) ft: ([0-9]+)/\1 \2/')
  stats=$({ grep -o 'parsed [0-9]*, valid [0-9]*, computed [0-9]*' "$log" || true; } | tail -1)
  summary+=("$(printf '%-26s %10s %6s s %8s %8s %6s MB  %s  %s' "$target" "${execs:-?}" "$seconds" ${cov:-? ?} \
    "${rss:-?}" "$([[ $status == 0 ]] && echo ok || echo "FAILED ($status)")" "$stats")")
  if [[ $status != 0 ]]; then
    failed+=("$target")
    grep -E 'ERROR|SUMMARY|runtime error|fuzz_[a-z_]+:|Test unit written' "$log" | head -20 || true
    echo "   log: $log"
    for input in "$artifacts"/*; do
      [[ -f $input ]] && echo "   replay: $build/bin/$target $input"
    done
  fi
done

echo
printf '%-26s %10s %8s %8s %8s %9s  %s\n' target execs time cov ft "peak rss" result
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzzing found problems in: ${failed[*]}" >&2
  exit 1
fi
