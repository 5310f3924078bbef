"""Softmax statistics end to end (issue #36): lse, HeadStats and row stats, merge_attention, sharded decode with
append=false, against references written here in numpy float64 on exactly the values the server receives.
"""

import contextlib
import zlib

import grpc
import numpy as np
import pytest

import mhaclient
from conftest import STARTUP_TIMEOUT_S, run_server

BACKENDS = ["cpu", "reference"]
STATS = ("entropy", "normalized_entropy", "confidence", "distance", "sink_mass")


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def visible(B, Tq, Tk, causal=False, key_lengths=None):
    """[B, 1, Tq, Tk] bool: key j visible to query i (causal bottom-right aligned, keys >= key_lengths[b] masked)."""
    vis = np.ones((B, 1, Tq, Tk), dtype=bool)
    if causal:
        vis &= np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
    if key_lengths is not None:
        vis &= np.arange(Tk)[None, None, None, :] < np.asarray(key_lengths)[:, None, None, None]
    return vis


def scores(q, k, vis, scale=None):
    """Scaled, masked scores [B, H, Tq, Tk] (float64) of q [B, Tq, H, d_k] and k [B, Tk, Hkv, d_k]."""
    H, Hkv, dk = q.shape[2], k.shape[2], q.shape[3]
    k = np.repeat(k.astype(np.float64), H // Hkv, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k) * (dk ** -0.5 if scale is None else scale)
    return np.where(vis, s, -np.inf)


def softmax(s):
    """Row softmax of masked scores; a row with no visible key gives zeros."""
    peak = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(peak), peak, 0.0))
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def row_stats_of(p, vis, sink_tokens):
    """HeadStats per query row from probabilities p [B, H, Tq, Tk] (float64) and visibility [B, 1, Tq, Tk]."""
    Tq, Tk = p.shape[2], p.shape[3]
    nvis = np.broadcast_to(vis.sum(-1), p.shape[:3])
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    entropy = -plogp.sum(-1)
    ln_n = np.log(np.maximum(nvis, 1))
    position = np.arange(Tq)[:, None] + (Tk - Tq)  # i' = i + Tk - Tq
    return {
        "entropy": entropy,
        "normalized_entropy": np.divide(entropy, ln_n, out=np.zeros_like(entropy), where=nvis > 1),
        "confidence": p.max(-1),
        "distance": (p * np.abs(position - np.arange(Tk)[None, :])).sum(-1),
        "sink_mass": p[..., :sink_tokens].sum(-1),
    }, nvis > 0


