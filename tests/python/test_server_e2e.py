"""End-to-end tests of mha_server through the Python client, checked against PyTorch.

Two independent references, both in float64 on exactly the values the server receives:
  * torch.nn.MultiheadAttention (PyTorch's own multi_head_attention_forward) for standard MHA;
  * a plain-torch implementation written here (`ref_attention` / `ref_mha`) for what PyTorch's module cannot express:
    GQA / MQA, bottom-right causal with Tq != Tk, custom scale and head_dim, head_mask, fully masked rows.
"""

import math
import zlib

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mhaclient

BACKENDS = ["cpu", "reference"]
ATOL, RTOL = 1e-4, 1e-3  # fp32 on the wire vs a float64 reference.

torch.set_num_threads(2)


def rng_for(*key):
    """A deterministic generator per test case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def assert_close(got, want, atol=ATOL, rtol=RTOL, what="output"):
    got = np.asarray(got, dtype=np.float64)
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, "%s shape %s, expected %s" % (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), "%s has non-finite values" % what
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)


def make_weights(rng, d_model, d_kv, d_v, H, Hkv, dk, bias=True):
    w = {
        "w_q": f32(rng, d_model, H * dk, scale=1 / math.sqrt(d_model)),
        "w_k": f32(rng, d_kv, Hkv * dk, scale=1 / math.sqrt(d_kv)),
        "w_v": f32(rng, d_v, Hkv * dk, scale=1 / math.sqrt(d_v)),
        "w_o": f32(rng, H * dk, d_model, scale=1 / math.sqrt(H * dk)),
    }
    if bias:
        w.update(b_q=f32(rng, H * dk, scale=0.3), b_k=f32(rng, Hkv * dk, scale=0.3),
                 b_v=f32(rng, Hkv * dk, scale=0.3), b_o=f32(rng, d_model, scale=0.3))
    return w


def random_mask(rng, shape, p_inf=0.25):
    """Additive float mask with some -inf entries; column 0 always stays finite (no fully masked rows)."""
    m = f32(rng, *shape, scale=0.5)
    m[(rng.random(shape) < p_inf) & (np.arange(shape[-1]) > 0)] = -np.inf
    return m


# ---------------------------------------------------------------------------------------------------------------
# Plain-torch reference.

def ref_attention(q, k, v, causal=False, scale=0.0, key_lengths=None, attn_mask=None):
    """q [B, H, Tq, dk], k / v [B, Hkv, Tk, dk] (float64 tensors). Returns (out [B, H, Tq, dk], p [B, H, Tq, Tk]).

    Query head h uses KV head h // (H / Hkv); causal is bottom-right aligned (key j visible to query i iff
    j <= i + Tk - Tq); a row with every key masked gets zero probabilities.
    """
    B, H, Tq, dk = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    assert H % Hkv == 0
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale else 1.0 / math.sqrt(dk))
    allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
    if causal:
        i = torch.arange(Tq)[:, None]
        j = torch.arange(Tk)[None, :]
        allowed = allowed & (j <= i + (Tk - Tq))
    if key_lengths is not None:
        lengths = torch.tensor(list(key_lengths))
        allowed = allowed & (torch.arange(Tk)[None, :] < lengths[:, None])[:, None, None, :]
    if attn_mask is not None:
        m = t64(attn_mask)
        m = (m if m.dim() == 3 else m[None])[:, None]  # [B or 1, 1, Tq, Tk]
        neg_inf = torch.isneginf(m)
        allowed = allowed & ~neg_inf
        s = s + torch.where(neg_inf, torch.zeros_like(m), m)
    s = s.masked_fill(~allowed, -math.inf)
    row_any = allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~row_any, 0.0), dim=-1) * row_any
    return p @ v, p


def ref_mha(x, kin, vin, w, H, Hkv, dk, causal=False, scale=0.0, key_lengths=None, attn_mask=None,
            head_mask=None):
    """Full layer with Y = X W weights ([in, out]). Returns (output [B, Tq, d_model], p [B, H, Tq, Tk])."""
    kin = x if kin is None else kin
    vin = kin if vin is None else vin
    x, kin, vin = t64(x), t64(kin), t64(vin)
    W = {n: t64(a) for n, a in w.items()}

    def proj(inp, name, heads):
        y = inp @ W["w_" + name]
        if ("b_" + name) in W:
            y = y + W["b_" + name]
        return y.view(inp.shape[0], inp.shape[1], heads, dk).permute(0, 2, 1, 3)

    out, p = ref_attention(proj(x, "q", H), proj(kin, "k", Hkv), proj(vin, "v", Hkv), causal, scale,
                           key_lengths, attn_mask)
    if head_mask is not None:
        out = out * t64(head_mask)[None, :, None, None]
    y = out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], H * dk) @ W["w_o"]
    if "b_o" in W:
        y = y + W["b_o"]
    return y, p


# ---------------------------------------------------------------------------------------------------------------
# Server basics.

def test_health_serving(client):
    assert client.health() == "SERVING"


def test_request_id_and_trace_reach_the_log_and_the_response(client, server):
    import time
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = (("x-request-id", "e2e-req-1"), ("traceparent", "00-%s-00f067aa0ba902b7-01" % trace_id))
    _, call = client._stub.ListLayers.with_call(client._pb.ListLayersRequest(), metadata=metadata, timeout=10)
    assert ("x-request-id", "e2e-req-1") in call.initial_metadata()
    want = "rid=e2e-req-1 trace=%s rpc=ListLayers" % trace_id
    for _ in range(50):  # the log line is written as the call finishes
        with open(server.log_path, errors="replace") as f:
            if want in f.read():
                return
        time.sleep(0.05)
    pytest.fail("no %r in the server log" % want)


def test_server_info(client):
    info = client.server_info()
    available = {b["name"] for b in info["backends"] if b["available"]}
    assert {"cpu", "reference"} <= available
    assert info["default_backend"] in available
    assert info["limits"]["compute_threads"] == 2


def test_bf16_helper_matches_torch():
    rng = np.random.default_rng(7)
    a = np.concatenate([f32(rng, 1000, scale=100.0),
                        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.0e38],
                                 dtype=np.float32)])
    want = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = np.frombuffer(mhaclient.to_bf16_bytes(a), dtype="<u2")
    np.testing.assert_array_equal(got, want)
    back = mhaclient.from_bf16_bytes(mhaclient.to_bf16_bytes(a), a.shape)
    np.testing.assert_array_equal(back, torch.from_numpy(a).to(torch.bfloat16).float().numpy())


# ---------------------------------------------------------------------------------------------------------------
# MultiHeadAttention vs torch.nn.MultiheadAttention.

TORCH_CASES = {
    # id: (B, Tq, Tk, E, kdim, vdim, H, bias, key_lengths, mask, causal, value_absent)
    "self": (2, 8, 8, 32, None, None, 4, True, None, None, False, False),
    "self-nobias": (2, 8, 8, 32, None, None, 4, False, None, None, False, False),
    "self-keylens": (3, 7, 7, 32, None, None, 4, True, [7, 3, 1], None, False, False),
    "self-mask": (2, 8, 8, 32, None, None, 2, True, None, "2d", False, False),
    "self-mask-keylens": (2, 9, 9, 48, None, None, 6, True, [4, 9], "2d", False, False),
    "self-causal": (2, 10, 10, 32, None, None, 4, True, None, None, True, False),
    "cross-kdim-vdim": (2, 5, 11, 32, 24, 40, 4, True, [11, 6], "2d", False, False),
    "cross-causal": (2, 5, 9, 32, 20, 20, 8, True, None, None, True, False),
    "cross-value-absent": (3, 4, 6, 32, 16, 16, 2, True, [2, 6, 5], None, False, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_mha_vs_torch_module(client, case, backend):
    B, Tq, Tk, E, kdim, vdim, H, bias, key_lengths, mask, causal, value_absent = TORCH_CASES[case]
    rng = rng_for("torch", case)
    torch.manual_seed(zlib.crc32(case.encode()))
    cross = kdim is not None
    # Left in training mode (dropout is 0): torch 1.13's eval-mode fast path breaks on bias=False.
    mha = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, kdim=kdim, vdim=vdim, batch_first=True,
                                      dtype=torch.float64)
    with torch.no_grad():
        for p in mha.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3)  # PyTorch initialises biases to zero; make them count.
            p.copy_(p.float().double())  # exactly what goes over the wire as fp32.

    x = f32(rng, B, Tq, E)
    kin = f32(rng, B, Tk, kdim) if cross else None
    vin = None if (not cross or value_absent) else f32(rng, B, Tk, vdim)
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.detach().chunk(3, dim=0)
    else:
        wq, wk, wv = mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach()
    weights = {"w_q": wq.T, "w_k": wk.T, "w_v": wv.T, "w_o": mha.out_proj.weight.detach().T}
    if bias:
        bq, bk, bv = mha.in_proj_bias.detach().chunk(3)
        weights.update(b_q=bq, b_k=bk, b_v=bv, b_o=mha.out_proj.bias.detach())
    weights = {n: t.numpy().astype(np.float32) for n, t in weights.items()}

    attn_mask = random_mask(rng, (Tq, Tk)) if mask == "2d" else None
    torch_mask = None if attn_mask is None else t64(attn_mask)
    if causal:  # the server gets causal=True; PyTorch gets the equivalent bottom-right -inf mask.
        blocked = torch.ones(Tq, Tk, dtype=torch.bool).triu(diagonal=Tk - Tq + 1)
        causal_mask = torch.zeros(Tq, Tk, dtype=torch.float64).masked_fill(blocked, -math.inf)
        torch_mask = causal_mask if torch_mask is None else torch_mask + causal_mask
    kpm = None
    if key_lengths is not None:
        kpm = torch.arange(Tk)[None, :] >= torch.tensor(key_lengths)[:, None]

    tq = t64(x)
    tk = tq if not cross else t64(kin)
    tv = tk if vin is None else t64(vin)
    with torch.no_grad():
        want, want_w = mha(tq, tk, tv, key_padding_mask=kpm, attn_mask=torch_mask, need_weights=True,
                           average_attn_weights=False)

    r = client.multi_head_attention(x, key=kin, value=vin, weights=weights, num_heads=H, causal=causal,
                                    key_lengths=key_lengths, attn_mask=attn_mask, return_weights=True,
                                    backend=backend)
    assert r.backend == backend
    assert r.output.dtype == np.float32
    assert_close(r.output, want)
    assert_close(r.attention_weights, want_w, what="attention_weights")
    assert r.queue_us >= 0 and r.compute_us >= 0


# ---------------------------------------------------------------------------------------------------------------
# MultiHeadAttention vs the plain-torch reference (GQA, MQA, decode-style causal, custom scale / head_dim).

PLAIN_CASES = {
    # id: dict of B, Tq, Tk (None = self), d_model, H, Hkv, dk, causal, scale, key_lengths, mask
    "gqa-8q-2kv": dict(B=2, Tq=8, Tk=None, d=64, H=8, Hkv=2, dk=8),
    "mqa-4q-1kv": dict(B=2, Tq=6, Tk=None, d=32, H=4, Hkv=1, dk=8),
    "gqa-headdim12": dict(B=2, Tq=5, Tk=7, d=32, H=4, Hkv=2, dk=12, key_lengths=[7, 2]),
    "mha-scale0.3-mask3d": dict(B=2, Tq=6, Tk=6, d=32, H=4, Hkv=4, dk=0, scale=0.3, mask="3d"),
    "causal-self-gqa-keylens": dict(B=3, Tq=12, Tk=None, d=32, H=4, Hkv=2, dk=0, causal=True,
                                    key_lengths=[12, 5, 1]),
    "decode-tq1-causal": dict(B=2, Tq=1, Tk=13, d=32, H=4, Hkv=4, dk=0, causal=True),
    "decode-tq2-causal-mqa": dict(B=2, Tq=2, Tk=16, d=32, H=4, Hkv=1, dk=0, causal=True, mask="2d"),
    "decode-tq3-causal-gqa-keylens": dict(B=3, Tq=3, Tk=17, d=48, H=6, Hkv=3, dk=0, causal=True,
                                          key_lengths=[17, 9, 3]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_mha_vs_plain_reference(client, case, backend):
    c = PLAIN_CASES[case]
    rng = rng_for("plain", case)
    B, Tq, d, H, Hkv = c["B"], c["Tq"], c["d"], c["H"], c["Hkv"]
    dk = c["dk"] or d // H
    Tk = c["Tk"] or Tq
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    x = f32(rng, B, Tq, d)
    kin = f32(rng, B, Tk, d) if c["Tk"] else None
    mask = c.get("mask")
    attn_mask = None if mask is None else random_mask(rng, (Tq, Tk) if mask == "2d" else (B, Tq, Tk))
    kw = dict(causal=c.get("causal", False), scale=c.get("scale", 0.0), key_lengths=c.get("key_lengths"),
              attn_mask=attn_mask)
    want, want_w = ref_mha(x, kin, None, w, H, Hkv, dk, **kw)
    r = client.multi_head_attention(x, key=kin, weights=w, num_heads=H, num_kv_heads=Hkv, head_dim=c["dk"],
                                    return_weights=True, backend=backend, **kw)
    assert r.backend == backend
    assert_close(r.output, want)
    assert_close(r.attention_weights, want_w, what="attention_weights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_mask(client, backend):
    rng = rng_for("head_mask")
    B, T, d, H, Hkv = 2, 6, 32, 4, 2
    w = make_weights(rng, d, d, d, H, Hkv, d // H)
    x = f32(rng, B, T, d)
    head_mask = [1.0, 0.0, 0.5, 2.0]
    want, _ = ref_mha(x, None, None, w, H, Hkv, d // H, head_mask=head_mask)
    r = client.multi_head_attention(x, weights=w, num_heads=H, num_kv_heads=Hkv, head_mask=head_mask,
                                    backend=backend)
    assert_close(r.output, want)
    # Masking every head leaves only the output bias.
    r0 = client.multi_head_attention(x, weights=w, num_heads=H, num_kv_heads=Hkv, head_mask=[0.0] * H,
                                     backend=backend)
    assert_close(r0.output, np.broadcast_to(w["b_o"], (B, T, d)))


# ---------------------------------------------------------------------------------------------------------------
# ScaledDotProductAttention vs the plain-torch reference.

SDPA_CASES = {
    # id: B, Tq, Tk, H, Hkv, dk, causal, scale, key_lengths, mask
    "mha": (2, 7, 7, 4, 4, 8, False, 0.0, None, None),
    "gqa-keylens": (2, 6, 9, 8, 2, 16, False, 0.0, [9, 4], None),
    "mqa-scale-mask": (3, 5, 5, 4, 1, 8, False, 0.25, None, "2d"),
    "causal-self": (2, 9, 9, 2, 2, 8, True, 0.0, None, None),
    "decode-tq1-causal-gqa": (2, 1, 20, 4, 2, 8, True, 0.0, [20, 11], None),
    "decode-tq3-causal-mask3d": (2, 3, 12, 4, 4, 8, True, 0.0, None, "3d"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_vs_plain_reference(client, case, backend):
    B, Tq, Tk, H, Hkv, dk, causal, scale, key_lengths, mask = SDPA_CASES[case]
    rng = rng_for("sdpa", case)
    q, k, v = f32(rng, B, Tq, H, dk), f32(rng, B, Tk, Hkv, dk), f32(rng, B, Tk, Hkv, dk)
    attn_mask = None if mask is None else random_mask(rng, (Tq, Tk) if mask == "2d" else (B, Tq, Tk))
    want, want_w = ref_attention(t64(q).permute(0, 2, 1, 3), t64(k).permute(0, 2, 1, 3),
                                 t64(v).permute(0, 2, 1, 3), causal, scale, key_lengths, attn_mask)
    r = client.scaled_dot_product_attention(q, k, v, causal=causal, scale=scale, key_lengths=key_lengths,
                                            attn_mask=attn_mask, return_weights=True, backend=backend)
    assert r.backend == backend
    assert_close(r.output, want.permute(0, 2, 1, 3))
    assert_close(r.attention_weights, want_w, what="attention_weights")


def test_sdpa_matches_torch_functional(client):
    """Cross-check of ref_attention itself: plain MHA SDPA equals PyTorch's softmax(q k^T / sqrt(d)) v."""
    rng = rng_for("sdpa-torch")
    q, k, v = f32(rng, 2, 5, 3, 8), f32(rng, 2, 7, 3, 8), f32(rng, 2, 7, 3, 8)
    tq, tk, tv = (t64(a).permute(0, 2, 1, 3) for a in (q, k, v))
    want = F.softmax(tq @ tk.transpose(-1, -2) / math.sqrt(8), dim=-1) @ tv
    mine, _ = ref_attention(tq, tk, tv)
    assert_close(mine, want)
    r = client.scaled_dot_product_attention(q, k, v, backend="cpu")
    assert_close(r.output, want.permute(0, 2, 1, 3))


