"""Ranks the heads of a GQA layer by their softmax statistics (HeadStats), computed by the server in the same call.

Registers a causal layer with random weights (d_model 256, 8 query heads over 2 KV heads; each head's queries scaled
differently, so that some heads attend sharply and others diffusely), runs MultiHeadAttention with
return_head_stats on a random input of 128 tokens, and prints every head's statistics ranked by contribution (the
share of the output that ablating the head would remove). With --plot PATH and matplotlib importable, also saves a
bar chart there.

    PYTHONPATH=build/python:client/python /usr/bin/python3 client/python/heads_example.py --target 127.0.0.1:50051
(stubs as in example.py).
"""

import argparse
import sys

import numpy as np

import mhaclient

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, T = 256, 8, 2, 32, 128


def random_layer(rng):
    r = lambda *shape: (rng.standard_normal(shape) * shape[0] ** -0.5).astype(np.float32)  # noqa: E731
    w = {"w_q": r(D_MODEL, HEADS * HEAD_DIM), "w_k": r(D_MODEL, KV_HEADS * HEAD_DIM),
         "w_v": r(D_MODEL, KV_HEADS * HEAD_DIM), "w_o": r(HEADS * HEAD_DIM, D_MODEL)}
    sharpness = np.geomspace(0.25, 8.0, HEADS, dtype=np.float32)  # head h's scores scale by sharpness[h]
    w["w_q"] *= np.repeat(sharpness, HEAD_DIM)[None, :]
    w["w_o"] *= rng.uniform(0.2, 2.0, HEADS).astype(np.float32).repeat(HEAD_DIM)[:, None]
    return w


def plot(stats, order, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = ["contribution", "entropy", "confidence", "distance", "sink_mass"]
    fig, axes = plt.subplots(1, len(names), figsize=(3 * len(names), 3))
    for ax, name in zip(axes, names):
        ax.bar([str(h) for h in order], stats[name][order])
        ax.set_title(name)
        ax.set_xlabel("head")
    fig.tight_layout()
    fig.savefig(path)
    print("bar chart saved to", path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="server host:port")
    parser.add_argument("--plot", help="save a bar chart of the statistics here (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    name = "heads_example_%d" % args.seed
    x = rng.standard_normal((1, T, D_MODEL)).astype(np.float32)
    with mhaclient.MhaClient(args.target) as client:
        try:
            client.unload_layer(name)  # a previous run's
        except Exception:  # noqa: BLE001 (not registered: fine)
            pass
        client.load_layer(name, random_layer(rng), HEADS, KV_HEADS, HEAD_DIM, causal=True)
        try:
            r = client.multi_head_attention(x, layer=name, return_head_stats=True)
        finally:
            client.unload_layer(name)

    stats = {field: values[0] for field, values in r.head_stats.items()}  # batch item 0: [H] each
    order = np.argsort(-stats["contribution"])
    columns = mhaclient.HEAD_STAT_FIELDS
    print("%d heads over %d KV heads, %d tokens, causal (backend %s); ranked by contribution"
          % (HEADS, KV_HEADS, T, r.backend))
    print("head  kv  " + "  ".join(columns))
    for h in order:
        print("%4d  %2d  " % (h, h // (HEADS // KV_HEADS))
              + "  ".join("%*.4f" % (len(c), stats[c][h]) for c in columns))
    if args.plot:
        plot(stats, order, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
