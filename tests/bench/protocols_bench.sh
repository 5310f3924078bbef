#!/usr/bin/env bash
# The two front doors side by side (issue 37): the same MultiHeadAttention call on the demo layer through the native
# mha.v1 RPC and through KServe v2's ModelInfer, from `mha_client bench --protocol`, in alternating rounds against
# one server, at B=1 T=16 (the per-call overhead) and B=8 T=512 (bytes: 8 MiB each way). Prints each run's calls/s
# and p50, then per shape the median and best calls/s of each protocol and kserve / native.
#   tests/bench/protocols_bench.sh [ROUNDS]      (default 5; about 15 s a round)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
bin=build/bin
work=$(mktemp -d)
pid=
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

"$bin/mha_server" --listen 127.0.0.1:0 --port_file "$work/port" --log_level warn &
pid=$!
for _ in $(seq 100); do [[ -s $work/port ]] && break; sleep 0.05; done
port=$(cat "$work/port")

for round in $(seq "$rounds"); do
  for shape in "1 16 2000 200" "8 512 30 3"; do
    read -r batch seq calls warmup <<<"$shape"
    for protocol in native kserve; do
      "$bin/mha_client" bench --target "127.0.0.1:$port" --layer demo --batch "$batch" --seq "$seq" -n "$calls" \
        --warmup "$warmup" --protocol "$protocol" -O json >"$work/r$round-$batch-$protocol.json"
    done
  done
done

/usr/bin/python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
for batch, seq in ((1, 16), (8, 512)):
    rps = {}
    for protocol in ("native", "kserve"):
        runs = [json.load(open("%s/r%d-%d-%s.json" % (work, r, batch, protocol))) for r in range(1, rounds + 1)]
        for r in runs:
            assert r["count"]["errors"] == 0, r
        rps[protocol] = [r["rps"] for r in runs]
        print("B=%d T=%-4d %-6s calls/s %s  p50 ms %s" % (batch, seq, protocol,
              " ".join("%8.1f" % x for x in rps[protocol]),
              " ".join("%7.3f" % r["latency_ms"]["p50"] for r in runs)))
    med = {p: statistics.median(v) for p, v in rps.items()}
    best = {p: max(v) for p, v in rps.items()}
    print("B=%d T=%-4d median %.1f vs %.1f calls/s (kserve/native %.3f), best %.1f vs %.1f (%.3f)"
          % (batch, seq, med["native"], med["kserve"], med["kserve"] / med["native"], best["native"],
             best["kserve"], best["kserve"] / best["native"]))
PY
