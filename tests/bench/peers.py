"""What a user would run instead, on the same shapes and threads as attention_bench: numpy and PyTorch.

numpy implements the same math (projections, head-packed attention, softmax, output projection) with matmuls;
PyTorch runs nn.MultiheadAttention where it can express the shape (MHA) and the same plain-torch math for GQA.
Both link Debian's BLAS alternative: install libopenblas0-pthread first, or they run the reference BLAS (25x
slower) and the comparison flatters us. Prints one JSON object per line:
  {"shape": ..., "weights": bool, "numpy_gflops": x, "torch_gflops": y, "blas": ...}

Usage: /usr/bin/python3 tests/bench/peers.py [--threads 2] [--min_time 1.0] [--filter SUBSTRING]
"""

import argparse
import json
import math
import os
import sys
import time

# The thread count must be fixed before numpy / torch load their BLAS.
_threads = "2"
for i, a in enumerate(sys.argv):
    if a == "--threads" and i + 1 < len(sys.argv):
        _threads = sys.argv[i + 1]
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = _threads

import numpy as np  # noqa: E402
import torch  # noqa: E402

# (name, B, Tq, Tk, d_model, H, Hkv, causal): the same table as attention_bench.cc.
SHAPES = [
    ("b1_t16_d64_h4", 1, 16, 16, 64, 4, 4, False),
    ("b32_t64_d256_h4", 32, 64, 64, 256, 4, 4, False),
    ("b8_t128_d512_h8", 8, 128, 128, 512, 8, 8, False),
    ("b8_t512_d512_h8", 8, 512, 512, 512, 8, 8, False),
    ("b8_t512_d512_h8_gqa2", 8, 512, 512, 512, 8, 2, False),
    ("b8_t512_d512_h8_gqa2_causal", 8, 512, 512, 512, 8, 2, True),
    ("b1_t2048_d1024_h16", 1, 2048, 2048, 1024, 16, 16, False),
    ("b1_t2048_d1024_h16_causal", 1, 2048, 2048, 1024, 16, 16, True),
]


def flops(B, Tq, Tk, d, H, Hkv, causal):
    """AttentionFlops (proto/mha/v1/attention_shape.h): attention counts the visible (query, key) pairs only."""
    dk = d // H
    pairs = sum(min(Tk, max(0, i + Tk - Tq + 1)) for i in range(Tq)) if causal else Tq * Tk
    return 2 * B * Tq * d * H * dk + 4 * B * Tk * d * Hkv * dk + 2 * B * Tq * H * dk * d + 4 * B * H * dk * pairs


def time_it(fn, min_time):
    fn()  # warm-up
    best = float("inf")
    spent, runs = 0.0, 0
    while spent < min_time or runs < 3:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        runs += 1
    return best


def numpy_mha(x, w_q, w_k, w_v, w_o, H, Hkv, causal, weights):
    B, T, d = x.shape
    dk = w_q.shape[1] // H
    q = (x @ w_q).reshape(B, T, H, dk).transpose(0, 2, 1, 3)
    k = (x @ w_k).reshape(B, T, Hkv, dk).transpose(0, 2, 3, 1)
    v = (x @ w_v).reshape(B, T, Hkv, dk).transpose(0, 2, 1, 3)
    if Hkv != H:
        k = np.repeat(k, H // Hkv, axis=1)
        v = np.repeat(v, H // Hkv, axis=1)
    s = (q @ k) * np.float32(1.0 / math.sqrt(dk))
    if causal:
        s = s + np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    p = s / s.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * dk)
    return o @ w_o, (p if weights else None)


def torch_plain_mha(x, w_q, w_k, w_v, w_o, H, Hkv, causal, weights):
    B, T, d = x.shape
    dk = w_q.shape[1] // H
    q = (x @ w_q).view(B, T, H, dk).transpose(1, 2)
    k = (x @ w_k).view(B, T, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = (x @ w_v).view(B, T, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(dk)
    if causal:
        s = s + torch.triu(torch.full((T, T), float("-inf")), 1)
    p = torch.softmax(s, -1)
    o = (p @ v).transpose(1, 2).reshape(B, T, H * dk)
    return o @ w_o, (p if weights else None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="2")
    parser.add_argument("--min_time", type=float, default=1.0)
    parser.add_argument("--filter", default="")
    args = parser.parse_args()
    torch.set_num_threads(int(args.threads))
    blas = os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")
    rng = np.random.default_rng(0)
    for name, B, Tq, Tk, d, H, Hkv, causal in SHAPES:
        if args.filter not in name:
            continue
        dk = d // H
        x = rng.standard_normal((B, Tq, d), dtype=np.float32)
        w = [(rng.standard_normal(shape, dtype=np.float32) / math.sqrt(shape[0]))
             for shape in ((d, H * dk), (d, Hkv * dk), (d, Hkv * dk), (H * dk, d))]
        xt, wt = torch.from_numpy(x), [torch.from_numpy(a) for a in w]
        mask = torch.triu(torch.full((Tq, Tk), float("-inf")), 1) if causal else None
        module = None
        if Hkv == H:
            # Zero biases rather than bias=False: torch 1.13's eval fast path crashes without bias tensors.
            module = torch.nn.MultiheadAttention(d, H, batch_first=True).eval()
            with torch.no_grad():
                module.in_proj_weight.copy_(torch.cat([a.T for a in wt[:3]]))
                module.out_proj.weight.copy_(wt[3].T)
                module.in_proj_bias.zero_()
                module.out_proj.bias.zero_()
        for weights in (False, True):
            t_np = time_it(lambda: numpy_mha(x, *w, H, Hkv, causal, weights), args.min_time)
            with torch.inference_mode():
                if module is not None:
                    fn = lambda: module(xt, xt, xt, attn_mask=mask, need_weights=weights,  # noqa: E731
                                        average_attn_weights=False)
                else:
                    fn = lambda: torch_plain_mha(xt, *wt, H, Hkv, causal, weights)  # noqa: E731
                t_torch = time_it(fn, args.min_time)
            f = flops(B, Tq, Tk, d, H, Hkv, causal)
            print(json.dumps({"shape": name, "weights": weights, "numpy_gflops": f / t_np / 1e9,
                              "torch_gflops": f / t_torch / 1e9,
                              "torch_impl": "nn.MultiheadAttention" if module is not None else "plain torch",
                              "blas": blas}), flush=True)


if __name__ == "__main__":
    main()
