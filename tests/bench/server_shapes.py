"""Ours on the peers' shapes that attention_bench's table lacks (many short sequences, B=64, and one long one,
T=8192): the real mha_server's built-in demo layer (d=512, H=8, fp32, no biases), one call at a time, timed by the
server itself (the response's compute_us: decoding the request's tensors, the backend call and filling the
response, without the wire), so that the numbers compare with the peers' in-process calls. The weights are the
demo layer's, not peers.py's: the FLOPs and the work are the same. Two shapes of attention_bench's table that the
demo layer computes too (b8_t128_d512_h8, b8_t512_d512_h8) are timed the same way, to show in the same run what
the server's path costs beside attention_bench's backend-only calls.

Prints JSON lines like peers.py, with peer "ours_server" (no max_err: the server's conformance suite checks it).

Usage: /usr/bin/python3 tests/bench/server_shapes.py [--server build/bin/mha_server] [--threads 2]
                                                     [--min_time 0.3] [--round 0] [--probe build/bin/attention_bench]
"""

import argparse
import json
import os
import sys
import tempfile

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO_ROOT, "client", "python"))

import numpy as np  # noqa: E402

import mhaclient  # noqa: E402
from local_server import local_server  # noqa: E402
from peers import SERVER_SHAPES, SHAPES, flops, probe  # noqa: E402

CALIBRATION_SHAPES = ["b8_t128_d512_h8", "b8_t512_d512_h8"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default=os.path.join(REPO_ROOT, "build", "bin", "mha_server"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min_time", type=float, default=0.3, help="seconds of server compute per shape")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--probe", default="", help="attention_bench binary: the FMA probe around each shape")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mha_server_shapes_") as work:
        sys.path.insert(0, mhaclient.generate_stubs(os.path.join(work, "stubs"), REPO_ROOT))
        with local_server(args.server, work, "--threads", str(args.threads), "--log_level", "warn") as target:
            with mhaclient.MhaClient(target, timeout=600) as client:
                client.wait_ready()
                for name, B, T, d, H, Hkv, causal, _ in SHAPES:
                    if name not in SERVER_SHAPES + CALIBRATION_SHAPES:
                        continue
                    x = np.random.default_rng(0).standard_normal((B, T, d), dtype=np.float32)
                    peak_before = probe(args.probe, args.threads) if args.probe else None
                    client.multi_head_attention(x, layer="demo")  # warm-up
                    seconds = []
                    while sum(seconds) < args.min_time or len(seconds) < (2 if seconds[0] > 1.0 else 3):
                        seconds.append(client.multi_head_attention(x, layer="demo").compute_us * 1e-6)
                    seconds.sort()
                    best, median = seconds[0], seconds[len(seconds) // 2]
                    f = flops(B, T, d, H, Hkv, causal)
                    peak = max(peak_before, probe(args.probe, args.threads)) if args.probe else None
                    print(json.dumps({"round": args.round, "shape": name, "weights": False, "peer": "ours_server",
                                      "impl": "mha_server demo layer, compute_us", "gflops": f / best / 1e9,
                                      "gflops_median": f / median / 1e9, "ms_best": best * 1e3,
                                      "ms_median": median * 1e3, "runs": len(seconds), "peak_gflops": peak}),
                          flush=True)


if __name__ == "__main__":
    main()
