"""Scaled RoPE (HeadConfig.rope_scaling) against transformers' own rotary embedding: for each rope_type, a stateless
call's output and a head session's outputs, chunk by chunk, equal attention computed in float64 over q and k rotated
with the cos and sin that transformers' LlamaRotaryEmbedding returns for the same config (its dynamic and longrope
updates included: a session grows as generate() grows its sequence). Runs in tests/models/env.sh's environment:
tests/models/run.sh SERVER_BIN (ctest's models_transformers)."""

import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

import mhaclient  # on the path through conftest.py

H, HKV, D, THETA = 4, 2, 32, 10000.0
ATOL = 5e-4  # the server's fp32 against float64 over transformers' fp32 angles, at positions up to 300

# rope_parameters (transformers' names) and the model's max_position_embeddings, per case.
CONFIGS = {
    "default": ({}, 512),
    "linear": (dict(rope_type="linear", factor=4.0), 512),
    "dynamic": (dict(rope_type="dynamic", factor=2.0), 64),
    "yarn": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), 256),
    "yarn_deepseek": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=1.0,
                           mscale_all_dim=0.8, beta_fast=16.0, beta_slow=2.0, truncate=False), 256),
    "longrope": (dict(rope_type="longrope", original_max_position_embeddings=64,
                      short_factor=[1.0 + 0.05 * i for i in range(D // 2)],
                      long_factor=[1.0 + 0.7 * i for i in range(D // 2)]), 256),
    "llama3": (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64), 512),
}


def llama_config(name):
    params, max_positions = CONFIGS[name]
    params = dict(params, rope_theta=THETA)
    params.setdefault("rope_type", "default")
    return transformers.LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D,
                                    max_position_embeddings=max_positions, rope_parameters=params)


def scaling_of(name):
    """What a user sends: the config's rope_parameters and its max_position_embeddings."""
    config = llama_config(name)
    return mhaclient.rope_scaling_message(config.rope_parameters, config.max_position_embeddings)


class Rotary:
    """transformers' rotary embedding for one sequence: rotate(x [n, heads, D], first) turns rows at positions
    first..first+n-1 with the cos and sin it computes for them (updating its frequencies as generate() would)."""

    def __init__(self, name):
        self.rotary = modeling_llama.LlamaRotaryEmbedding(llama_config(name))

    def rotate(self, x, first):
        positions = torch.arange(first, first + x.shape[0])[None]
        cos, sin = self.rotary(torch.zeros(1, dtype=torch.float32), positions)
        cos, sin = cos[0].double().numpy()[:, None, :], sin[0].double().numpy()[:, None, :]
        half = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
        return x * cos + half * sin


def attention(q, k, v, scale):
    """Causal, bottom-right aligned GQA attention in float64: q [n, H, D] over k, v [T, HKV, D]."""
    n, t = q.shape[0], k.shape[0]
    k = np.repeat(k, H // HKV, axis=1)
    v = np.repeat(v, H // HKV, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    visible = np.arange(t)[None, :] <= np.arange(n)[:, None] + (t - n)
    scores = np.where(visible[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("length", [50, 300])
def test_a_stateless_call_matches_transformers_rotary_embedding(client, name, length):
    rng = np.random.default_rng(length)
    q = rng.uniform(-1, 1, (5, H, D))
    k = rng.uniform(-1, 1, (length, HKV, D))
    v = rng.uniform(-1, 1, (length, HKV, D))
    rotary = Rotary(name)
    want = attention(rotary.rotate(q, length - 5), Rotary(name).rotate(k, 0), v, D ** -0.5)
    got = client.scaled_dot_product_attention(q[None].astype(np.float32), k[None].astype(np.float32),
                                              v[None].astype(np.float32), causal=True, rope_theta=THETA,
                                              rope_scaling=scaling_of(name), backend="cpu").output[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    if name != "default" and not (name == "dynamic" and length <= 64):  # the check can fail: unscaled is far off
        plain = client.scaled_dot_product_attention(q[None].astype(np.float32), k[None].astype(np.float32),
                                                    v[None].astype(np.float32), causal=True, rope_theta=THETA,
                                                    backend="cpu").output[0]
        assert np.abs(plain - want).max() > 10 * ATOL


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn_deepseek", "llama3"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_session_grows_as_generate_grows_its_sequence(client, name, backend):
    """Chunks of 40, 1, 30, 1 tokens: dynamic and longrope change their frequencies when the sequence passes 64 in
    the third chunk; the keys cached before keep theirs, as transformers' cache keeps them."""
    rng = np.random.default_rng(7)
    session = client.create_session(num_heads=H, num_kv_heads=HKV, head_dim=D, rope_theta=THETA,
                                    rope_scaling=scaling_of(name))
    rotary = Rotary(name)
    keys, values, first = [], [], 0
    try:
        for n in [40, 1, 30, 1]:
            q, k, v = (rng.uniform(-1, 1, (n, heads, D)) for heads in (H, HKV, HKV))
            rotated_q = rotary.rotate(q, first)  # one chunk's q and k turn with the same frequencies
            keys.append(rotary.rotate(k, first))
            values.append(v)
            first += n
            got = session.extend(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                                 backend=backend).output
            want = attention(rotated_q, np.concatenate(keys), np.concatenate(values), D ** -0.5)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg="chunk ending at %d" % first)
    finally:
        session.close()