# ---------------------------------------------------------------------------------------------------------------
# Fully masked rows: zero attention weights, zero attention output (so the layer output is b_o), never NaN.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["key_lengths-0", "causal-tq-gt-tk", "mask-row-all-inf"])
def test_fully_masked_rows(client, how, backend):
    rng = rng_for("masked", how)
    B, d, H, Hkv = 2, 32, 4, 2
    dk = d // H
    Tq, Tk = (6, 4) if how == "causal-tq-gt-tk" else (5, 5)
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    x, kin = f32(rng, B, Tq, d), f32(rng, B, Tk, d)
    kw = dict(causal=False, key_lengths=None, attn_mask=None)
    if how == "key_lengths-0":
        kw["key_lengths"] = [0, 3]
        dead = (np.s_[0, :, :, :], np.s_[0, :, :])  # every row of batch item 0
    elif how == "causal-tq-gt-tk":
        kw["causal"] = True  # bottom-right: query i sees key j iff j <= i - 2, so rows 0 and 1 see nothing.
        dead = (np.s_[:, :, :2, :], np.s_[:, :2, :])
    else:
        m = random_mask(rng, (Tq, Tk))
        m[2, :] = -np.inf
        kw["attn_mask"] = m
        dead = (np.s_[:, :, 2, :], np.s_[:, 2, :])
    want, want_w = ref_mha(x, kin, None, w, H, Hkv, dk, **kw)
    r = client.multi_head_attention(x, key=kin, weights=w, num_heads=H, num_kv_heads=Hkv, return_weights=True,
                                    backend=backend, **kw)
    assert np.all(r.attention_weights[dead[0]] == 0.0)
    assert_close(r.output[dead[1]], np.broadcast_to(w["b_o"], r.output[dead[1]].shape))
    assert_close(r.output, want)
    assert_close(r.attention_weights, want_w, what="attention_weights")

    # The same through ScaledDotProductAttention: the output of a dead row is exactly zero.
    q, k, v = f32(rng, B, Tq, H, dk), f32(rng, B, Tk, Hkv, dk), f32(rng, B, Tk, Hkv, dk)
    want_o, _ = ref_attention(t64(q).permute(0, 2, 1, 3), t64(k).permute(0, 2, 1, 3), t64(v).permute(0, 2, 1, 3),
                              **kw)
    rs = client.scaled_dot_product_attention(q, k, v, return_weights=True, backend=backend, **kw)
    assert np.all(rs.attention_weights[dead[0]] == 0.0)
    assert np.all(rs.output.transpose(0, 2, 1, 3)[dead[0]] == 0.0)
    assert_close(rs.output, want_o.permute(0, 2, 1, 3))


