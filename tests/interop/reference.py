"""The interop tests' ground truth: multi-head attention in float64 with PyTorch (torch.nn.functional's
scaled_dot_product_attention with GQA, as users of the service compute it), or with numpy where no PyTorch is at hand.

Run as a process that the tests talk to (so that PyTorch can live in its own environment, tests/bench/peers-env.sh's):
each line on stdin names an .npz of inputs; the outputs are written to the same path + ".out.npz", then "ok" (or
"error: ...") is printed. Inputs: x, key, value [B, T, d] (or q, k, v [B, T, H, d_k] for "sdpa"), the layer's
w_q ... b_o, and num_heads, causal, scale, key_lengths, attn_mask, mask_keep, head_mask where given.
"""
import sys

import numpy as np

try:
    import torch
except ImportError:  # the numpy path below
    torch = None

ENGINE = "torch " + torch.__version__ if torch is not None else "numpy " + np.__version__


def visible(b, h, tq, tk, causal, key_lengths, attn_mask, mask_keep):
    """[B, 1, Tq, Tk] float64 bias: 0 where a query sees a key, -inf where masked, the additive mask's values."""
    bias = np.zeros((b, 1, tq, tk))
    if causal:
        bias[:, :, np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq)] = -np.inf
    if key_lengths is not None:
        for i, n in enumerate(key_lengths):
            bias[i, :, :, n:] = -np.inf
    if attn_mask is not None:
        mask = np.broadcast_to(attn_mask.astype(np.float64).reshape((-1, 1, tq, tk)), bias.shape)
        bias = np.where(mask == 0, -np.inf, bias) if mask_keep else bias + mask
    return bias


def core(q, k, v, bias, scale):
    """q [B, H, Tq, d], k and v [B, Hkv, Tk, d]: (heads [B, H, Tq, d], weights [B, H, Tq, Tk]); rows with no
    visible key are zero."""
    group = q.shape[1] // k.shape[1]
    if torch is not None:
        tq, tk, tv, tb = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v, bias))
        heads = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb, scale=scale,
                                                                 enable_gqa=group > 1)
        scores = tq @ tk.repeat_interleave(group, dim=1).transpose(-1, -2) * scale + tb
        weights = torch.softmax(scores, dim=-1)
        return np.nan_to_num(heads.numpy()), np.nan_to_num(weights.numpy())
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale + bias
    top = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(top), top, 0))
    total = e.sum(axis=-1, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return weights @ v, weights


def compute(a):
    get = lambda name: a[name].astype(np.float64) if name in a else None
    causal = bool(a["causal"]) if "causal" in a else False
    key_lengths = a["key_lengths"] if "key_lengths" in a else None
    mask_keep = bool(a["mask_keep"]) if "mask_keep" in a else False
    if "q" in a:  # the sdpa model: head-packed [B, T, H, d_k]
        q, k, v = (get(n).transpose(0, 2, 1, 3) for n in "qkv")
        scale = float(a["scale"]) if "scale" in a else 1 / np.sqrt(q.shape[-1])
        bias = visible(q.shape[0], 1, q.shape[2], k.shape[2], causal, key_lengths, get("attn_mask"), mask_keep)
        heads, weights = core(q, k, v, bias, scale)
        return {"output": heads.transpose(0, 2, 1, 3), "attention_weights": weights}
    x = get("x")
    key = get("key") if "key" in a else x
    value = get("value") if "value" in a else key
    h = int(a["num_heads"])
    proj = lambda t, w, b: t @ get(w) + (get(b) if b in a else 0)
    q, k, v = proj(x, "w_q", "b_q"), proj(key, "w_k", "b_k"), proj(value, "w_v", "b_v")
    d = q.shape[-1] // h
    split = lambda t: t.reshape(t.shape[0], t.shape[1], -1, d).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    scale = float(a["scale"]) if "scale" in a else 1 / np.sqrt(d)
    bias = visible(q.shape[0], h, q.shape[2], k.shape[2], causal, key_lengths, get("attn_mask"), mask_keep)
    heads, weights = core(q, k, v, bias, scale)
    if "head_mask" in a:
        heads = heads * get("head_mask")[None, :, None, None]
    concat = heads.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], h * d)
    return {"output": proj(concat, "w_o", "b_o"), "attention_weights": weights}


def main():
    print(ENGINE, flush=True)
    for line in sys.stdin:
        path = line.strip()
        try:
            with np.load(path) as a:
                np.savez(path + ".out.npz", **compute(dict(a)))
            print("ok", flush=True)
        except Exception as e:  # reported to the test, which fails with it
            print("error: %r" % (e,), flush=True)


if __name__ == "__main__":
    main()
