"""Shared prefixes end to end (issue #53): the key helper's bytes, and a second caller's session attaching the
blocks of a prompt the first one prefilled, then decoding as a session that prefilled the prompt itself."""

import numpy as np

import mhaclient

# The C++ helper's test (tests/prefix_cache_test.cc, PrefixKeysTest) pins the same digests.
GOLDEN_70_TOKENS = ["c2783b43086aa9485a66775f03b074ecc7b629c91a3565ffad24924d3ff52eab",
                    "6f143b863adafb340d9035f0641c6d06135a2db7040196fa51b1c28c386aadfa"]


def test_prefix_keys_chain_sha256_over_full_blocks():
    keys = mhaclient.prefix_keys(range(70), 32, extra="model-a")
    assert [k.hex() for k in keys] == GOLDEN_70_TOKENS
    assert mhaclient.prefix_keys(range(70), 32, extra=b"model-a") == keys
    assert mhaclient.prefix_keys(range(31), 32) == []
    assert mhaclient.prefix_keys(range(64), 32, extra="model-b")[0] != keys[0]


def tokens(rng, n, heads=4, kv_heads=2, d_k=16):
    return (rng.standard_normal((n, heads, d_k)).astype(np.float32),
            rng.standard_normal((n, kv_heads, d_k)).astype(np.float32),
            rng.standard_normal((n, kv_heads, d_k)).astype(np.float32))


def test_a_second_caller_attaches_the_prompt_and_decodes_as_if_it_had_prefilled_it(client):
    block = client.server_info()["limits"]["kv_block_tokens"]
    prompt_ids = list(range(1000, 1000 + 3 * block + 5))
    keys = mhaclient.prefix_keys(prompt_ids, block, extra="test_prefix_e2e")
    q, k, v = tokens(np.random.default_rng(53), len(prompt_ids) + 1)
    config = dict(num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, cache_dtype="bf16")
    first = client.create_session(prefix_keys=keys, **config)
    own = client.create_session(**config)
    try:
        assert first.attached_tokens == 0
        first.extend(q=q[:-1], k=k[:-1], v=v[:-1])
        own.extend(q=q[:-1], k=k[:-1], v=v[:-1])
        second = client.create_session(prefix_keys=keys, **config)
        try:
            assert second.attached_tokens == 3 * block
            assert second.lengths() == [3 * block]
            second.extend(q=q[3 * block:-1], k=k[3 * block:-1], v=v[3 * block:-1])
            got = second.extend(q=q[-1:], k=k[-1:], v=v[-1:]).output
            want = own.extend(q=q[-1:], k=k[-1:], v=v[-1:]).output
            np.testing.assert_array_equal(got, want)
        finally:
            second.close()
    finally:
        first.close()
        own.close()


def test_a_recording_session_refuses_prefix_keys(client):
    try:
        client.create_session(num_heads=4, num_kv_heads=2, head_dim=16, recover=True, prefix_keys=[b"k0"])
    except ValueError as e:
        assert "recover" in str(e)
    else:
        raise AssertionError("create_session(recover=True, prefix_keys=...) did not raise")
