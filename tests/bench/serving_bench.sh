#!/usr/bin/env bash
# Serving under load, end to end on loopback (issue 14's figures): tiny calls (demo layer, B=1, T=16) from
# `mha_client bench`, with request batching off and on, in alternating rounds; then the same tiny calls at -c 1
# and -c 2 while a second mha_server on the same cores computes large calls without pause. Prints one line per
# run; the FMA probe's peak comes from attention_bench in the same run.
#   tests/bench/serving_bench.sh [ROUNDS]      (default 3; about 20 s a round)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
bin=build/bin
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# Starts mha_server with the given flags on a free loopback port; sets $port and appends its PID to pids.
start_server() {
  local port_file="$work/port.$RANDOM"
  "$bin/mha_server" --listen 127.0.0.1:0 --port_file "$port_file" --log_level warn "$@" &
  pids+=($!)
  for _ in $(seq 100); do [[ -s $port_file ]] && break; sleep 0.05; done
  port=$(cat "$port_file")
}
stop_servers() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; pids=(); }

tiny() {  # tiny calls against $port: prints calls/s, GFLOP/s, p50 and p99
  "$bin/mha_client" bench --target "127.0.0.1:$port" --batch 1 --seq 16 "$@" --warmup 200 -O json |
    /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin); l=r["latency_ms"]; print("%8.0f calls/s %7.1f GFLOP/s p50 %6.2f ms p99 %6.2f ms" % (r["rps"], r["gflops"], l["p50"], l["p99"]))'
}

peak=$(OMP_NUM_THREADS=$(nproc) "$bin/attention_bench" --benchmark_filter=NONE 2>/dev/null | sed -n 's/^fp32 peak: \([0-9.]*\).*/\1/p')
echo "fp32 peak (FMA probe, $(nproc) threads): $peak GFLOP/s"
echo "tiny calls, 32 concurrent, 5000 calls:"
for round in $(seq "$rounds"); do
  for rows in 0 512; do
    start_server --max_batch_rows "$rows"
    printf "  round %d  batching %-4s " "$round" "$([[ $rows == 0 ]] && echo off || echo on)"
    tiny -c 32 -n 5000
    stop_servers
  done
done

echo "tiny calls next to a second mha_server computing (8,512,512) calls without pause:"
for c in 1 2; do
  start_server
  printf "  -c %d quiet  " "$c"
  tiny -c "$c" -n 2000
  first=$port
  start_server
  busy=$port
  "$bin/mha_client" bench --target "127.0.0.1:$busy" --batch 8 --seq 512 -c 2 -z 30s >/dev/null 2>&1 &
  loader=$!
  sleep 1
  port=$first
  printf "  -c %d busy   " "$c"
  tiny -c "$c" -n 2000 -z 20s
  kill "$loader" 2>/dev/null || true
  wait "$loader" 2>/dev/null || true
  stop_servers
done
