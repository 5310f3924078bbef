#!/usr/bin/env bash
# Starts the real mha_server on a free loopback port and drives it with mha_client: health, info, a demo-layer
# call checked against the reference backend, a bad call that must fail cleanly, then SIGTERM and exit code 0.
# Usage: cli_smoke_test.sh MHA_SERVER MHA_CLIENT
set -euo pipefail
server=$1
client=$2
source "$(dirname "$0")/server_lib.sh"

# --help prints the flags and exits 0, for both binaries.
"$server" --help >"$work/help" && grep -q -- "--listen" "$work/help" || { echo "mha_server --help"; exit 1; }
"$client" --help >"$work/help" && grep -q -- "--target" "$work/help" || { echo "mha_client --help"; exit 1; }

start_server "$server"

"$client" health --target "$target" --timeout_s 5
"$client" info --target "$target" >"$work/info"
grep -q "layer demo" "$work/info"
grep -q "session caches: fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2" "$work/info"
"$client" call --target "$target" --batch 2 --seq 32 --causal --key_lengths 32,5 --weights --check
"$client" call --target "$target" --seq 8 --dtype fp16 --check
if "$client" call --target "$target" --layer nope 2>"$work/err"; then
  echo "a call naming an unknown layer succeeded"; exit 1
fi
grep -q "no layer named nope" "$work/err"
"$client" health --target "$target" --timeout_s 5  # still serving

stop_server
grep -q "stopped" "$work/server.log"
echo "cli smoke: 1 passed, 0 failed"
