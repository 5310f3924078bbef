"""Merges attention_bench's JSON and peers.py's lines into one table (markdown) with ratios.

Usage: report.py BENCH_JSON PEERS_JSONL
"""

import json
import sys


def main():
    bench = json.load(open(sys.argv[1]))
    peers = {}
    for line in open(sys.argv[2]):
        if line.strip():
            p = json.loads(line)
            peers[(p["shape"], p["weights"])] = p
    context = bench["context"]
    peak = float(context.get("peak_gflops", "nan"))
    print("fp32 peak at the start of the run: %.1f GFLOP/s (%s FMA chains, %s threads); BLAS for numpy/torch: %s"
          % (peak, context.get("peak_isa"), context.get("num_cpus"),
             next(iter(peers.values()))["blas"] if peers else "n/a"))
    print()
    print("Every rate is the fastest call (numpy and torch: their fastest run; the peak: the probe's fastest window, "
          "taken right before and after that row, its `peak` column). \"median\" is the median call against the "
          "same peak.")
    print()
    print("| shape (B,T,d,H,Hkv) | weights | ours GFLOP/s | peak | % of peak | median | ms | numpy | torch "
          "| ours/numpy | ours/torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    times = {}
    core = []
    rows = {}
    for b in bench["benchmarks"]:
        name = b["name"].split("/")
        shape, weights = name[0], name[1] == "weights_on"
        times[(shape, weights)] = b["ms_best"]
        rows[(shape, weights)] = b
        ours = b["GFLOPs"]
        if shape.startswith("core_"):
            core.append(b)
            continue
        if shape.startswith("proj_"):
            continue
        p = peers.get((shape, weights))
        np_g = p["numpy_gflops"] if p else float("nan")
        t_g = p["torch_gflops"] if p else float("nan")
        torch_note = "" if not p or p["torch_impl"] == "nn.MultiheadAttention" else "*"
        print("| %s | %s | %.1f | %.0f | %.0f%% | %.0f%% | %.3f | %.1f | %.1f%s | %.1fx | %.1fx |" % (
            shape, "on" if weights else "off", ours, b["peak_gflops"], b["pct_peak"], b["pct_peak_median"],
            b["ms_best"], np_g, t_g, torch_note, ours / np_g, ours / t_g))
    if core:
        print()
        print("Attention core alone (ScaledDotProductAttention: no projections; FLOPs 4BHdk times the visible query-key pairs, T(T+1)/2 for causal):")
        print()
        print("| shape | GFLOP/s | peak | % of peak | median | ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for b in core:
            print("| %s | %.1f | %.0f | %.0f%% | %.0f%% | %.3f |" % (
                b["name"].split("/")[0], b["GFLOPs"], b["peak_gflops"], b["pct_peak"], b["pct_peak_median"],
                b["ms_best"]))
    split = [(shape, rows[(shape, False)], rows[("proj_" + shape, False)], rows[("core_" + shape, False)])
             for (shape, weights) in rows
             if not weights and ("proj_" + shape, False) in rows and ("core_" + shape, False) in rows]
    if split:
        print()
        print("Where the time goes, weights off: the projections alone (the two sgemm calls the backend makes) and the "
              "attention core alone, fastest calls, against the layer's fastest call:")
        print()
        print("| shape | layer ms | projections ms | % of peak | core ms | % of peak | projections + core ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, layer, proj, core_row in split:
            print("| %s | %.3f | %.3f | %.0f%% | %.3f | %.0f%% | %.3f |" % (
                shape, layer["ms_best"], proj["ms_best"], proj["pct_peak"], core_row["ms_best"],
                core_row["pct_peak"], proj["ms_best"] + core_row["ms_best"]))
    print()
    for prefix, what in (("", "multi-head attention (projections included)"), ("core_", "attention core")):
        for shape in ("b1_t2048_d1024_h16", "b8_t512_d512_h8_gqa2"):
            base, causal = times.get((prefix + shape, False)), times.get((prefix + shape + "_causal", False))
            if base and causal:
                print("causal / non-causal time (fastest calls), %s, %s: %.2fx" % (what, shape, causal / base))
    print()
    print("torch: nn.MultiheadAttention (eval, fast path) where it can express the shape; * = the same math in "
          "plain torch ops (GQA). FLOPs: 2BTqdHdk + 4BTkdHkvdk + 2BTqHdkd + 4BHdk x visible pairs (TqTk, or T(T+1)/2 causal: AttentionFlops in proto/mha/v1/attention_shape.h).")


if __name__ == "__main__":
    main()
