"""End-to-end numbers through the real server: mha_client bench for the tiny shape (1,16,16,64,4) and for
(8,512,512,512,8,8) with fp32 and with bf16 on the wire (in the messages, and in a shared-memory region), each next
to the health-check round trip measured in the same run, the server's time outside the backend (handler - compute)
as a share of compute, and the end-to-end rate as a share of the compute rate (#16's wire target) over interleaved
rounds, optionally alternating with another build.

Usage: /usr/bin/python3 tests/bench/e2e.py [--server build/bin/mha_server] [--client build/bin/mha_client]
           [--rounds 3] [--compare OTHER_SERVER,OTHER_CLIENT]
"""

import argparse
import json
import os
import struct
import subprocess
import tempfile

import numpy as np

from local_server import local_server


def write_layer(path, d_model, heads, seed=0):
    """A .safetensors layer with w_q, w_k, w_v, w_o [d_model, d_model] and num_heads in the metadata."""
    rng = np.random.default_rng(seed)
    tensors, offset, blobs = {}, 0, []
    for name in ("w_q", "w_k", "w_v", "w_o"):
        data = (rng.standard_normal((d_model, d_model)) / np.sqrt(d_model)).astype("<f4").tobytes()
        tensors[name] = {"dtype": "F32", "shape": [d_model, d_model], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    tensors["__metadata__"] = {"num_heads": str(heads)}
    header = json.dumps(tensors).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(blobs))


def bench(client, target, *args):
    out = subprocess.run([client, "bench", "--target", target, "-O", "json", *args], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


ROWS = [
    # name, mha_client bench arguments, include the health baseline
    ("tiny (1,16,16,64,4)", ["--layer", "tiny", "--batch", "1", "--seq", "16", "-n", "3000", "--warmup", "200",
                             "--health_baseline", "3000"]),
    ("(8,512,512,512,8,8) fp32", ["--layer", "demo", "--batch", "8", "--seq", "512", "-n", "20", "--warmup", "2",
                                  "--health_baseline", "500"]),
    ("(8,512,512,512,8,8) bf16 wire", ["--layer", "demo", "--batch", "8", "--seq", "512", "--dtype", "bf16",
                                       "-n", "20", "--warmup", "2", "--health_baseline", "500"]),
    # The same two with the query and the output in a shared-memory region instead of the messages (this build
    # only: --compare builds may predate it).
    ("(8,512,512,512,8,8) fp32 shared memory", ["--layer", "demo", "--batch", "8", "--seq", "512", "--shared_memory",
                                                "-n", "20", "--warmup", "2", "--health_baseline", "500"]),
    ("(8,512,512,512,8,8) bf16 shared memory", ["--layer", "demo", "--batch", "8", "--seq", "512", "--dtype", "bf16",
                                                "--shared_memory", "-n", "20", "--warmup", "2",
                                                "--health_baseline", "500"]),
]
SHARED_MEMORY_ROWS = 2  # the last rows of ROWS


def run_build(server_bin, client_bin, layers, work, shared_memory):
    """Every row once against a fresh server of a build: {row name: bench json}; the shared-memory rows only
    with `shared_memory`."""
    rows = ROWS if shared_memory else ROWS[:-SHARED_MEMORY_ROWS]
    extra = ["--max_shared_memory_regions", "4"] if shared_memory else []
    with local_server(server_bin, work, "--layers_dir", layers, "--log_level", "warn", *extra) as target:
        return {name: bench(client_bin, target, *row_args) for name, row_args in rows}


def wire_ratio(r):
    """End-to-end rate over the server's compute rate: mean compute time over mean latency, one run."""
    return r["split_ms"]["server_compute"] / r["latency_ms"]["mean"]


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="build/bin/mha_server")
    parser.add_argument("--client", default="build/bin/mha_client")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", default="",
                        help="SERVER,CLIENT of another build, run alternately with this one in every round")
    args = parser.parse_args()
    builds = [("this build", args.server, args.client)]
    if args.compare:
        other_server, other_client = args.compare.split(",")
        builds.append(("compared build", other_server, other_client))
    results = {label: [] for label, _, _ in builds}
    with tempfile.TemporaryDirectory() as work:
        layers = os.path.join(work, "layers")
        os.mkdir(layers)
        write_layer(os.path.join(layers, "tiny.safetensors"), d_model=64, heads=4)
        for _ in range(args.rounds):
            for label, server_bin, client_bin in builds:
                results[label].append(run_build(server_bin, client_bin, layers, work, label == "this build"))

    for label, _, _ in builds:
        rounds = results[label]
        last = rounds[-1]
        print("%s, last of %d rounds:" % (label, len(rounds)))
        print()
        print("| request | p50 ms | p99 ms | health p50 ms | p50 / health | server compute ms | server outside "
              "compute | GFLOP/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, _ in ROWS:
            if name not in last:
                continue
            r = last[name]
            split = r["split_ms"]
            outside = split["server_queue"] + split["server_other"]
            print("| %s | %.3f | %.3f | %.3f | %.2fx | %.3f | %.1f%% | %.1f |" % (
                name, r["latency_ms"]["p50"], r["latency_ms"]["p99"], r["health_rtt_ms"]["p50"],
                r["latency_ms"]["p50"] / r["health_rtt_ms"]["p50"], split["server_compute"],
                100 * outside / split["server_compute"], r["gflops"]))
        print()
    print("End-to-end rate / compute rate (mean server compute over mean latency), every round:")
    print()
    print("| request | build | median | best | rounds | client encode ms | client decode ms | rest ms |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, _ in ROWS[1:]:
        for label, _, _ in builds:
            rs = [rounds[name] for rounds in results[label] if name in rounds]
            if not rs:
                continue
            ratios = [wire_ratio(r) for r in rs]
            print("| %s | %s | %.3f | %.3f | %s | %.2f | %.2f | %.2f |" % (
                name, label, median(ratios), max(ratios), ", ".join("%.3f" % x for x in ratios),
                median([r["split_ms"]["serialize"] for r in rs]), median([r["split_ms"]["deserialize"] for r in rs]),
                median([r["split_ms"]["other"] + r["split_ms"]["server_other"] + r["split_ms"]["server_queue"]
                        for r in rs])))
    print()
    print("p50 / health: end-to-end median over the health-check median, same connection, same run. "
          "Server outside compute: (handler - compute) / compute, i.e. parse, validation and queue hand-off. "
          "Client encode/decode: the request's encoding and the response's decoding in mha_client bench (medians of "
          "the rounds' means); rest: everything else outside compute (transfer both ways, the server's parse). "
          "Shared memory: the query and the output in a registered region (mha_client bench --shared_memory).")


if __name__ == "__main__":
    main()
