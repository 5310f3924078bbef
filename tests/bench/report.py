"""Merges attention_bench's JSON (one file per round) and the peers' lines (peers.py and server_shapes.py, every
round) into markdown tables with ratios.

Across rounds, a rate's "best" is the fastest call of any round and its "median" the median of the rounds' median
calls. Each row carries the FMA probe read right around it; a round whose probe read under QUIET of the run's highest
reading (another job had part of the cores) is left out of that row, unless every round of it was disturbed (then
all are kept and the cell is starred). "% of peak" is the best rate against the highest probe reading of the rounds
kept; its median, the median of each kept round's median call against that round's probe. Ours on attention_bench's
shapes comes from attention_bench, on the others from server_shapes.py (peer "ours_server").

Usage: report.py --peers PEERS_JSONL BENCH_JSON [BENCH_JSON ...]
"""

import argparse
import collections
import json
import statistics

PEER_ORDER = ["numpy", "torch_sdpa", "torch_mha", "ort_attention", "ort_gqa", "ort_fused", "openvino"]
QUIET = 0.8


def aggregate(rows, run_peak):
    """rows: per-round dicts with gflops, gflops_median, ms_best, peak. Returns one dict over the rounds kept."""
    kept = [r for r in rows if r["peak"] and r["peak"] >= QUIET * run_peak] or rows
    peaks = [r["peak"] for r in kept if r["peak"]]
    pct_median = [100 * r["gflops_median"] / r["peak"] for r in kept if r["peak"]]
    best = max(r["gflops"] for r in kept)
    return {"gflops": best,
            "gflops_median": statistics.median(r["gflops_median"] for r in kept),
            "ms_best": min(r["ms_best"] for r in kept),
            "peak": max(peaks, default=float("nan")),
            "pct": 100 * best / max(peaks) if peaks else float("nan"),
            "pct_median": statistics.median(pct_median) if pct_median else float("nan"),
            "rounds": len(rows), "kept": len(kept) if kept is not rows else 0}


def star(row):
    return "*" if row["kept"] == 0 else ""


def load_bench(paths):
    """attention_bench's rows per round, by (shape, case): the fp32 layer, core_ and proj_ rows by (shape, weights
    on?), the bf16 rows by (shape, "bf16_path" / "fp32_path" / "matmul"); and the rounds' first probes."""
    rows, first_peaks, context = collections.defaultdict(list), [], {}
    for path in paths:
        bench = json.load(open(path))
        context = bench["context"]
        first_peaks.append(float(context.get("peak_gflops", "nan")))
        for b in bench["benchmarks"]:
            if b.get("error_occurred"):  # skipped: e.g. a bf16 row on a CPU without native bf16
                continue
            shape, case = (b["name"].split("/") + [""])[:2]  # "shape/case/real_time" or "shape/real_time"
            if shape.startswith("bf16_matmul_"):
                key = (shape, "matmul")
            elif shape.startswith("bf16_"):
                key = (shape, case)
            else:
                key = (shape, case == "weights_on")
            rows[key].append({"gflops": b["GFLOPs"], "gflops_median": b["GFLOPs_median"], "ms_best": b["ms_best"],
                              "peak": b["peak_gflops"]})
    return rows, first_peaks, context


