"""KV-cache sessions and RoPE end to end: the real server through grpcio, against PyTorch.

The references are written the way Hugging Face's LLaMA decodes with a KV cache: q, k, v projected, RoPE applied
with apply_rotary_pos_emb (rotate-half; GPT-J's interleaved pairs for the other convention) at the tokens' cache
positions, k and v appended to a cache, and scaled dot-product attention of the new queries over the whole cache
(torch.nn.functional.scaled_dot_product_attention where this torch has it, its definition in torch ops otherwise:
Debian's torch 1.13 predates it). Everything in float64.
"""

import math

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mhaclient
from test_server_e2e import assert_close, f32, make_weights, rng_for, t64

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


def rope_cos_sin(positions, dim, theta):
    """cos and sin [T, dim] of HF's rotary embedding (inv_freq over pairs, emb = cat(freqs, freqs)), float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary_pos_emb(x, positions, theta, rope_dim=None, interleaved=False):
    """x [..., T, heads, d_k] rotated on its first rope_dim dims: HF's apply_rotary_pos_emb (rotate-half), or GPT-J's
    rotate_every_two when interleaved."""
    d = x.shape[-1] if not rope_dim else rope_dim
    rot, rest = x[..., :d], x[..., d:]
    if interleaved:
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv_freq)[:, None, :]  # [T, 1, d/2]
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([even * ang.cos() - odd * ang.sin(), odd * ang.cos() + even * ang.sin()], dim=-1)
        rot = out.flatten(-2)
    else:
        cos, sin = rope_cos_sin(positions, d, theta)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d]: broadcast over heads
        rot = rot * cos + rotate_half(rot) * sin
    return torch.cat([rot, rest], dim=-1)


def sdpa_over_cache(q, k_cache, v_cache, scale):
    """New queries q [n, H, d_k] over the whole cache k, v [T, Hkv, d_k], causal bottom-right (query i sees keys
    0..T-n+i): torch's SDPA with GQA's KV heads repeated for their query heads. Returns [n, H, d_k]."""
    n, H = q.shape[0], q.shape[1]
    T, Hkv = k_cache.shape[0], k_cache.shape[1]
    qh, kh, vh = q.permute(1, 0, 2), k_cache.permute(1, 0, 2), v_cache.permute(1, 0, 2)
    kh = kh.repeat_interleave(H // Hkv, dim=0)
    vh = vh.repeat_interleave(H // Hkv, dim=0)
    allowed = torch.arange(T)[None, :] <= torch.arange(n)[:, None] + (T - n)
    if HAS_SDPA:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    else:
        s = (qh @ kh.transpose(-1, -2)) * scale
        out = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1) @ vh
    return out.permute(1, 0, 2)


class TorchDecoder:
    """One attention layer decoding with a KV cache in torch, as HF's LLaMA does; the server's session must agree."""

    def __init__(self, H, Hkv, dk, theta, weights=None, rope_dim=None, interleaved=False, cache_dtype=None):
        self.H, self.Hkv, self.dk, self.theta = H, Hkv, dk, theta
        self.rope_dim, self.interleaved = rope_dim, interleaved
        self.w = {n: t64(a) for n, a in (weights or {}).items()}
        self.k = torch.zeros(0, Hkv, dk, dtype=torch.float64)
        self.v = torch.zeros(0, Hkv, dk, dtype=torch.float64)
        self.cache_dtype = cache_dtype

    def _stored(self, x):
        """What the cache keeps: bf16 / fp16 caches round each key and value once."""
        if self.cache_dtype == "bf16":
            return x.to(torch.bfloat16).to(torch.float64)
        if self.cache_dtype == "fp16":
            return x.to(torch.float16).to(torch.float64)
        return x

    def step_heads(self, q, k, v):
        """q [n, H, dk], k, v [n, Hkv, dk] (already projected): rotate, cache, attend. Returns [n, H, dk]."""
        q, k, v = t64(q), t64(k), t64(v)
        T0 = self.k.shape[0]
        positions = list(range(T0, T0 + q.shape[0]))
        if self.theta:
            q = apply_rotary_pos_emb(q, positions, self.theta, self.rope_dim, self.interleaved)
            k = apply_rotary_pos_emb(k, positions, self.theta, self.rope_dim, self.interleaved)
        self.k = torch.cat([self.k, self._stored(k)])
        self.v = torch.cat([self.v, self._stored(v)])
        return sdpa_over_cache(q, self.k, self.v, 1.0 / math.sqrt(self.dk))

    def step_layer(self, x):
        """x [n, d_model]: project, step_heads, concatenate, W_O. Returns [n, d_model]."""
        x = t64(x)
        n = x.shape[0]

        def proj(name, heads):
            y = x @ self.w["w_" + name]
            if "b_" + name in self.w:
                y = y + self.w["b_" + name]
            return y.view(n, heads, self.dk)

        out = self.step_heads(proj("q", self.H), proj("k", self.Hkv), proj("v", self.Hkv)).reshape(n, -1)
        y = out @ self.w["w_o"]
        return y + self.w["b_o"] if "b_o" in self.w else y

    def fork(self):
        other = TorchDecoder(self.H, self.Hkv, self.dk, self.theta, rope_dim=self.rope_dim,
                             interleaved=self.interleaved, cache_dtype=self.cache_dtype)
        other.w, other.k, other.v = self.w, self.k.clone(), self.v.clone()
        return other

    def truncate(self, length):
        self.k, self.v = self.k[:length], self.v[:length]


# ---------------------------------------------------------------------------------------------------------------
# RoPE on the stateless calls.

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_stateless_rope_matches_hf_apply_rotary_pos_emb(client, interleaved, backend):
    rng = rng_for("rope", interleaved)
    H, Hkv, dk, T = 4, 2, 16, 11
    q, k, v = f32(rng, 1, T, H, dk), f32(rng, 1, T, Hkv, dk), f32(rng, 1, T, Hkv, dk)
    r = client.scaled_dot_product_attention(q, k, v, causal=True, rope_theta=10000.0, rope_interleaved=interleaved,
                                            backend=backend)
    ref = TorchDecoder(H, Hkv, dk, 10000.0, interleaved=interleaved)
    want = ref.step_heads(q[0], k[0], v[0])
    assert_close(r.output[0], want.numpy())


def test_partial_rotary_rotates_only_the_first_dims(client):
    rng = rng_for("rope-partial")
    H, dk, T = 2, 16, 7
    q, k, v = f32(rng, 1, T, H, dk), f32(rng, 1, T, H, dk), f32(rng, 1, T, H, dk)
    r = client.scaled_dot_product_attention(q, k, v, causal=True, rope_theta=500000.0, rope_dim=8)
    want = TorchDecoder(H, H, dk, 500000.0, rope_dim=8).step_heads(q[0], k[0], v[0])
    assert_close(r.output[0], want.numpy())


def test_a_layer_carries_its_rope(client):
    rng = rng_for("rope-layer")
    d, H, Hkv, dk = 64, 4, 2, 16
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    client.load_layer("rope_layer_e2e", w, H, Hkv, dk, rope_theta=10000.0)
    try:
        info = [layer for layer in client.list_layers() if layer.name == "rope_layer_e2e"]
        assert len(info) == 1
        x = f32(rng, 1, 9, d)
        r = client.multi_head_attention(x, layer="rope_layer_e2e", causal=True)
        want = TorchDecoder(H, Hkv, dk, 10000.0, weights=w).step_layer(x[0])
        assert_close(r.output[0], want.numpy())
    finally:
        client.unload_layer("rope_layer_e2e")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # as transformers 5's rope_parameters


def test_a_layer_carries_its_rope_scaling(client):
    """Scaled RoPE's values are tests/models' (against transformers); here: the wire carries it, as a dict."""
    rng = rng_for("rope-scaling-layer")
    d, H, Hkv, dk = 64, 4, 2, 16
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    x = f32(rng, 1, 40, d)
    client.load_layer("rope_scaling_e2e", w, H, Hkv, dk, rope_theta=10000.0, rope_scaling=LLAMA3)
    try:
        by_layer = client.multi_head_attention(x, layer="rope_scaling_e2e", causal=True).output
        inline = client.multi_head_attention(x, weights=w, num_heads=H, num_kv_heads=Hkv, head_dim=dk, causal=True,
                                             rope_theta=10000.0, rope_scaling=LLAMA3).output
        plain = client.multi_head_attention(x, weights=w, num_heads=H, num_kv_heads=Hkv, head_dim=dk, causal=True,
                                            rope_theta=10000.0).output
    finally:
        client.unload_layer("rope_scaling_e2e")
    np.testing.assert_array_equal(by_layer, inline)
    assert np.abs(plain - inline).max() > 1e-3  # the scaling changed the low frequencies


def test_rope_scaling_names_what_is_wrong(client):
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="'alpha'"):
        client.scaled_dot_product_attention(q, q, q, rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "alpha": 1})
    with pytest.raises(grpc.RpcError) as err:
        client.scaled_dot_product_attention(q, q, q, rope_theta=10000.0, rope_scaling={"rope_type": "llama3"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "heads.rope_scaling.factor is required (rope_type 'llama3')" in err.value.details()


def test_one_head_session_carries_each_layers_scale(client):
    """GPT-2's scale_attn_by_inverse_layer_idx: cache i scales by 1 / (sqrt(d_k) (i + 1))."""
    rng = rng_for("layer-heads")
    H, dk, layers = 2, 8, 3
    session = client.create_session(num_heads=H, head_dim=dk, num_layers=layers,
                                    layer_heads=[{"scale": dk ** -0.5 / (i + 1)} for i in range(layers)])
    try:
        q, k, v = f32(rng, 5, H, dk), f32(rng, 5, H, dk), f32(rng, 5, H, dk)
        for i in range(layers):
            got = session.extend(i, q=q, k=k, v=v).output
            want = client.scaled_dot_product_attention(q[None], k[None], v[None], causal=True,
                                                       scale=dk ** -0.5 / (i + 1)).output[0]
            assert_close(got, want)
    finally:
        session.close()
    with pytest.raises(ValueError, match="num_heads"):
        client.create_session(num_heads=H, head_dim=dk, num_layers=1, layer_heads=[{"num_heads": 2}])