# ---------------------------------------------------------------------------------------------------------------
# fp16 / bf16 on the wire.

def round_to(a, wire):
    """What the server sees of a float32 array sent as `wire` (rounded with torch, independently of mhaclient)."""
    if wire == "fp16":
        return np.asarray(a, dtype=np.float16)
    if wire == "bf16":
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()
    return np.asarray(a, dtype=np.float32)


def is_bf16_exact(a):
    return bool(np.all((np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & 0xFFFF) == 0))


LOWP_TOL = {"fp16": 1.5e-3, "bf16": 1e-2, "fp32": ATOL}
# A path that computes in bf16 (the CPU backend's bf16 projections, on CPUs with native bf16; the proto's DataType)
# rounds the heads on the way: the proto's bf16-compute tolerance.
BF16_COMPUTE_TOL = 3e-2


def computes_in_bf16(client, backend):
    """Whether `backend` projects bf16 layer calls in bf16 on this server (its GetServerInfo device says so)."""
    for b in client.server_info()["backends"]:
        if b["name"] == backend:
            return "bf16 projections on" in b.get("device", "")
    return False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wire,out", [("fp16", None), ("bf16", None), ("fp16", "fp32"), ("bf16", "fp16"),
                                      ("fp32", "bf16")],
                         ids=["fp16", "bf16", "fp16-out-fp32", "bf16-out-fp16", "fp32-out-bf16"])
