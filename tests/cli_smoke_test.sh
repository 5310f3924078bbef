#!/usr/bin/env bash
# Starts the real mha_server on a free loopback port and drives it with mha_client: health, info, a demo-layer
# call checked against the reference backend, a bad call that must fail cleanly, then SIGTERM and exit code 0.
# Usage: cli_smoke_test.sh MHA_SERVER MHA_CLIENT
set -euo pipefail
server=$1
client=$2
work=$(mktemp -d)
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then kill -KILL "$server_pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT

# --help prints the flags and exits 0, for both binaries.
"$server" --help >"$work/help" && grep -q -- "--listen" "$work/help" || { echo "mha_server --help"; exit 1; }
"$client" --help >"$work/help" && grep -q -- "--target" "$work/help" || { echo "mha_client --help"; exit 1; }

"$server" --listen 127.0.0.1:0 --port_file "$work/port" --threads 2 >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do [[ -s "$work/port" ]] && break; sleep 0.1; done
[[ -s "$work/port" ]] || { echo "server did not start"; cat "$work/server.log"; exit 1; }
target="127.0.0.1:$(cat "$work/port")"

"$client" health --target "$target" --timeout_s 5
"$client" info --target "$target" | grep -q "layer demo"
"$client" call --target "$target" --batch 2 --seq 32 --causal --key_lengths 32,5 --weights --check
"$client" call --target "$target" --seq 8 --dtype fp16 --check
if "$client" call --target "$target" --layer nope 2>"$work/err"; then
  echo "a call naming an unknown layer succeeded"; exit 1
fi
grep -q "no layer named nope" "$work/err"
"$client" health --target "$target" --timeout_s 5  # still serving

kill -TERM "$server_pid"
status=0
wait "$server_pid" || status=$?
server_pid=""
[[ $status -eq 0 ]] || { echo "server exited with $status after SIGTERM"; cat "$work/server.log"; exit 1; }
grep -q "stopped" "$work/server.log"
echo "cli smoke: 1 passed, 0 failed"