# ---------------------------------------------------------------------------------------------------------------
# Sessions against torch's decoding with a KV cache.

@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (8, 1)])  # MHA, GQA, MQA
def test_head_session_decodes_as_torch_sdpa_with_a_kv_cache(client, backend, H, Hkv):
    rng = rng_for("heads", H, Hkv, backend)
    dk = 32
    session = client.create_session(num_heads=H, num_kv_heads=Hkv, head_dim=dk, rope_theta=10000.0)
    ref = TorchDecoder(H, Hkv, dk, 10000.0)
    try:
        for n in [13, 1, 1, 4, 1, 20, 1]:  # a prefill, decode steps, chunks across block boundaries
            q, k, v = f32(rng, n, H, dk), f32(rng, n, Hkv, dk), f32(rng, n, Hkv, dk)
            got = session.extend(0, q=q, k=k, v=v, backend=backend)
            assert_close(got.output, ref.step_heads(q, k, v).numpy())
            assert got.length == ref.k.shape[0]
    finally:
        session.close()


def test_layer_session_decodes_as_a_torch_layer_with_a_kv_cache(client):
    rng = rng_for("layer-session")
    d, H, Hkv, dk = 64, 4, 2, 16
    w = make_weights(rng, d, d, d, H, Hkv, dk)
    client.load_layer("session_layer_e2e", w, H, Hkv, dk, rope_theta=10000.0)
    try:
        session = client.create_session(layers=["session_layer_e2e"])
        ref = TorchDecoder(H, Hkv, dk, 10000.0, weights=w)
        for n in [6, 1, 1, 9, 1]:
            x = f32(rng, n, d)
            assert_close(session.extend(0, x=x).output, ref.step_layer(x).numpy())
        session.close()
    finally:
        client.unload_layer("session_layer_e2e")