@pytest.mark.parametrize("api", ["mha", "sdpa"])
def test_low_precision(client, api, wire, out, backend):
    rng = rng_for("lowp", api, wire, out)
    B, Tq, Tk, d, H, Hkv = 2, 5, 8, 32, 4, 2
    dk = d // H
    out_kind = out or wire
    # Inputs are rounded to the wire dtype first, so the reference sees exactly what the server decodes.
    arrays = {"x": f32(rng, B, Tq, d), "kin": f32(rng, B, Tk, d), "mask": random_mask(rng, (Tq, Tk)),
              "q": f32(rng, B, Tq, H, dk), "k": f32(rng, B, Tk, Hkv, dk), "v": f32(rng, B, Tk, Hkv, dk)}
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    arrays = {n: round_to(a, wire) for n, a in arrays.items()}
    w = {n: round_to(a, wire) for n, a in w.items()}
    # fp16 arrays go as FP16 by themselves; bf16 needs wire_dtype (numpy has no bfloat16).
    wire_dtype = "bf16" if wire == "bf16" else None
    if api == "mha":
        want, want_w = ref_mha(arrays["x"], arrays["kin"], None, w, H, Hkv, dk, key_lengths=[8, 5],
                               attn_mask=arrays["mask"])
        r = client.multi_head_attention(arrays["x"], key=arrays["kin"], weights=w, num_heads=H, num_kv_heads=Hkv,
                                        key_lengths=[8, 5], attn_mask=arrays["mask"], return_weights=True,
                                        output_dtype=out, backend=backend, wire_dtype=wire_dtype)
    else:
        tq, tk, tv = (t64(arrays[n]).permute(0, 2, 1, 3) for n in ("q", "k", "v"))
        want, want_w = ref_attention(tq, tk, tv, key_lengths=[8, 5], attn_mask=arrays["mask"])
        want = want.permute(0, 2, 1, 3)
        r = client.scaled_dot_product_attention(arrays["q"], arrays["k"], arrays["v"], key_lengths=[8, 5],
                                                attn_mask=arrays["mask"], return_weights=True, output_dtype=out,
                                                backend=backend, wire_dtype=wire_dtype)
    # Output dtype: the requested one, else the input's. BF16 decodes to float32 with a zero lower half.
    expected_np = np.float16 if out_kind == "fp16" else np.float32
    assert r.output.dtype == expected_np and r.attention_weights.dtype == expected_np
    if out_kind == "bf16":
        assert is_bf16_exact(r.output) and is_bf16_exact(r.attention_weights)
    # Tolerance: the output rounding (fp16 / bf16), or fp32 compute only when the output is fp32; wider where the
    # layer computes in bf16.
    tol = LOWP_TOL[out_kind]
    if api == "mha" and wire == "bf16" and computes_in_bf16(client, backend):
        tol = max(tol, BF16_COMPUTE_TOL)
    assert_close(r.output, want, atol=tol, rtol=tol)
    assert_close(r.attention_weights, want_w, atol=tol, rtol=tol, what="attention_weights")


