#!/usr/bin/env bash
# One command for the performance tables: our backend against the machine's fp32 peak and against what a user would
# run instead (numpy, PyTorch 2, ONNX Runtime, OpenVINO), same shapes, same threads, in interleaved rounds of one
# run. Builds, makes the peers' virtual environment on first use (tests/bench/peers-env.sh), writes build/perf/ and
# prints markdown tables.
#   tests/bench/run_all.sh [--min_time SECONDS] [--rounds N]      (defaults 0.5 and 3: 20-30 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
min_time=0.5
rounds=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --min_time) min_time=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: $0 [--min_time SECONDS] [--rounds N]" >&2; exit 2 ;;
  esac
done
threads=$(nproc)
deploy/build.sh >/dev/null
peers_python=$(tests/bench/peers-env.sh | tail -1)
out=build/perf
mkdir -p "$out"
rm -f "$out"/bench.*.json "$out/peers.jsonl" "$out/peers.stderr"
# Each round: our backend on attention_bench's table, ours through the server on the other shapes, then the peers;
# each in its own process (no thread pool of one outlives it), each with the FMA probe next to its rows.
for round in $(seq "$rounds"); do
  echo "round $round of $rounds" >&2
  OMP_NUM_THREADS=$threads build/bin/attention_bench --benchmark_min_time="$min_time" \
    --benchmark_format=json --benchmark_out="$out/bench.$round.json" --benchmark_out_format=json >/dev/null
  /usr/bin/python3 tests/bench/server_shapes.py --threads "$threads" --min_time "$min_time" --round "$round" \
    --probe build/bin/attention_bench >>"$out/peers.jsonl"
  "$peers_python" tests/bench/peers.py --threads "$threads" --min_time "$min_time" --round "$round" \
    --probe build/bin/attention_bench >>"$out/peers.jsonl" 2>>"$out/peers.stderr"
done
echo "CPU: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-); flags: $(grep -m1 '^flags' /proc/cpuinfo |
  grep -o -w -E 'fma|avx2|avx512[a-z0-9_]*|amx[a-z0-9_]*' | sort -u | tr '\n' ' ')"
/usr/bin/python3 tests/bench/report.py --peers "$out/peers.jsonl" "$out"/bench.*.json
echo
OMP_NUM_THREADS=$threads build/bin/attention_bench --memory_case
echo
/usr/bin/python3 tests/bench/e2e.py --server build/bin/mha_server --client build/bin/mha_client