def load_peers(path):
    """Peer rows by (shape, weights, peer), aggregated; n/a reasons by (shape, weights, peer); the header."""
    rows, na, impl, header = collections.defaultdict(list), {}, {}, None
    shapes = []
    for line in open(path):
        if not line.strip():
            continue
        p = json.loads(line)
        if p.get("peer") == "ours":  # server_shapes.py's name for it before the calibration rows came
            p["peer"] = "ours_server"
        if "versions" in p:
            header = header or p
            continue
        key = (p["shape"], p["weights"], p["peer"])
        if p["peer"] != "ours_server" and (p["shape"], p["weights"]) not in shapes:
            shapes.append((p["shape"], p["weights"]))  # in peers.py's order
        if "na" in p:
            na[key] = p["na"]
            continue
        impl[p["peer"]] = p["impl"]
        rows[key].append({"gflops": p["gflops"], "gflops_median": p["gflops_median"], "ms_best": p["ms_best"],
                          "peak": p.get("peak_gflops"), "max_err": p.get("max_err")})
    return rows, na, impl, header, shapes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", required=True)
    parser.add_argument("bench", nargs="+")
    args = parser.parse_args()
    bench_rows, first_peaks, context = load_bench(args.bench)
    peer_rows, na, impl, header, peer_shapes = load_peers(args.peers)
    rounds = len(args.bench)
    run_peak = max(r["peak"] or 0 for rows in list(bench_rows.values()) + list(peer_rows.values()) for r in rows)
    all_bench = {key: aggregate(r, run_peak) for key, r in bench_rows.items()}
    bench = {key: b for key, b in all_bench.items() if not key[0].startswith("bf16_")}
    peers = {}
    for key, r in peer_rows.items():
        peers[key] = aggregate(r, run_peak)
        errs = [x["max_err"] for x in r if x["max_err"] is not None]
        peers[key]["max_err"] = max(errs) if errs else None
    measured = list(bench.values()) + list(peers.values())

    print("fp32 peak (FMA probe, %s chains, %s threads) at the start of each of the %d rounds: %s GFLOP/s" % (
        context.get("peak_isa"), context.get("num_cpus"), rounds, ", ".join("%.0f" % p for p in first_peaks)))
    if header:
        print("Peers: %s, %d threads; CPU: %s" % (
            ", ".join("%s %s" % kv for kv in header["versions"].items()), header["threads"], header["cpu"]))
    print()
    def left_out(rows):
        return sum(m["rounds"] - m["kept"] for m in rows if m["kept"]), sum(m["rounds"] for m in rows)
    print("Every rate: best = the fastest call of the rounds kept; median = the median of those rounds' median calls. "
          "The FMA probe runs right before and after each row (attention_bench) or shape (peers, server_shapes.py); "
          "a round whose probe read under %.0f%% of the run's highest reading (%.0f GFLOP/s) is left out of that row "
          "(another job had part of the cores): %d of %d row-rounds of ours, %d of %d of the peers. * = every round "
          "of that row read under it (all kept). %% of peak: the best rate against the highest probe reading of the "
          "rounds kept; its median: each kept round's median call against that round's probe." % (
              (100 * QUIET, run_peak) + left_out(bench.values()) + left_out(peers.values())))
    print()
    print("| shape (B,T,d,H,Hkv) | weights | ours GFLOP/s | peak | % of peak | median | ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for (shape, weights), b in bench.items():
        if shape.startswith(("core_", "proj_")):
            continue
        print("| %s | %s | %.1f%s | %.0f | %.0f%% | %.0f%% | %.3f |" % (
            shape, "on" if weights else "off", b["gflops"], star(b), b["peak"], b["pct"], b["pct_median"],
            b["ms_best"]))

    if peer_shapes:
        present = [p for p in PEER_ORDER if any(k[2] == p for k in list(peers) + list(na))]
        print()
        print("Ours against the peers, GFLOP/s, best / median (n/a: the peer cannot express the case, see below):")
        print()
        print("| shape | weights | ours | " + " | ".join(present) + " |")
        print("| --- | --- | ---: | " + " | ".join("---:" for _ in present) + " |")
        ratios = []
        for shape, weights in peer_shapes:
            if all(k != (shape, weights) for k in bench) and (shape, weights, "ours_server") not in peers:
                continue  # a calibration-only row, or a shape left out of this run
            ours = bench.get((shape, weights)) or peers.get((shape, weights, "ours_server"))
            cells = []
            for p in present:
                r = peers.get((shape, weights, p))
                cells.append("%.1f / %.1f%s" % (r["gflops"], r["gflops_median"], star(r)) if r else
                             "n/a" if (shape, weights, p) in na else "")
            print("| %s | %s | %s%s | %s |" % (
                shape, "on" if weights else "off",
                "%.1f / %.1f%s" % (ours["gflops"], ours["gflops_median"], star(ours)) if ours else "",
                "" if (shape, weights) in bench else " (s)", " | ".join(cells)))
            timed = [(peers[(shape, weights, p)], p) for p in present if (shape, weights, p) in peers]
            if ours and timed:
                fastest, name = max(timed, key=lambda t: t[0]["gflops"])
                fastest_median = max(t[0]["gflops_median"] for t in timed)
                ratios.append((shape, weights, ours, fastest, name, fastest_median))
        print()
        print("Shares of the FMA peak (best, median) and ours against the fastest peer of each shape (best against "
              "best; median against the highest peer median):")
        print()
        print("| shape | weights | ours % of peak | fastest peer | its % of peak | ours / fastest (best) "
              "| (median) |")
        print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
        for shape, weights, ours, fastest, name, fastest_median in ratios:
            print("| %s | %s | %.0f%% / %.0f%% | %s | %.0f%% / %.0f%% | %.2fx | %.2fx |" % (
                shape, "on" if weights else "off", ours["pct"], ours["pct_median"], name, fastest["pct"],
                fastest["pct_median"], ours["gflops"] / fastest["gflops"], ours["gflops_median"] / fastest_median))
        print()
        print("Peers, as run:")
        print()
        for p in present:
            reasons = sorted(set(why for (s, w, q), why in na.items() if q == p))
            errs = [r["max_err"] for (s, w, q), r in peers.items() if q == p and r["max_err"] is not None]
            print("- %s: %s%s%s" % (p, impl.get(p, ""),
                                    "; max |diff| from the float64 reference %.1e" % max(errs) if errs else "",
                                    "; n/a: " + "; ".join(reasons) if reasons else ""))
        if "ours_server" in impl:
            print("- ours: attention_bench (the backend alone, buffers reused); (s): %s "
                  "(tests/bench/server_shapes.py), on the shapes attention_bench lacks" % impl["ours_server"])
            for (shape, weights), b in bench.items():
                server = peers.get((shape, weights, "ours_server"))
                if server:
                    print("- the same calls through the server, on a shape attention_bench has: %s, %.2fx (best) and "
                          "%.2fx (median) attention_bench's rate" % (
                              shape, server["gflops"] / b["gflops"], server["gflops_median"] / b["gflops_median"]))

    core = [(s, b) for (s, w), b in bench.items() if s.startswith("core_")]
    if core:
        print()
        print("Attention core alone (ScaledDotProductAttention: no projections; FLOPs 4BHdk times the visible "
              "query-key pairs, T(T+1)/2 for causal):")
        print()
        print("| shape | GFLOP/s | peak | % of peak | median | ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for shape, b in core:
            print("| %s | %.1f | %.0f | %.0f%% | %.0f%% | %.3f |" % (
                shape, b["gflops"], b["peak"], b["pct"], b["pct_median"], b["ms_best"]))
    split = [(s, bench[(s, False)], bench[("proj_" + s, False)], bench[("core_" + s, False)])
             for (s, w) in bench if not w and ("proj_" + s, False) in bench and ("core_" + s, False) in bench]
    if split:
        print()
        print("Where the time goes, weights off: the projections alone (the two sgemm calls the backend makes) and "
              "the attention core alone, fastest calls, against the layer's fastest call:")
        print()
        print("| shape | layer ms | projections ms | % of peak | core ms | % of peak | projections + core ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, layer, proj, core_row in split:
            print("| %s | %.3f | %.3f | %.0f%% | %.3f | %.0f%% | %.3f |" % (
                shape, layer["ms_best"], proj["ms_best"], proj["pct"], core_row["ms_best"], core_row["pct"],
                proj["ms_best"] + core_row["ms_best"]))
    print()
    for prefix, what in (("", "multi-head attention (projections included)"), ("core_", "attention core")):
        for shape in ("b1_t2048_d1024_h16", "b8_t512_d512_h8_gqa2"):
            base, causal = bench.get((prefix + shape, False)), bench.get((prefix + shape + "_causal", False))
            if base and causal:
                print("causal / non-causal time (fastest calls), %s, %s: %.2fx" % (
                    what, shape, causal["ms_best"] / base["ms_best"]))
    bf16 = [(key[0][len("bf16_"):], b, all_bench.get((key[0], "fp32_path")),
             all_bench.get(("bf16_matmul_" + key[0][len("bf16_"):], "matmul")), all_bench.get((key[0], "fp32_core")))
            for key, b in all_bench.items() if key[1] == "bf16_path"]
    if bf16:
        print()
        print("bf16 requests (bf16 in and out, weights off): the bf16 path against the same projections with the fp32 "
              "attention core (where the bf16 path's core is a bf16 set, amx or avx512bf16), against the fp32 path on "
              "the same request, and against oneDNN's bf16 matmul on the fused Q|K|V shape, fastest calls; core_ rows: "
              "the attention "
              "core alone (ScaledDotProductAttention on bf16 Q, K, V) on the bf16 set against the fp32 tiles:")
        print()
        print("| shape | bf16 path GFLOP/s | % of fp32 peak | with fp32 core | fp32 path | bf16 / fp32 | bf16 matmul "
              "| % of its rate |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for shape, b, fp32, matmul, fp32_core in bf16:
            print("| %s | %.1f%s | %.0f%% | %s | %s | %s | %s | %s |" % (
                shape, b["gflops"], star(b), b["pct"], "%.1f" % fp32_core["gflops"] if fp32_core else "",
                "%.1f" % fp32["gflops"] if fp32 else "",
                "%.2fx" % (b["gflops"] / fp32["gflops"]) if fp32 else "",
                "%.1f" % matmul["gflops"] if matmul else "",
                "%.0f%%" % (100 * b["gflops"] / matmul["gflops"]) if matmul else ""))
    print()
    print("FLOPs: 2BTqdHdk + 4BTkdHkvdk + 2BTqHdkd + 4BHdk x visible pairs (TqTk, or T(T+1)/2 causal: "
          "AttentionFlops in proto/mha/v1/attention_shape.h), for ours and every peer alike.")


if __name__ == "__main__":
    main()
