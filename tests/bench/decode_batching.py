#!/usr/bin/env python3
"""Continuous batching of decode steps across callers, measured end to end with `mha_client decode`.

Each round runs, one after another on fresh servers (so that the rounds interleave the cases):
  one_call     one client sends all S sessions' steps in one Extend per step (the ceiling batching aims at);
  merged       S clients (mha_client decode --per_session -c S), one session each, the server merging their steps;
  unmerged     the same against a server with --max_batch_rows 0 (every step its own backend call);
  prefilling   `merged` while another client prefills a P-token session again and again (Extends of 1024 tokens,
               --prefill_call, which the server computes in --max_prefill_chunk chunks);
  unchunked    `one_call` against a server with --max_prefill_chunk 0, for what chunking costs the prefill.
and prints, per case, the median and best decode tokens/s and per-step p50/p99 over the rounds, then the ratios
the issue asks for: merged / one_call tokens/s (>= 0.8), merged p99 / unmerged p99 (<= 1), prefilling p99 /
merged p99 (<= 2), and one_call / unchunked prefill seconds (the sessions' 1024-token prefill calls).

Usage: tests/bench/decode_batching.py [--rounds 3] [--sessions 32] [--context 2048] [--steps 128]
       [--prefill 8192] [--prefill_call 1024] [--server build/bin/mha_server] [--client build/bin/mha_client] [-- server flags...]
Loopback only; every server and client it starts is stopped by its PID.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_server import local_server  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def decode(client, target, args, extra):
    """One `mha_client decode` run; its JSON report."""
    cmd = [client, "decode", "--target", target, "--sessions", str(args.sessions), "--context", str(args.context),
           "--steps", str(args.steps), "-O", "json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout
    report = json.loads(out)
    if report["errors"]:
        raise SystemExit("decode errors: %s" % report.get("first_error"))
    return report


def prefill_loop(client, target, tokens, per_call):
    """A client that prefills a fresh `tokens`-token session (`per_call` tokens per Extend), over and over, until
    stopped."""
    one = [client, "decode", "--target", target, "--sessions", "1", "--context", str(tokens), "--prefill_chunk",
           str(per_call), "--steps", "1", "-O", "json"]
    script = 'while :; do "$@" > /dev/null || exit 1; done'
    # Its own process group, so that stopping it stops the client it is running too.
    return subprocess.Popen(["bash", "-c", script, "prefill", *one], start_new_session=True)


def run_case(case, args, work):
    flags = list(args.server_flags)
    if case == "unmerged":
        flags += ["--max_batch_rows", "0"]
    if case == "unchunked":
        flags += ["--max_prefill_chunk", "0"]
    per_session = ["--per_session", "-c", str(args.sessions)]
    with local_server(args.server, work, "--kv_cache_mb", "4096", "--log_level", "error", *flags) as target:
        if case in ("one_call", "unchunked"):
            return decode(args.client, target, args, [])
        if case != "prefilling":
            return decode(args.client, target, args, per_session)
        loop = prefill_loop(args.client, target, args.prefill, args.prefill_call)
        try:
            return decode(args.client, target, args, per_session)
        finally:
            os.killpg(loop.pid, signal.SIGTERM)
            loop.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--prefill_call", type=int, default=1024, help="tokens per prefill Extend of the prefiller")
    parser.add_argument("--cases", default="one_call,merged,unmerged,prefilling,unchunked")
    parser.add_argument("--server", default=os.path.join(REPO, "build", "bin", "mha_server"))
    parser.add_argument("--client", default=os.path.join(REPO, "build", "bin", "mha_client"))
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args()
    cases = args.cases.split(",")
    results = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for case in cases:
                report = run_case(case, args, work)
                results[case].append(report)
                print("round %d %-10s %8.1f tokens/s  p50 %7.2f ms  p99 %7.2f ms" %
                      (r + 1, case, report["tokens_per_second"], report["step_ms"]["p50"], report["step_ms"]["p99"]),
                      flush=True)
    print("\n| case | tokens/s median | best | step p50 ms median | step p99 ms median | best p99 | prefill s median |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for case in cases:
        tps = [x["tokens_per_second"] for x in results[case]]
        p50 = [x["step_ms"]["p50"] for x in results[case]]
        p99 = [x["step_ms"]["p99"] for x in results[case]]
        prefill = [x["prefill_seconds"] for x in results[case]]
        summary[case] = (statistics.median(tps), max(tps), statistics.median(p99), min(p99),
                         statistics.median(prefill), min(prefill))
        print("| %s | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f |" % (case, statistics.median(tps), max(tps),
              statistics.median(p50), statistics.median(p99), min(p99), statistics.median(prefill)))
    print()

    def ratio(name, a, b, index_a, index_b, goal):
        if a in summary and b in summary:
            print("%-34s median %.2f  best %.2f  (goal %s)" %
                  (name, summary[a][index_a] / summary[b][index_a], summary[a][index_b] / summary[b][index_b], goal))

    ratio("merged / one_call tokens/s", "merged", "one_call", 0, 1, ">= 0.8")
    ratio("merged p99 / unmerged p99", "merged", "unmerged", 2, 3, "<= 1")
    ratio("prefilling p99 / merged p99", "prefilling", "merged", 2, 3, "<= 2")
    ratio("chunked / whole prefill seconds", "one_call", "unchunked", 4, 5, "the cost of chunking")


if __name__ == "__main__":
    main()
