"""Calls the server's built-in "demo" layer (d_model 512, 8 heads) on random input.

Generate the stubs first (see mhaclient's docstring), e.g. from the repository root:

    /usr/bin/python3 -c "import sys; sys.path.insert(0, 'client/python'); import mhaclient; mhaclient.generate_stubs('build/python')"
    PYTHONPATH=build/python:client/python /usr/bin/python3 client/python/example.py --target 127.0.0.1:50051
"""

import argparse
import sys

import numpy as np

import mhaclient


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda", "reference"])
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq, 512), dtype=np.float32)
    with mhaclient.MhaClient(args.target) as client:
        print("health:", client.health())
        info = client.server_info()
        print("server %s, default backend %s" % (info["version"], info["default_backend"]))
        r = client.multi_head_attention(x, layer="demo", causal=args.causal, return_weights=True,
                                        backend=args.backend)
    print("input             ", x.shape, x.dtype)
    print("output            ", r.output.shape, r.output.dtype)
    print("attention_weights ", r.attention_weights.shape, r.attention_weights.dtype)
    print("backend           ", r.backend)
    print("queue_us / compute_us  %d / %d" % (r.queue_us, r.compute_us))
    print("weight rows sum to 1:", bool(np.allclose(r.attention_weights.sum(-1), 1.0, atol=1e-4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
