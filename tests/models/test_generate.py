"""Greedy generation through the service against transformers' own generate(), for each architecture of
model_configs.py (random weights with a wide spread, so that the greedy tokens vary): through the transformers
integration (mhaclient_transformers: attention implementation "mhaserve" and a ServiceCache whose layers live in one
head session), and through layer sessions of the checkpoint registered by mha_client load (each attention module's
forward replaced by an Extend of its layer's cache). fp32 caches must give the same tokens; a bf16 cache's are
counted. Runs in tests/models/env.sh's environment: tests/models/run.sh SERVER_BIN."""

import os
import subprocess
import tempfile

import pytest
import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer

import mhaclient_transformers  # on the path through conftest.py
from model_configs import attention_modules, configs

PROMPT = [[5, 17, 42, 8, 33, 61, 2, 90, 14, 27, 3, 71]]
NEW_TOKENS = 24


def seeded_model(model_type):
    config, _ = configs(spread=0.5)[model_type]
    torch.manual_seed(11)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def greedy(model, **kwargs):
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, **kwargs)
    return out[0, len(PROMPT[0]):].tolist()


@pytest.mark.parametrize("model_type", sorted(configs()))
def test_the_integration_generates_transformers_tokens(server, model_type):
    _, client = server
    model = seeded_model(model_type)
    want = greedy(model)
    assert len(set(want)) > 4, "degenerate greedy tokens: widen the spread"
    mhaclient_transformers.register(client)
    model.set_attn_implementation("mhaserve")
    with mhaclient_transformers.ServiceCache(client, model) as cache:
        got = greedy(model, cache=cache)
        assert cache.get_seq_length() == len(PROMPT[0]) + NEW_TOKENS - 1  # the last token is never fed back
    assert got == want


# A rounded cache's prompt logits against transformers': its largest difference over the largest logit. These random
# weights' wide spread amplifies every rounding from layer to layer (bf16 up to 2.9%; int8 up to 5.8% where the CPU
# keeps q in int16, up to 13.5% (Phi-3) on AVX512-VNNI, whose kernels round q to int8 as well: docs/MODELS.md), so
# greedy tokens drift apart once two logits are close; the counts are printed.
CACHE_TOLERANCE = {"bf16": 0.04, "int8": 0.16}


@pytest.mark.parametrize("model_type", sorted(configs()))
@pytest.mark.parametrize("cache_dtype", sorted(CACHE_TOLERANCE))
def test_a_smaller_cache_is_measured_against_transformers(server, model_type, cache_dtype):
    _, client = server
    model = seeded_model(model_type)
    want = greedy(model)
    with torch.no_grad():
        want_logits = model(torch.tensor(PROMPT)).logits[0, -1]
    mhaclient_transformers.register(client)
    model.set_attn_implementation("mhaserve")
    with mhaclient_transformers.ServiceCache(client, model, cache_dtype=cache_dtype) as cache:
        with torch.no_grad():
            logits = model(torch.tensor(PROMPT), cache=cache, use_cache=True).logits[0, -1]
    with mhaclient_transformers.ServiceCache(client, model, cache_dtype=cache_dtype) as cache:
        got = greedy(model, cache=cache)
    error = ((logits - want_logits).abs().max() / want_logits.abs().max()).item()
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
    print("%s %s cache: prompt logits %.3f off (relative), the first %d of %d greedy tokens as transformers'"
          % (model_type, cache_dtype, error, same, NEW_TOKENS))
    assert len(got) == NEW_TOKENS
    assert error <= CACHE_TOLERANCE[cache_dtype]


def test_an_encoder_runs_through_the_stateless_call_with_its_padding_mask(server):
    _, client = server
    config = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96)
    torch.manual_seed(3)
    model = transformers.AutoModel.from_config(config).eval()
    ids = torch.randint(0, 97, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0  # the second row is padded
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        mhaclient_transformers.register(client)
        model.set_attn_implementation("mhaserve")
        got = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, :6], want[1, :6], atol=1e-4, rtol=1e-4)


class _Counter(DynamicLayer):
    """A layer of a cache that holds nothing: generate() reads its length to feed only the new tokens."""

    def __init__(self):
        super().__init__()
        self.length, self.is_initialized = 0, True

    def get_seq_length(self):
        return self.length

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0


@pytest.mark.parametrize("model_type", sorted(configs()))
def test_layer_sessions_of_the_loaded_checkpoint_generate_transformers_tokens(server, model_type):
    target, client = server
    model = seeded_model(model_type)
    want = greedy(model)
    client_bin = os.path.join(os.path.dirname(os.environ["MHA_SERVER_BIN"]), "mha_client")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = subprocess.run([client_bin, "load", "--target", target, "--checkpoint", folder, "--name",
                                 "gen_" + model_type], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    modules = attention_modules(model)
    session = client.create_session(layers=["gen_%s.%d" % (model_type, i) for i in range(len(modules))])
    cache = Cache(layers=[_Counter() for _ in modules])

    def forward_of(i):
        def forward(*args, **kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            out = session.extend(i, x=x[0].float().numpy()).output
            cache.layers[i].length += x.shape[1]
            return torch.from_numpy(out)[None].to(x.dtype), None
        return forward

    for i, m in enumerate(modules):
        m.forward = forward_of(i)
    try:
        got = greedy(model, cache=cache)
    finally:
        session.close()
    assert got == want