@pytest.mark.parametrize("cache", ["fp16", "bf16"])
def test_16_bit_caches_round_keys_and_values_once(client, cache):
    rng = rng_for("cache", cache)
    H, Hkv, dk = 8, 2, 64
    session = client.create_session(num_heads=H, num_kv_heads=Hkv, head_dim=dk, rope_theta=10000.0,
                                    cache_dtype=cache)
    ref = TorchDecoder(H, Hkv, dk, 10000.0, cache_dtype=cache)
    tolerance = 2e-2 if cache == "bf16" else 3e-3
    for n in [40, 1, 1, 1]:
        q, k, v = f32(rng, n, H, dk), f32(rng, n, Hkv, dk), f32(rng, n, Hkv, dk)
        assert_close(session.extend(0, q=q, k=k, v=v).output, ref.step_heads(q, k, v).numpy(), tolerance, tolerance)
    assert session.info["cache_dtype"] == cache.upper()
    session.close()


@pytest.mark.parametrize("cache,bound", [("int8", 0.03), ("fp8_e4m3", 0.06), ("fp8_e5m2", 0.12)])
def test_8_bit_caches_keep_a_decodes_relative_error_within_bound(client, cache, bound):
    rng = rng_for("cache", cache)
    H, Hkv, dk = 8, 2, 64
    session = client.create_session(num_heads=H, num_kv_heads=Hkv, head_dim=dk, rope_theta=10000.0,
                                    cache_dtype=cache)
    ref = TorchDecoder(H, Hkv, dk, 10000.0)  # never rounded: the error is the cache's
    for n in [40, 1, 1, 1]:
        q, k, v = f32(rng, n, H, dk), f32(rng, n, Hkv, dk), f32(rng, n, Hkv, dk)
        got, want = session.extend(0, q=q, k=k, v=v).output, ref.step_heads(q, k, v).numpy()
        assert np.linalg.norm(got - want) <= bound * np.linalg.norm(want)
    assert session.info["cache_dtype"] == cache.upper()
    session.close()


