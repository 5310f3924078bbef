#!/usr/bin/python3
"""Ours against PyTorch on the decode shapes, in one run: rounds alternate decode_bench (the server's CPU decode path,
with its memory-read probe) and decode_peers.py (PyTorch's SDPA over a static cache, in the peers' environment), and
the table gives each side's K/V bytes read per second, best and median over the rounds, as a share of the probe
(best against best, median against median) and ours over PyTorch.

Usage: tests/bench/decode_compare.py [--rounds 3] [--bench build/bin/decode_bench] [--peers-python PATH]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench", default=os.path.join(REPO, "build", "bin", "decode_bench"))
    parser.add_argument("--peers-python", default=None, help="default: what tests/bench/peers-env.sh prints")
    parser.add_argument("--seconds", default="0.5")
    args = parser.parse_args()
    python = args.peers_python or subprocess.run([os.path.join(HERE, "peers-env.sh")], capture_output=True, text=True,
                                                 check=True).stdout.strip().splitlines()[-1]
    ours, torch_rates, probes = {}, {}, []
    for _ in range(args.rounds):
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
            subprocess.run([args.bench, "--rounds", "1", "--seconds", args.seconds, "--filter", "decode_",
                            "--json", out.name], check=True, stdout=subprocess.DEVNULL)
            for line in open(out.name):
                row = json.loads(line)
                if "probe_gbps" in row:
                    probes.append(row["probe_gbps"])
                elif "gbps" in row:
                    ours.setdefault(row["case"], []).append(row["gbps"])
        peer = subprocess.run([python, os.path.join(HERE, "decode_peers.py"), "--seconds", args.seconds],
                              capture_output=True, text=True, check=True)
        for line in peer.stdout.splitlines():
            row = json.loads(line)
            torch_rates.setdefault(row["case"], []).append(row["gbps"])
            version = row["torch"]
    probe_best, probe_med = max(probes), statistics.median(probes)
    print("memory-read probe %.1f GB/s best, %.1f median over %d rounds; PyTorch %s" % (probe_best, probe_med,
                                                                                      args.rounds, version))
    print("%-22s %14s %14s %16s %16s %12s" % ("case", "ours GB/s", "%probe", "torch GB/s", "%probe", "ours/torch"))
    for case in torch_rates:
        if case not in ours:
            continue
        o, t = ours[case], torch_rates[case]
        print("%-22s %6.1f / %5.1f %5.0f%% / %3.0f%% %7.2f / %6.2f %6.1f%% / %4.1f%% %5.1f / %4.1f" % (
            case, max(o), statistics.median(o), 100 * max(o) / probe_best, 100 * statistics.median(o) / probe_med,
            max(t), statistics.median(t), 100 * max(t) / probe_best, 100 * statistics.median(t) / probe_med,
            max(o) / max(t), statistics.median(o) / statistics.median(t)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
