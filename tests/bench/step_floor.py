#!/usr/bin/env python3
"""The per-step floor: a tiny decode step's round trip, unary and over ExtendStream, over TCP and the server's Unix
socket, from the C++ client and from the Python client, against the health check's round trip of the same run.

One server (--listen on loopback, --listen_unix beside it). Each round, per transport (tcp, unix), in turn:
  C++ health     `mha_client bench --health_baseline`: sequential grpc.health.v1 checks, the floor of any call;
  C++ steps      `mha_client decode --transport both`: one head session (H=8, Hkv=2, d_k=64, 128 cached tokens),
                 every other step unary, the others on a stream; with the server's own time in each step;
  Python health  MhaClient.health() in a loop;
  Python steps   Session.extend on two such sessions, one through a client that streams, one through a client with
                 max_extend_streams=0, step by step in turn.
Prints per cell the median (and best) over the rounds of each run's p50, and the median p99; then the ratios #56
asks for. With --batched, also 32 sessions x 2048 tokens decoded batched (one Extend per step for all of them), 64
steps, stream and unary in turn, tokens/s each.

Usage: tests/bench/step_floor.py [--rounds 5] [--steps 400] [--batched] [--server build/bin/mha_server]
       [--client build/bin/mha_client]
Loopback and a socket in a temporary folder only; the server it starts is stopped by its PID. Runs by hand.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import local_server  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
import mhaclient  # noqa: E402

HEADS = dict(num_heads=8, num_kv_heads=2, head_dim=64)
CONTEXT = 128


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpp_health(client, target, calls):
    out = subprocess.run([client, "bench", "--target", target, "-n", "20", "--health_baseline", str(calls)],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    m = re.search(r"Health-check round trip.*?\n\s+p50 ([\d.]+) ms, p90 [\d.]+ ms, p99 ([\d.]+) ms", out, re.S)
    return float(m.group(1)), float(m.group(2))


def cpp_steps(client, target, steps, sessions=1, context=CONTEXT, heads=("8", "2", "64")):
    out = subprocess.run([client, "decode", "--target", target, "--sessions", str(sessions), "--context",
                          str(context), "--steps", str(steps), "--heads", heads[0], "--kv_heads", heads[1],
                          "--head_dim", heads[2], "--transport", "both", "-O", "json"],
                         check=True, capture_output=True, text=True, timeout=1800).stdout
    report = json.loads(out)
    t = report["transport"]
    return {"stream": (t["stream"]["p50"], t["stream"]["p99"], t["stream"]["mean"]),
            "unary": (t["unary"]["p50"], t["unary"]["p99"], t["unary"]["mean"]),
            "server": report["server_step_ms"]["p50"]}


def python_runs(target, steps):
    """(health, stream, unary): each (p50 ms, p99 ms) of this run."""
    rng = np.random.default_rng(0)
    prompt = dict(q=rng.standard_normal((CONTEXT, 8, 64), dtype=np.float32),
                  k=rng.standard_normal((CONTEXT, 2, 64), dtype=np.float32),
                  v=rng.standard_normal((CONTEXT, 2, 64), dtype=np.float32))
    token = {name: a[:1].copy() for name, a in prompt.items()}
    with mhaclient.MhaClient(target) as streamed, mhaclient.MhaClient(target, max_extend_streams=0) as unary:
        sessions = [(streamed.create_session(**HEADS), []), (unary.create_session(**HEADS), [])]
        for session, _ in sessions:
            session.extend(**prompt)
        for step in range(steps):
            session, times = sessions[step % 2]
            start = time.perf_counter()
            session.extend(**token)
            times.append((time.perf_counter() - start) * 1e3)
        health = []
        for _ in range(steps):
            start = time.perf_counter()
            streamed.health()
            health.append((time.perf_counter() - start) * 1e3)
        for session, _ in sessions:
            session.close()
    summary = [(percentile(t, 0.5), percentile(t, 0.99)) for t in (health, sessions[0][1], sessions[1][1])]
    return summary


def cell(runs):
    """'median p50 (best p50), p99 median' of (p50, p99) runs, ms."""
    p50s = [r[0] for r in runs]
    return "%.3f (%.3f) / %.3f" % (statistics.median(p50s), min(p50s), statistics.median([r[1] for r in runs]))


def med(runs):
    return statistics.median(r[0] for r in runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--server", default=os.path.join(REPO, "build", "bin", "mha_server"))
    parser.add_argument("--client", default=os.path.join(REPO, "build", "bin", "mha_client"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        mhaclient.generate_stubs(os.path.join(work, "stubs"), REPO)
        sys.path.insert(0, os.path.join(work, "stubs"))
        socket = os.path.join(work, "mha.sock")
        cells = {}  # (language, what, transport) -> [(p50, p99)]
        server_ms = []
        with local_server(args.server, work, "--listen_unix", socket, "--log_level", "warn") as tcp:
            targets = {"tcp": tcp, "unix": "unix:" + socket}
            for _ in range(args.rounds):
                for name, target in targets.items():
                    cells.setdefault(("C++", "health", name), []).append(cpp_health(args.client, target, args.steps))
                    steps = cpp_steps(args.client, target, args.steps)
                    server_ms.append(steps["server"])
                    for way in ("stream", "unary"):
                        cells.setdefault(("C++", way, name), []).append(steps[way][:2])
                    health, stream, unary = python_runs(target, args.steps)
                    for way, run in (("health", health), ("stream", stream), ("unary", unary)):
                        cells.setdefault(("Python", way, name), []).append(run)
            batched = []
            for _ in range(args.rounds if args.batched else 0):
                batched.append(cpp_steps(args.client, tcp, 64, sessions=32, context=2048, heads=("32", "8", "128")))
    print("Tiny step (H=8 Hkv=2 d_k=64, %d cached tokens), %d rounds of %d calls each: p50 median (best) / p99 "
          "median, ms; the server's own time in a step: p50 %.3f ms" % (CONTEXT, args.rounds, args.steps,
                                                                       statistics.median(server_ms)))
    print("| client | call | TCP | Unix socket |")
    print("| --- | --- | --- | --- |")
    for language in ("C++", "Python"):
        for what in ("health", "unary", "stream"):
            label = "health check" if what == "health" else "step, " + what
            print("| %s | %s | %s | %s |" % (language, label, cell(cells[(language, what, "tcp")]),
                                            cell(cells[(language, what, "unix")])))
    c = {key: med(runs) for key, runs in cells.items()}
    p99 = statistics.median(r[1] for r in cells[("C++", "stream", "tcp")])
    print("ratios (medians): C++ stream / health, TCP %.2f (target <= 1.25), Unix %.2f; C++ stream p99 / p50 %.2f "
          "(<= 3); Unix stream / TCP stream %.2f (<= 0.6); C++ unary / stream %.2f; Python stream / C++ stream "
          "TCP %.2f, Unix %.2f (<= 2); Python unary / C++ unary TCP %.2f" % (
              c[("C++", "stream", "tcp")] / c[("C++", "health", "tcp")],
              c[("C++", "stream", "unix")] / c[("C++", "health", "unix")], p99 / c[("C++", "stream", "tcp")],
              c[("C++", "stream", "unix")] / c[("C++", "stream", "tcp")],
              c[("C++", "unary", "tcp")] / c[("C++", "stream", "tcp")],
              c[("Python", "stream", "tcp")] / c[("C++", "stream", "tcp")],
              c[("Python", "stream", "unix")] / c[("C++", "stream", "unix")],
              c[("Python", "unary", "tcp")] / c[("C++", "unary", "tcp")]))
    if batched:
        # tokens/s of a run's steps each way: 32 tokens per step over the mean step (the throughput), and over the
        # p50 step (a typical step, less moved by the odd slow one among 32).
        for name, index in (("mean", 2), ("p50", 0)):
            tps = {way: [32 / (b[way][index] / 1e3) for b in batched] for way in ("stream", "unary")}
            print("batched, 32 sessions x 2048 tokens (H=32 Hkv=8 d_k=128, bf16 cache), %d rounds of 64 steps, every "
                  "other one each way; tokens/s over the %s step, median (best): stream %.0f (%.0f), unary %.0f "
                  "(%.0f), stream / unary %.2f (target >= 1)" % (
                      len(batched), name, statistics.median(tps["stream"]), max(tps["stream"]),
                      statistics.median(tps["unary"]), max(tps["unary"]),
                      statistics.median(tps["stream"]) / statistics.median(tps["unary"])))


if __name__ == "__main__":
    main()
