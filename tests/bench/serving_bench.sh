#!/usr/bin/env bash
# Serving under load, end to end on loopback (issue 14's figures): tiny calls (demo layer, B=1, T=16) from
# `mha_client bench`, with request batching off and on, in alternating rounds; then the same tiny calls at -c 1
# and -c 2 while a second mha_server on the same cores computes large calls without pause. Prints one line per
# run, with the CPU time the server and the load generator spent per call (both share the machine's cores); the
# FMA probe's peak comes from attention_bench in the same run. Each round also measures the floor of a call:
# the same 32 concurrent calls on a layer with d_model 64 (T=16: 0.6 MFLOP, next to nothing to compute).
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

# Tiny calls against $port (the server ${pids[-1]}): prints calls/s, GFLOP/s, p50, p99, and the CPU time per call
# (warm-up calls included) of the server (/proc/PID/stat) and of mha_client (its rusage).
tiny() {
  /usr/bin/python3 - "${pids[-1]}" "$bin/mha_client" bench --target "127.0.0.1:$port" --batch 1 --seq 16 "$@" \
    --warmup 200 -O json <<'PY'
import json, os, resource, subprocess, sys
pid, cmd = sys.argv[1], sys.argv[2:]
def server_cpu_s():
    fields = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
s0 = server_cpu_s()
r = json.loads(subprocess.run(cmd, stdout=subprocess.PIPE, check=True).stdout)
server_s = server_cpu_s() - s0
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
calls = r["count"]["sent"] + r["warmup"]
l = r["latency_ms"]
print("%8.0f calls/s %7.1f GFLOP/s p50 %6.2f ms p99 %6.2f ms  CPU per call: server %4.0f us, client %4.0f us" %
      (r["rps"], r["gflops"], l["p50"], l["p99"], 1e6 * server_s / calls,
       1e6 * (usage.ru_utime + usage.ru_stime) / calls))
PY
}

# A .safetensors layer with d_model 64 and 4 heads (random weights) at $1.
write_small_layer() {
  /usr/bin/python3 - "$1" <<'PY'
import json, random, struct, sys
d, rng, tensors, blobs, offset = 64, random.Random(0), {}, [], 0
for name in ("w_q", "w_k", "w_v", "w_o"):
    data = struct.pack("<%df" % (d * d), *(rng.gauss(0, d ** -0.5) for _ in range(d * d)))
    tensors[name] = {"dtype": "F32", "shape": [d, d], "data_offsets": [offset, offset + len(data)]}
    offset += len(data)
    blobs.append(data)
tensors["__metadata__"] = {"num_heads": "4"}
header = json.dumps(tensors).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + b"".join(blobs))
PY
}

peak=$(OMP_NUM_THREADS=$(nproc) "$bin/attention_bench" --benchmark_filter=NONE 2>/dev/null | sed -n 's/^fp32 peak: \([0-9.]*\).*/\1/p')
echo "fp32 peak (FMA probe, $(nproc) threads): $peak GFLOP/s"
echo "tiny calls, 32 concurrent, 5000 calls:"
mkdir "$work/layers"
write_small_layer "$work/layers/small.safetensors"
for round in $(seq "$rounds"); do
  for rows in 0 512; do
    start_server --max_batch_rows "$rows"
    printf "  round %d  batching %-4s " "$round" "$([[ $rows == 0 ]] && echo off || echo on)"
    tiny -c 32 -n 5000
    stop_servers
  done
  start_server --layers_dir "$work/layers"
  printf "  round %d  floor (d=64)  " "$round"
  tiny -c 32 -n 20000 --layer small
  stop_servers
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