# ---------------------------------------------------------------------------------------------------------------
# Named layers.

def test_layer_round_trip(client):
    rng = rng_for("layer")
    B, Tq, Tk, d, dkv, H, Hkv, dk = 2, 4, 7, 32, 24, 4, 2, 8
    w = make_weights(rng, d, dkv, dkv, H, Hkv, dk)
    name = "e2e-gqa_layer.1"
    info = client.load_layer(name, w, num_heads=H, num_kv_heads=Hkv)
    assert info.name == name and info.source == "rpc"
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (H, Hkv, dk)
    assert info.scale == pytest.approx(1 / math.sqrt(dk), rel=1e-6)
    assert (info.d_model, info.d_kv_in, info.d_v_in) == (d, dkv, dkv)
    assert info.has_bias and not info.causal
    assert info.size_bytes == 4 * sum(a.size for a in w.values())
    try:
        listed = {l.name: l for l in client.list_layers()}
        assert listed[name] == info

        with pytest.raises(grpc.RpcError) as err:
            client.load_layer(name, w, num_heads=H, num_kv_heads=Hkv)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS

        x, kin = f32(rng, B, Tq, d), f32(rng, B, Tk, dkv)
        for backend in BACKENDS:
            for causal in (False, True):  # the request's causal is OR-ed with the layer's (False here).
                by_name = client.multi_head_attention(x, key=kin, layer=name, causal=causal, key_lengths=[7, 3],
                                                      return_weights=True, backend=backend)
                inline = client.multi_head_attention(x, key=kin, weights=w, num_heads=H, num_kv_heads=Hkv,
                                                     causal=causal, key_lengths=[7, 3], return_weights=True,
                                                     backend=backend)
                np.testing.assert_allclose(by_name.output, inline.output, atol=1e-6, rtol=1e-6)
                np.testing.assert_allclose(by_name.attention_weights, inline.attention_weights, atol=1e-6)
                want, _ = ref_mha(x, kin, None, w, H, Hkv, dk, causal=causal, key_lengths=[7, 3])
                assert_close(by_name.output, want)

        # Heads given with a layer must agree with it.
        with pytest.raises(grpc.RpcError) as err:
            client.multi_head_attention(x, key=kin, layer=name, num_heads=H + 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.unload_layer(name)
    assert name not in {l.name for l in client.list_layers()}
    with pytest.raises(grpc.RpcError) as err:
        client.multi_head_attention(f32(rng, 1, 2, d), layer=name)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.unload_layer(name)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_causal_layer_is_causal_whatever_the_request(client):
    rng = rng_for("causal-layer")
    B, T, d, H = 2, 6, 32, 4
    w = make_weights(rng, d, d, d, H, H, d // H, bias=False)
    name = "e2e-causal"
    client.load_layer(name, w, num_heads=H, causal=True)
    try:
        assert {l.name: l for l in client.list_layers()}[name].causal
        x = f32(rng, B, T, d)
        want, want_w = ref_mha(x, None, None, w, H, H, d // H, causal=True)
        r = client.multi_head_attention(x, layer=name, causal=False, return_weights=True, backend="cpu")
        assert_close(r.output, want)
        assert_close(r.attention_weights, want_w, what="attention_weights")
    finally:
        client.unload_layer(name)


def test_demo_layer(client):
    demo = {l.name: l for l in client.list_layers()}["demo"]
    assert (demo.d_model, demo.num_heads, demo.num_kv_heads, demo.head_dim) == (512, 8, 8, 64)
    assert demo.source == "builtin"
    x = f32(rng_for("demo"), 2, 16, 512)
    cpu = client.multi_head_attention(x, layer="demo", backend="cpu", return_weights=True)
    ref = client.multi_head_attention(x, layer="demo", backend="reference", return_weights=True)
    assert (cpu.backend, ref.backend) == ("cpu", "reference")
    assert cpu.output.shape == (2, 16, 512) and cpu.attention_weights.shape == (2, 8, 16, 16)
    assert_close(cpu.output, ref.output)
    assert_close(cpu.attention_weights, ref.attention_weights, what="attention_weights")
    np.testing.assert_allclose(ref.attention_weights.sum(-1), 1.0, atol=1e-5)
    with pytest.raises(grpc.RpcError) as err:
        client.unload_layer("demo")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---------------------------------------------------------------------------------------------------------------
# Errors: the right status code, and the server keeps serving.

def _good_weights():
    return make_weights(rng_for("errors"), 16, 16, 16, 2, 2, 8)


def _bad_tensor(shape, dtype, nbytes):
    t = mhaclient.to_tensor(np.zeros(1, np.float32))
    return type(t)(shape=shape, dtype=dtype, data=b"\0" * nbytes)


ERROR_CASES = {
    "query-rank2": (grpc.StatusCode.INVALID_ARGUMENT,
                    lambda c: c.multi_head_attention(np.zeros((4, 16), np.float32), weights=_good_weights(),
                                                     num_heads=2)),
    "query-rank2-demo": (grpc.StatusCode.INVALID_ARGUMENT,
                         lambda c: c.multi_head_attention(np.zeros((4, 512), np.float32), layer="demo")),
    "query-wrong-d_model": (grpc.StatusCode.INVALID_ARGUMENT,
                            lambda c: c.multi_head_attention(np.zeros((1, 4, 15), np.float32),
                                                             weights=_good_weights(), num_heads=2)),
    "inline-without-num_heads": (grpc.StatusCode.INVALID_ARGUMENT,
                                 lambda c: c.multi_head_attention(np.zeros((1, 4, 16), np.float32),
                                                                  weights=_good_weights())),
    "kv-heads-not-dividing": (grpc.StatusCode.INVALID_ARGUMENT,
                              lambda c: c.scaled_dot_product_attention(np.zeros((1, 2, 3, 4), np.float32),
                                                                       np.zeros((1, 2, 2, 4), np.float32),
                                                                       np.zeros((1, 2, 2, 4), np.float32))),
    "key_lengths-too-long": (grpc.StatusCode.INVALID_ARGUMENT,
                             lambda c: c.multi_head_attention(np.zeros((1, 4, 16), np.float32),
                                                              weights=_good_weights(), num_heads=2,
                                                              key_lengths=[5])),
    "key_lengths-wrong-count": (grpc.StatusCode.INVALID_ARGUMENT,
                                lambda c: c.multi_head_attention(np.zeros((2, 4, 16), np.float32),
                                                                 weights=_good_weights(), num_heads=2,
                                                                 key_lengths=[4])),
    "mask-nan": (grpc.StatusCode.INVALID_ARGUMENT,
                 lambda c: c.multi_head_attention(np.zeros((1, 2, 16), np.float32), weights=_good_weights(),
                                                  num_heads=2, attn_mask=np.array([[0, np.nan], [0, 0]],
                                                                                  np.float32))),
    "mask-wrong-shape": (grpc.StatusCode.INVALID_ARGUMENT,
                         lambda c: c.multi_head_attention(np.zeros((1, 2, 16), np.float32),
                                                          weights=_good_weights(), num_heads=2,
                                                          attn_mask=np.zeros((3, 2), np.float32))),
    "head_mask-wrong-length": (grpc.StatusCode.INVALID_ARGUMENT,
                               lambda c: c.multi_head_attention(np.zeros((1, 2, 16), np.float32),
                                                                weights=_good_weights(), num_heads=2,
                                                                head_mask=[1.0])),
    "weight-wrong-shape": (grpc.StatusCode.INVALID_ARGUMENT,
                           lambda c: c.multi_head_attention(
                               np.zeros((1, 2, 16), np.float32),
                               weights=dict(_good_weights(), w_o=np.zeros((16, 15), np.float32)), num_heads=2)),
    "data-size-mismatch": (grpc.StatusCode.INVALID_ARGUMENT,
                           lambda c: c.scaled_dot_product_attention(_bad_tensor([1, 2, 1, 4], 1, 31),
                                                                    np.zeros((1, 2, 1, 4), np.float32),
                                                                    np.zeros((1, 2, 1, 4), np.float32))),
    "dtype-unspecified": (grpc.StatusCode.INVALID_ARGUMENT,
                          lambda c: c.scaled_dot_product_attention(_bad_tensor([1, 2, 1, 4], 0, 32),
                                                                   np.zeros((1, 2, 1, 4), np.float32),
                                                                   np.zeros((1, 2, 1, 4), np.float32))),
    "scale-inf": (grpc.StatusCode.INVALID_ARGUMENT,
                  lambda c: c.scaled_dot_product_attention(np.zeros((1, 2, 1, 4), np.float32),
                                                           np.zeros((1, 2, 1, 4), np.float32),
                                                           np.zeros((1, 2, 1, 4), np.float32), scale=np.inf)),
    "bad-layer-name": (grpc.StatusCode.INVALID_ARGUMENT,
                       lambda c: c.load_layer("bad name/", _good_weights(), num_heads=2)),
    "unknown-layer": (grpc.StatusCode.NOT_FOUND,
                      lambda c: c.multi_head_attention(np.zeros((1, 2, 512), np.float32), layer="no-such-layer")),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_then_keeps_serving(client, case):
    code, call = ERROR_CASES[case]
    with pytest.raises(grpc.RpcError) as err:
        call(client)
    assert err.value.code() == code, "%s: %s" % (err.value.code(), err.value.details())
    assert err.value.details()
    r = client.multi_head_attention(np.ones((1, 3, 16), np.float32), weights=_good_weights(), num_heads=2)
    assert r.output.shape == (1, 3, 16) and np.all(np.isfinite(r.output))
    assert client.health() == "SERVING"


def test_boolean_mask_reads_as_torch_sdpa_reads_it(client):
    # True attends, as torch 2's scaled_dot_product_attention reads a bool mask (Debian's torch 1.13 has none, so
    # the softmax is written out here).
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    k = rng.standard_normal((2, 7, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 7, 2, 8)).astype(np.float32)
    keep = rng.random((6, 7)) > 0.4
    keep[:, 0] = True  # every query keeps a key: torch gives NaN rows otherwise
    got = client.scaled_dot_product_attention(q, k, v, attn_mask=keep).output
    qh, kh, vh = (torch.from_numpy(x).double().transpose(1, 2) for x in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(~torch.from_numpy(keep), float("-inf"))
    want = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2).numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


# Tensors in shared memory: the same results as through the messages, bit for bit.

def test_shared_memory_round_trip(client):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 16, 512)).astype(np.float32)
    want = client.multi_head_attention(x, layer="demo").output
    with mhaclient.SharedMemoryRegion(client, "py-mha", 1 << 20) as region:
        got = client.multi_head_attention(region.put(x, 0), layer="demo",
                                          output_shared_memory=region.output_at(1 << 19))
        np.testing.assert_array_equal(got.output, want)
        # SDPA with bf16 tensors there and the output back in the message.
        q, k, v = (rng.standard_normal((1, 8, 2, 32)).astype(np.float32) for _ in range(3))
        plain = client.scaled_dot_product_attention(q, k, v, wire_dtype="bf16", backend="cpu").output
        shared = client.scaled_dot_product_attention(region.put(q, 0, "bf16"), region.put(k, 4096, "bf16"),
                                                     region.put(v, 8192, "bf16"), backend="cpu").output
        np.testing.assert_array_equal(shared, plain)


def test_shared_memory_errors_name_the_field(client):
    with mhaclient.SharedMemoryRegion(client, "py-errors", 4096) as region:
        with pytest.raises(grpc.RpcError) as err:
            client.multi_head_attention(region.put(np.zeros((1, 2, 512), np.float32), 0), layer="demo",
                                        output_shared_memory=region.output_at(0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "output_shared_memory" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # unregistered by the context manager
        client.multi_head_attention(_shared_ref("py-errors"), layer="demo")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "query.shared_memory.region" in err.value.details()
    assert client.health() == "SERVING"


def test_shared_memory_status_lists_the_registered_regions(client):
    with mhaclient.SharedMemoryRegion(client, "py-status-b", 8192) as b, \
            mhaclient.SharedMemoryRegion(client, "py-status-a", 4096):
        listed = [r for r in client.shared_memory_status() if r["name"].startswith("py-status-")]
        assert [(r["name"], r["byte_size"], r["intact"]) for r in listed] == [
            ("py-status-a", 4096, True), ("py-status-b", 8192, True)]
        assert client.shared_memory_status("py-status-b")[0]["key"] == b.key
    with pytest.raises(grpc.RpcError) as err:
        client.shared_memory_status("py-status-a")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _shared_ref(region):
    t = mhaclient.to_tensor(np.zeros((1, 2, 512), np.float32))
    t.ClearField("data")
    t.shared_memory.region = region
    return t
