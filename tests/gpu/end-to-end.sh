#!/usr/bin/env bash
# The GPU check's end-to-end step (device-check.sh step 5): the whole layer through the gRPC server on the CUDA
# backend. Each dtype checked against the reference backend (mha_client call --check), causal with weights, then
# timed against the CPU backend with fp16 on the wire at B=8, T=512, d=512 (interleaved), with two calls in flight on
# two connections (the backend's two lanes), and through shared memory. Sessions on the CUDA backend too: the
# server's log must put the KV cache in CUDA managed memory, and mha_client decode --backend cuda --check runs head
# sessions (GQA H=32 Hkv=8 d_k=128, two layers' caches) and layer sessions (the demo layer) in bf16 caches, session
# 0's last step against a reference; tokens/s printed.
#
#   tests/gpu/end-to-end.sh SERVER CLIENT [--rehearsal]
#
# --rehearsal: SERVER is mha_server_emulated_cuda (the CUDA backend on the CPU, tests/emulated_cuda): the same
# steps at sizes the emulation runs in seconds, so that ctest (cuda_server_emulated) runs this script on every
# build and the GPU run does not find its mistakes first. Prints what it runs; the last line counts the steps that
# passed. Exit status 0 when all did. Loopback only; ends only the server it started.
set -uo pipefail
server=$1
client=$2
rehearsal=0
[[ "${3:-}" == "--rehearsal" ]] && rehearsal=1
if ((rehearsal)); then
  size=(--batch 1 --seq 32) calls=(-n 2 --warmup 1) pair_calls=(-n 4 --warmup 1)
  head_sessions=(--sessions 2 --context 40 --steps 3 --heads 4 --kv_heads 2 --head_dim 32 --num_layers 2)
  layer_sessions=(--sessions 2 --context 24 --steps 3)
else
  size=(--batch 8 --seq 512) calls=(-n 20 --warmup 3) pair_calls=(-n 40 --warmup 3)
  head_sessions=(--sessions 8 --context 1024 --steps 32 --heads 32 --kv_heads 8 --head_dim 128 --num_layers 2)
  layer_sessions=(--sessions 4 --context 512 --steps 16)
fi

work=$(mktemp -d)
"$server" --listen 127.0.0.1:0 --port_file "$work/port" --max_shared_memory_regions 4 >"$work/server.log" 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$work"' EXIT
# Up to 5 minutes: the emulated server's warm-up runs the CUDA kernels on the CPU (under ASan, 10 times slower).
for _ in $(seq 3000); do [[ -s "$work/port" ]] && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if [[ ! -s "$work/port" ]]; then
  echo "the server did not start:"; cat "$work/server.log"
  echo "end to end: 0 of 1 steps passed (no server)"
  exit 1
fi
target="127.0.0.1:$(cat "$work/port")"
passed=0 steps=0
# step NAME COMMAND...: runs it, prints its output and exit status, counts it.
step() {
  local name=$1
  shift
  echo "## $name"
  "$@"
  local status=$?
  echo "exit $status"
  steps=$((steps + 1))
  ((status == 0)) && passed=$((passed + 1))
  return 0
}
cuda_available() {
  local info
  info=$("$client" info --target "$target") || return 1
  echo "$info"
  grep -Eq '^  backend cuda +available' <<<"$info"
}
# bench ARGS...: mha_client bench, whose exit status is 0 even when calls failed (as a load generator's): passes only
# when every call was OK.
bench() {
  local report
  report=$("$client" bench --target "$target" "$@" 2>&1)
  local status=$?
  echo "$report"
  ((status == 0)) && grep -q ', errors 0)' <<<"$report"
}
# decode DTYPE ARGS...: mha_client decode --backend cuda --cache_dtype DTYPE --check: passes only when it exits 0, no
# call failed and session 0's last step matched its reference.
decode() {
  local report dtype=$1
  shift
  report=$("$client" decode --target "$target" --backend cuda --cache_dtype "$dtype" --check "$@" 2>&1)
  local status=$?
  echo "$report"
  ((status == 0)) && grep -q ' 0 errors$' <<<"$report" && grep -q '^  check .* OK$' <<<"$report"
}
# The session store's startup line (server.cc): "KV cache: N MiB in CUDA managed memory on <GPU> (device 0) ...",
# the emulated runtime's included.
kv_cache_managed() {
  grep -m1 'KV cache: ' "$work/server.log"
  grep -q 'KV cache: .* in CUDA managed memory on ' "$work/server.log"
}

step "info: the CUDA backend is available" cuda_available
step "server log: the KV cache lives in CUDA managed memory" kv_cache_managed
for dtype in fp32 fp16 bf16; do
  step "call --backend cuda --dtype $dtype --check" \
    "$client" call --target "$target" --backend cuda --dtype "$dtype" --batch 2 --seq 64 --check
done
step "call --backend cuda --dtype bf16 --causal --weights --check" \
  "$client" call --target "$target" --backend cuda --dtype bf16 --batch 2 --seq 100 --causal --weights --check
for dtype in bf16 int8 fp8_e4m3; do
  step "decode --backend cuda head sessions ${head_sessions[*]} --cache_dtype $dtype --check" \
    decode "$dtype" "${head_sessions[@]}"
done
step "decode --backend cuda --session_layers demo ${layer_sessions[*]} --cache_dtype bf16 --check" \
  decode bf16 --session_layers demo "${layer_sessions[@]}"
for backend in cuda cpu cuda cpu; do
  step "bench --backend $backend --dtype fp16 ${size[*]}" \
    bench --backend "$backend" --dtype fp16 "${size[@]}" "${calls[@]}"
done
# Two calls in flight on two connections: the CUDA backend's two lanes on the scheduler's concurrent threads, one
# call's copies overlapping the other's kernels (calls/s against the -c 1 runs above).
step "bench --backend cuda --dtype fp16 ${size[*]} -c 2 --connections 2" \
  bench --backend cuda --dtype fp16 "${size[@]}" "${pair_calls[@]}" -c 2 --connections 2
# The GPU's compute is short next to 4 MB each way through the socket: the same call with the tensors in shared
# memory shows what the wire costs.
step "bench --backend cuda --dtype fp16 ${size[*]} --shared_memory" \
  bench --backend cuda --dtype fp16 "${size[@]}" "${calls[@]}" --shared_memory

kill -TERM "$pid"
wait "$pid"
step "server stopped cleanly on SIGTERM" test $? -eq 0
trap 'rm -rf "$work"' EXIT
echo "## server log"
tail -20 "$work/server.log"
echo "end to end: $passed of $steps steps passed"
((passed == steps))
