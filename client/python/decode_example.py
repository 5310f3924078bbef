"""A tiny decoder whose attention runs in mhaserve: two layers (random weights, RoPE, GQA), a numpy FFN, greedy.

Each layer is registered once (LoadLayer, with its RoPE); one layer session keeps the KV cache of both. The prompt
is prefilled in one Extend per layer, then every generated token costs one Extend per layer carrying that token's
activations alone, while the server attends over the whole cached sequence. To show that this is the same model,
each step's logits are compared with a local numpy run that recomputes the whole sequence from scratch.

    PYTHONPATH=build/python:client/python /usr/bin/python3 client/python/decode_example.py --target 127.0.0.1:50051
(stubs as in example.py). Exit code 1 if a step disagrees with the recomputation.
"""

import argparse
import sys

import numpy as np

import mhaclient

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, THETA = 64, 4, 2, 16, 2, 97, 10000.0


def make_model(seed):
    """Embeddings and an output projection, and per layer attention weights (Y = X W) and an FFN."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, scale: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    layers = []
    for _ in range(LAYERS):
        layers.append({
            "attn": {"w_q": r(D_MODEL, HEADS * HEAD_DIM, scale=D_MODEL ** -0.5),
                     "w_k": r(D_MODEL, KV_HEADS * HEAD_DIM, scale=D_MODEL ** -0.5),
                     "w_v": r(D_MODEL, KV_HEADS * HEAD_DIM, scale=D_MODEL ** -0.5),
                     "w_o": r(HEADS * HEAD_DIM, D_MODEL, scale=(HEADS * HEAD_DIM) ** -0.5)},
            "w1": r(D_MODEL, 4 * D_MODEL, scale=D_MODEL ** -0.5),
            "w2": r(4 * D_MODEL, D_MODEL, scale=(4 * D_MODEL) ** -0.5),
        })
    return {"embed": r(VOCAB, D_MODEL, scale=1.0), "unembed": r(D_MODEL, VOCAB, scale=D_MODEL ** -0.5),
            "layers": layers}


def norm(x):
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)).astype(np.float32)


def ffn(layer, x):
    return np.maximum(x @ layer["w1"], 0.0) @ layer["w2"]


def rope(x, positions):
    """Rotate-half RoPE (Hugging Face's LLaMA) on x [T, heads, d_k] at `positions`, in float64."""
    inv_freq = THETA ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # [T, d_k / 2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def attention(w, x):
    """Causal GQA attention with RoPE over the whole sequence x [T, d_model], recomputed from scratch (float64)."""
    T = x.shape[0]
    x = x.astype(np.float64)
    q = rope((x @ w["w_q"]).reshape(T, HEADS, HEAD_DIM), range(T))
    k = rope((x @ w["w_k"]).reshape(T, KV_HEADS, HEAD_DIM), range(T))
    v = (x @ w["w_v"]).reshape(T, KV_HEADS, HEAD_DIM)
    k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(HEAD_DIM)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (np.einsum("hij,jhd->ihd", p, v).reshape(T, HEADS * HEAD_DIM) @ w["w_o"]).astype(np.float32)


def logits_local(model, tokens):
    """Every position's logits, the whole sequence recomputed."""
    x = model["embed"][tokens]
    for layer in model["layers"]:
        x = x + attention(layer["attn"], norm(x))
        x = x + ffn(layer, norm(x))
    return norm(x) @ model["unembed"]


def step_served(model, session, x):
    """The new tokens' activations x [n, d_model] through every layer, attention in the session's caches."""
    for i, layer in enumerate(model["layers"]):
        x = x + session.extend(i, x=norm(x)).output
        x = x + ffn(layer, norm(x))
    return norm(x) @ model["unembed"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    parser.add_argument("--prompt", default="3,14,15,92,65,35", help="comma-separated token ids < %d" % VOCAB)
    parser.add_argument("--tokens", type=int, default=24, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model = make_model(args.seed)
    tokens = [int(t) % VOCAB for t in args.prompt.split(",")]
    names = ["decode_example_%d_layer%d" % (args.seed, i) for i in range(LAYERS)]
    worst = 0.0
    with mhaclient.MhaClient(args.target) as client:
        for name, layer in zip(names, model["layers"]):
            try:
                client.unload_layer(name)  # a previous run's
            except Exception:  # noqa: BLE001 (not registered: fine)
                pass
            client.load_layer(name, layer["attn"], HEADS, KV_HEADS, HEAD_DIM, rope_theta=THETA)
        try:
            with client.create_session(layers=names) as session:
                logits = step_served(model, session, model["embed"][tokens])  # the prompt, one call per layer
                for _ in range(args.tokens):
                    want = logits_local(model, tokens)[-1]
                    worst = max(worst, float(np.abs(logits[-1] - want).max() / (1 + np.abs(want).max())))
                    tokens.append(int(np.argmax(logits[-1])))
                    logits = step_served(model, session, model["embed"][tokens[-1:]])  # one token per layer
                print("session %s holds %s tokens per layer" % (session.id, session.lengths()))
        finally:
            for name in names:
                client.unload_layer(name)
    print("generated:", ",".join(str(t) for t in tokens))
    ok = worst < 1e-3
    print("every step's logits against the full recomputation: largest difference %.2e (relative) -> %s"
          % (worst, "OK" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