def test_fork_and_truncate_follow_the_torch_caches(client):
    rng = rng_for("fork")
    H, Hkv, dk = 4, 2, 16
    a = client.create_session(num_heads=H, num_kv_heads=Hkv, head_dim=dk, rope_theta=10000.0)
    ref_a = TorchDecoder(H, Hkv, dk, 10000.0)

    def step(session, ref, n):
        q, k, v = f32(rng, n, H, dk), f32(rng, n, Hkv, dk), f32(rng, n, Hkv, dk)
        assert_close(session.extend(0, q=q, k=k, v=v).output, ref.step_heads(q, k, v).numpy())

    step(a, ref_a, 21)
    b, ref_b = a.fork(), ref_a.fork()
    step(b, ref_b, 3)
    step(a, ref_a, 1)
    step(b, ref_b, 1)
    a.truncate(10)
    ref_a.truncate(10)
    step(a, ref_a, 2)
    assert a.lengths() == [12] and b.lengths() == [25]
    a.close()
    b.close()


def test_one_call_for_many_sessions_equals_one_call_each(client):
    rng = rng_for("batch")
    H, Hkv, dk = 4, 1, 16
    sessions = [client.create_session(num_heads=H, num_kv_heads=Hkv, head_dim=dk) for _ in range(3)]
    refs = [TorchDecoder(H, Hkv, dk, 0.0) for _ in range(3)]
    for step in range(3):
        items, wants = [], []
        for i, (session, ref) in enumerate(zip(sessions, refs)):
            n = 1 if step else 5 + 3 * i
            q, k, v = f32(rng, n, H, dk), f32(rng, n, Hkv, dk), f32(rng, n, Hkv, dk)
            items.append({"session": session, "q": q, "k": k, "v": v})
            wants.append(ref.step_heads(q, k, v).numpy())
        for got, want in zip(client.extend(items), wants):
            assert_close(got.output, want)
    for session in sessions:
        session.close()


def test_session_errors_keep_their_codes(client):
    s = client.create_session(num_heads=2, head_dim=8)
    with pytest.raises(grpc.RpcError) as err:
        s.extend(0, x=np.zeros((1, 16), np.float32))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "head session" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        s.extend(0, q=np.zeros((1, 2, 8), np.float32), k=np.zeros((1, 2, 8), np.float32),
                 v=np.zeros((1, 2, 8), np.float32), expected_length=4)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    s.close()
    with pytest.raises(grpc.RpcError) as err:
        s.close()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "closed" in err.value.details()
    assert client.health() == "SERVING"


def test_a_session_handle_checks_the_length_it_last_saw(client):
    # A step retried after an error that hid its commit must not append twice: the handle sends expected_length.
    s = client.create_session(num_heads=2, head_dim=8)
    qkv = {name: np.zeros((1, 2, 8), np.float32) for name in ("q", "k", "v")}
    assert s.extend(**qkv).length == 1
    client.extend([dict(session=s.id, **qkv)])  # a step the handle never saw answered (by id, not by the handle)
    with pytest.raises(grpc.RpcError) as err:
        s.extend(**qkv)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert s.extend(check_length=False, **qkv).length == 3
    s.close()


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS for %d" % pid)


def test_rss_stays_within_the_pool_whatever_the_sessions(stubs_dir, tmp_path):
    """A 32 MiB pool and sessions that want five times that: evictions, refusals, forks, and the server's resident
    memory grows by at most the pool plus a margin for allocator slack over the warm level."""
    from conftest import run_server
    pool = 32 << 20
    with run_server(tmp_path, "--kv_cache_mb", "32") as server:
        with mhaclient.MhaClient(server.target, timeout=60.0) as c:
            c.wait_ready(timeout=20.0)
            rng = np.random.default_rng(5)
            chunk = lambda n: [rng.standard_normal((n, 8, 64)).astype(np.float32) for _ in range(3)]  # noqa: E731
            warm = c.create_session(num_heads=8, head_dim=64)
            q, k, v = chunk(1024)
            warm.extend(q=q, k=k, v=v)
            warm.close()
            baseline = rss_bytes(server.proc.pid)
            codes = set()
            for _ in range(40):  # 4 MiB of fp32 cache each: the pool holds 8
                s = c.create_session(num_heads=8, head_dim=64)
                try:
                    q, k, v = chunk(1024)
                    s.extend(q=q, k=k, v=v)
                    s.fork().extend(q=q[:40], k=k[:40], v=v[:40])  # diverges: copies one block, then more
                except grpc.RpcError as err:
                    codes.add(err.code())
            grown = rss_bytes(server.proc.pid) - baseline
            assert grown <= pool + (48 << 20), "RSS grew by %.1f MiB over a %d MiB pool" % (grown / 2**20, pool >> 20)
            assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert c.health() == "SERVING"
            sessions = c.list_sessions()
            assert 0 < len(sessions) <= 16
