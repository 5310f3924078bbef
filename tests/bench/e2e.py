"""End-to-end numbers through the real server: mha_client bench for the tiny shape (1,16,16,64,4) and for
(8,512,512,512,8,8), each next to the health-check round trip measured in the same run, and the server's time
outside the backend (handler - compute) as a share of compute.

Usage: /usr/bin/python3 tests/bench/e2e.py [--server build/bin/mha_server] [--client build/bin/mha_client]
"""

import argparse
import json
import os
import signal
import struct
import subprocess
import tempfile
import time

import numpy as np


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="build/bin/mha_server")
    parser.add_argument("--client", default="build/bin/mha_client")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        layers = os.path.join(work, "layers")
        os.mkdir(layers)
        write_layer(os.path.join(layers, "tiny.safetensors"), d_model=64, heads=4)
        port_file = os.path.join(work, "port")
        server = subprocess.Popen([args.server, "--listen", "127.0.0.1:0", "--port_file", port_file,
                                   "--layers_dir", layers, "--log_level", "warn"])
        try:
            for _ in range(200):
                if os.path.exists(port_file) and open(port_file).read().strip():
                    break
                time.sleep(0.05)
            target = "127.0.0.1:" + open(port_file).read().strip()
            rows = [("tiny (1,16,16,64,4)", bench(client := args.client, target, "--layer", "tiny", "--batch", "1",
                                                  "--seq", "16", "-n", "3000", "--warmup", "200",
                                                  "--health_baseline", "3000")),
                    ("(8,512,512,512,8,8)", bench(client, target, "--layer", "demo", "--batch", "8", "--seq", "512",
                                                  "-n", "20", "--warmup", "2", "--health_baseline", "500"))]
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
    print("| request | p50 ms | p99 ms | health p50 ms | p50 / health | server compute ms | server outside "
          "compute | GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        split = r["split_ms"]
        outside = split["server_queue"] + split["server_other"]
        print("| %s | %.3f | %.3f | %.3f | %.2fx | %.3f | %.1f%% | %.1f |" % (
            name, r["latency_ms"]["p50"], r["latency_ms"]["p99"], r["health_rtt_ms"]["p50"],
            r["latency_ms"]["p50"] / r["health_rtt_ms"]["p50"], split["server_compute"],
            100 * outside / split["server_compute"], r["gflops"]))
    print()
    print("p50 / health: end-to-end median over the health-check median, same connection, same run. "
          "Server outside compute: (handler - compute) / compute, i.e. validation, queue hand-off and response "
          "assembly.")


if __name__ == "__main__":
    main()