def mean_over_seen(rows, seen):
    """[B, H, Tq] -> [B, H]: the mean over the rows that see at least one key (0 when none does)."""
    count = seen.sum(-1)
    return np.divide((rows * seen).sum(-1), count, out=np.zeros(rows.shape[:2]), where=count > 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_lse_is_logsumexp_of_scaled_scores(client, backend):
    rng = rng_for("lse", backend)
    B, Tq, Tk, H, Hkv, dk = 3, 5, 11, 4, 2, 16
    q, k, v = f32(rng, B, Tq, H, dk), f32(rng, B, Tk, Hkv, dk), f32(rng, B, Tk, Hkv, dk)
    key_lengths = [Tk, 7, 0]  # item 2 sees no key at all
    r = client.scaled_dot_product_attention(q, k, v, causal=True, key_lengths=key_lengths, return_lse=True,
                                            backend=backend)
    s = scores(q, k, visible(B, Tq, Tk, True, key_lengths))
    peak = s.max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = peak + np.log(np.exp(s - peak[..., None]).sum(-1))
    assert r.lse.dtype == np.float32 and r.lse.shape == (B, H, Tq)
    np.testing.assert_allclose(r.lse[:2], want[:2], atol=1e-5, rtol=1e-5)
    assert np.all(np.isneginf(r.lse[2])), r.lse[2]
    assert r.head_stats is None and r.row_stats is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_of_key_shards_equals_unsplit_sdpa(client, backend):
    rng = rng_for("merge", backend)
    B, Tq, Tk, H, Hkv, dk = 2, 6, 30, 4, 2, 16
    q, k, v = f32(rng, B, Tq, H, dk), f32(rng, B, Tk, Hkv, dk), f32(rng, B, Tk, Hkv, dk)
    key_lengths = [Tk, 0]  # item 1 sees no key in any shard: it stays zero, never NaN
    whole = client.scaled_dot_product_attention(q, k, v, key_lengths=key_lengths, return_lse=True, backend=backend)
    parts = [client.scaled_dot_product_attention(q, k[:, a:b], v[:, a:b], backend=backend, return_lse=True,
                                                 key_lengths=[min(n, b - a) for n in key_lengths])
             for a, b in ((0, 7), (7, 19), (19, Tk))]
    out, lse = mhaclient.merge_attention([p.output for p in parts], [p.lse for p in parts])
    assert out.dtype == np.float32 and out.shape == (B, Tq, H, dk) and lse.shape == (B, H, Tq)
    np.testing.assert_allclose(out, whole.output, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(lse[0], whole.lse[0], atol=1e-5, rtol=1e-5)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


def mha_case(backend):
    rng = rng_for("mha", backend)
    B, T, d_model, H, Hkv, dk = 2, 16, 32, 4, 2, 8
    w = {"w_q": f32(rng, d_model, H * dk, scale=2 / d_model ** 0.5), "w_k": f32(rng, d_model, Hkv * dk, scale=1),
         "w_v": f32(rng, d_model, Hkv * dk, scale=d_model ** -0.5), "w_o": f32(rng, H * dk, d_model, scale=0.2),
         "b_q": f32(rng, H * dk, scale=0.3), "b_k": f32(rng, Hkv * dk, scale=0.3),
         "b_v": f32(rng, Hkv * dk, scale=0.3), "b_o": f32(rng, d_model, scale=0.3)}
    x = f32(rng, B, T, d_model)
    return x, w, dict(num_heads=H, num_kv_heads=Hkv, head_dim=dk, causal=True, key_lengths=[T, T - 5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_head_stats_match_returned_weights(client, backend):
    x, w, cfg = mha_case(backend)
    B, T = x.shape[:2]
    r = client.multi_head_attention(x, weights=w, return_weights=True, return_head_stats=True, sink_tokens=3,
                                    backend=backend, **cfg)
    H = cfg["num_heads"]
    rows, seen = row_stats_of(r.attention_weights.astype(np.float64), visible(B, T, T, True, cfg["key_lengths"]), 3)
    assert set(r.head_stats) == set(mhaclient.HEAD_STAT_FIELDS)
    for name in STATS:
        got = r.head_stats[name]
        assert got.shape == (B, H), name
        np.testing.assert_allclose(got, mean_over_seen(rows[name], seen), atol=1e-4, rtol=1e-4, err_msg=name)
    assert r.row_stats is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_stats_per_query_row(client, backend):
    x, w, cfg = mha_case(backend)
    B, T = x.shape[:2]
    r = client.multi_head_attention(x, weights=w, return_weights=True, return_head_stats=True, return_row_stats=True,
                                    backend=backend, **cfg)
    rows, seen = row_stats_of(r.attention_weights.astype(np.float64), visible(B, T, T, True, cfg["key_lengths"]), 4)
    for name in STATS:
        assert r.row_stats[name].shape == (B, cfg["num_heads"], T), name
        np.testing.assert_allclose(r.row_stats[name], rows[name], atol=1e-4, rtol=1e-4, err_msg=name)
        np.testing.assert_allclose(r.head_stats[name], mean_over_seen(r.row_stats[name].astype(np.float64), seen),
                                   atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_contribution_is_head_share_of_output(client, backend):
    x, w, cfg = mha_case(backend)
    B, T, H, Hkv, dk = x.shape[0], x.shape[1], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    head_mask = [1.0, 0.5, 0.0, 2.0]
    r = client.multi_head_attention(x, weights=w, head_mask=head_mask, return_head_stats=True, backend=backend, **cfg)
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    x64 = x.astype(np.float64)
    q = (x64 @ w64["w_q"] + w64["b_q"]).reshape(B, T, H, dk)
    k = (x64 @ w64["w_k"] + w64["b_k"]).reshape(B, T, Hkv, dk)
    v = np.repeat((x64 @ w64["w_v"] + w64["b_v"]).reshape(B, T, Hkv, dk), H // Hkv, axis=2)
    vis = visible(B, T, T, True, cfg["key_lengths"])
    heads = np.einsum("bhij,bjhd->bihd", softmax(scores(q, k, vis)), v) * np.asarray(head_mask)[:, None]
    per_head = np.einsum("bihd,hdm->bihm", heads, w64["w_o"].reshape(H, dk, -1))  # head_i W_O[i]: [B, T, H, dm]
    out = w64["b_o"] + per_head.sum(2)
    np.testing.assert_allclose(r.output, out, atol=1e-4, rtol=1e-4)  # the reference is the server's layer
    share = np.linalg.norm(per_head, axis=-1) / np.linalg.norm(out, axis=-1)[..., None]  # [B, T, H]
    want = share.mean(1)  # every row sees key 0
    assert r.head_stats["contribution"].shape == (B, H)
    np.testing.assert_allclose(r.head_stats["contribution"], want, atol=1e-4, rtol=1e-4)
    assert np.all(r.head_stats["contribution"][:, 2] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_decode_with_append_false_equals_one_session(client, backend):
    rng = rng_for("shards", backend)
    T, H, Hkv, dk = 300, 4, 2, 16
    q, k, v = f32(rng, T + 1, H, dk), f32(rng, T + 1, Hkv, dk), f32(rng, T + 1, Hkv, dk)
    geometry = dict(num_heads=H, num_kv_heads=Hkv, head_dim=dk)
    whole = client.create_session(**geometry)
    shards = [client.create_session(**geometry) for _ in range(3)]
    try:
        whole.extend(q=q[:T], k=k[:T], v=v[:T], backend=backend)
        bounds = [(0, 100), (100, 200), (200, 300)]
        client.extend([{"session": s, "q": q[a:b], "k": k[a:b], "v": v[a:b]} for s, (a, b) in zip(shards, bounds)],
                      backend=backend)
        want = whole.extend(q=q[T:], k=k[T:], v=v[T:], backend=backend, return_lse=True)
        items = [{"session": shards[0], "q": q[T:], "append": False},
                 {"session": shards[1], "q": q[T:], "append": False},
                 {"session": shards[2], "q": q[T:], "k": k[T:], "v": v[T:]}]
        results = client.extend(items, backend=backend, return_lse=True)
        assert [res.lse.shape for res in results] == [(H, 1)] * 3
        out, lse = mhaclient.merge_attention([res.output for res in results], [res.lse for res in results])
        np.testing.assert_allclose(out, want.output, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(lse, want.lse, atol=1e-5, rtol=1e-5)
        assert [res.length for res in results] == [100, 100, 101]
        assert [s.lengths() for s in shards] == [[100], [100], [101]]
    finally:
        for s in [whole] + shards:
            s.close()


@pytest.fixture(scope="module")
def three_servers(stubs_dir, tmp_path_factory):
    """Three more mha_server processes on loopback ports, a client each: the replicas of a sharded context."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(run_server(tmp_path_factory.mktemp("replica%d" % i))) for i in range(3)]
        clients = [stack.enter_context(mhaclient.MhaClient(s.target, timeout=30.0)) for s in servers]
        for c in clients:
            c.wait_ready(timeout=STARTUP_TIMEOUT_S)
        yield clients


def test_a_sharded_session_over_three_servers_answers_as_one_session(client, three_servers):
    rng = rng_for("sharded-session")
    T, H, Hkv, dk = 8192, 4, 2, 16
    q, k, v = f32(rng, T + 2, H, dk), f32(rng, T + 2, Hkv, dk), f32(rng, T + 2, Hkv, dk)
    geometry = dict(num_heads=H, num_kv_heads=Hkv, head_dim=dk, max_tokens=T + 2)
    with client.create_session(**geometry) as whole, mhaclient.ShardedSession(three_servers, **geometry) as sharded:
        want = whole.extend(q=q[:T], k=k[:T], v=v[:T], return_lse=True)
        out, lse = sharded.prefill(q[:T], k[:T], v[:T])
        np.testing.assert_allclose(out, want.output, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(lse, want.lse, atol=1e-4, rtol=1e-5)
        assert sharded.lengths() == [2730, 2731, 2731]  # a third on each server
        for t in (T, T + 1):  # two decode steps
            want = whole.extend(q=q[t:t + 1], k=k[t:t + 1], v=v[t:t + 1], return_lse=True)
            out, lse = sharded.extend(q[t:t + 1], k[t:t + 1], v[t:t + 1])
            np.testing.assert_allclose(out, want.output, atol=1e-5, rtol=1e-4)
            np.testing.assert_allclose(lse, want.lse, atol=1e-4, rtol=1e-5)
        assert sharded.lengths() == [2730, 2731, 2733]
        assert [len(c.list_sessions()) for c in three_servers] == [1, 1, 1]


def _call(client, rpc, **stats):
    """One small call of `rpc` ("mha", "sdpa" or "extend") with the statistics' options `stats`."""
    rng = rng_for("invalid", rpc)
    if rpc == "mha":
        return client.multi_head_attention(f32(rng, 1, 4, 512), layer="demo", **stats)
    if rpc == "sdpa":
        return client.scaled_dot_product_attention(f32(rng, 1, 4, 2, 8), f32(rng, 1, 4, 2, 8), f32(rng, 1, 4, 2, 8),
                                                   **stats)
    with client.create_session(num_heads=2, head_dim=8) as s:
        return s.extend(q=f32(rng, 2, 2, 8), k=f32(rng, 2, 2, 8), v=f32(rng, 2, 2, 8), **stats)


@pytest.mark.parametrize("rpc", ["mha", "sdpa", "extend"])
def test_negative_sink_tokens_is_invalid(client, rpc):
    with pytest.raises(grpc.RpcError) as err:
        _call(client, rpc, return_head_stats=True, sink_tokens=-1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sink_tokens" in err.value.details()


@pytest.mark.parametrize("rpc", ["mha", "sdpa", "extend"])
def test_row_stats_without_head_stats_is_invalid(client, rpc):
    with pytest.raises(grpc.RpcError) as err:
        _call(client, rpc, return_row_stats=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "return_row_stats" in err.value.details()


def test_merge_attention_without_server():
    """Pure numpy: one shard holding everything merges to itself; shapes are checked."""
    rng = rng_for("merge-local")
    out = f32(rng, 3, 2, 4)  # [T, H, d_k]
    lse = np.array([[0.5, -np.inf, 2.0], [-np.inf, -np.inf, 1.0]], dtype=np.float32)  # [H, T]
    out[1, 0] = 0
    out[:2, 1] = 0
    merged, merged_lse = mhaclient.merge_attention([out, np.zeros_like(out)], [lse, np.full_like(lse, -np.inf)])
    np.testing.assert_array_equal(merged, out)
    np.testing.assert_array_equal(merged_lse, lse)
    with pytest.raises(ValueError):
        mhaclient.merge_attention([out], [lse.T])
