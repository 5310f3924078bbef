#!/usr/bin/env bash
# Configures (once) and builds mhaserve in build/ (Release).
#   deploy/build.sh                         everything: server, client, tests, benchmarks
#   deploy/build.sh --target mha_server ... only these targets (repeatable)
#   deploy/build.sh --log FILE              one progress line on the terminal; cmake's and the compiler's output
#                                           go to FILE (shown, its end, when the build fails)
# Other arguments go to the first cmake configure (e.g. -DMHA_WITH_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=() configure=() log=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target) targets+=(--target "$2"); shift 2 ;;
    --log) log=$2; shift 2 ;;
    *) configure+=("$1"); shift ;;
  esac
done

if [[ -z $log ]]; then
  [[ -f build/build.ninja ]] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${configure[@]}"
  exec cmake --build build "${targets[@]}"
fi

# failed WHAT: the end of the log, then exit 1.
failed() {
  echo
  echo "build: $1 failed; the last lines of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
}
if [[ ! -f build/build.ninja ]]; then
  echo "build: configuring build/ (cmake, Release)"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${configure[@]}" >>"$log" 2>&1 || failed "cmake"
fi
what="everything"
[[ ${#targets[@]} -gt 0 ]] && what=$(printf '%s ' "${targets[@]}" | sed 's/--target //g; s/ $//')
start=$SECONDS
# ninja prints "[done/total] what"; on a terminal the line is rewritten in place, elsewhere printed once.
progress() {
  local line shown=0
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$log"
    if [[ -t 1 && $line =~ ^\[([0-9]+)/([0-9]+)\] ]]; then
      printf '\rbuild: %s: step %s of %s, %d s' "$what" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" \
        $((SECONDS - start))
      shown=1
    fi
  done
  [[ $shown -eq 1 ]] && printf '\n'
  return 0
}
[[ -t 1 ]] || echo "build: building $what"
cmake --build build "${targets[@]}" 2>&1 | progress || failed "building $what"
echo "build: built $what in $((SECONDS - start)) s"
