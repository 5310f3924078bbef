#!/usr/bin/env bash
# One command for the performance table: our backend vs the machine's peak vs numpy and PyTorch, same shapes,
# same threads, one run. Writes docs/perf/*.json and prints a markdown table.
#   tests/bench/run_all.sh [--min_time SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
min_time=${2:-1}
threads=$(nproc)
# numpy and PyTorch use Debian's libblas alternative: OpenBLAS, or they run the 25x slower reference BLAS.
if ! dpkg-query -W -f='${Status}' libopenblas0-pthread 2>/dev/null | grep -q "install ok installed"; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenblas0-pthread
fi
deploy/build.sh >/dev/null
out=build/perf
mkdir -p "$out"
OMP_NUM_THREADS=$threads build/bin/attention_bench --benchmark_min_time="$min_time" \
  --benchmark_format=json --benchmark_out="$out/bench.json" --benchmark_out_format=json >/dev/null
/usr/bin/python3 tests/bench/peers.py --threads "$threads" --min_time "$min_time" > "$out/peers.jsonl"
/usr/bin/python3 tests/bench/report.py "$out/bench.json" "$out/peers.jsonl"
echo
OMP_NUM_THREADS=$threads build/bin/attention_bench --memory_case
echo
/usr/bin/python3 tests/bench/e2e.py --server build/bin/mha_server --client build/bin/mha_client
