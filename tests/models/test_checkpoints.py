"""mha_client load against transformers: checkpoints that transformers' own save_pretrained writes (random weights from
seeded small configs; one sharded, one in bf16) are registered layer by layer, and each registered layer's output
on the hidden states that layer's attention module saw during the model's forward pass equals that module's output.
Runs in tests/models/env.sh's environment: tests/models/run.sh SERVER_BIN (ctest's models_transformers)."""

import os
import subprocess
import tempfile

import numpy as np
import pytest
import torch
import transformers

import mhaclient
from local_server import local_server
from model_configs import SMALL, attention_modules, configs


def captured(model, ids):
    """Each attention module's hidden-states input and output during one forward pass."""
    seen = []

    def hook(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append((x[0].detach().float().numpy(), output[0][0].detach().float().numpy()))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in attention_modules(model)]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


def load(target, folder, name, *extra):
    client_bin = os.path.join(os.path.dirname(os.environ["MHA_SERVER_BIN"]), "mha_client")
    return subprocess.run([client_bin, "load", "--target", target, "--checkpoint", folder, "--name", name, *extra],
                          capture_output=True, text=True, timeout=120)


# Every architecture in fp32; bf16 checkpoints for two of them (a separate and a fused projection).
CASES = [(m, torch.float32) for m in sorted(configs())] + [("llama", torch.bfloat16), ("gpt_neox", torch.bfloat16)]


@pytest.mark.parametrize("model_type,dtype", CASES)
def test_each_registered_layer_computes_what_the_models_attention_computes(server, model_type, dtype):
    target, client = server
    config, save = configs()[model_type]
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 97, (1, 40))
    seen = captured(model, ids)  # in fp32, from the weights as they will be stored
    model = model.to(dtype)
    seen_stored = captured(model, ids) if dtype != torch.float32 else seen
    name = "%s_%s" % (model_type, str(dtype).split(".")[-1])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, **save)
        result = load(target, folder, name)
        assert result.returncode == 0, result.stderr
    assert "2 layers of %s" % model_type in result.stdout
    assert len(seen_stored) == 2
    tolerance = 2e-4 if dtype == torch.float32 else 3e-2
    for i, (x, want) in enumerate(seen_stored):
        got = client.multi_head_attention(x[None].astype(np.float32), layer="%s.%d" % (name, i), causal=True).output[0]
        np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance, err_msg="layer %d" % i)
        client.unload_layer("%s.%d" % (name, i))


def test_an_unknown_architecture_and_a_sliding_window_are_refused_saying_why(server):
    target, _ = server
    with tempfile.TemporaryDirectory() as folder:
        config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                          num_key_value_heads=2, **SMALL)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        result = load(target, folder, "qwen3")
    assert result.returncode == 1
    assert "model_type 'qwen3' is not an architecture mhaserve reads (llama, mistral, qwen2, phi3, gpt2, gpt_neox)" \
        in result.stderr
    with tempfile.TemporaryDirectory() as folder:
        config = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                            num_key_value_heads=2, sliding_window=32, **SMALL)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        refused = load(target, folder, "windowed")
        accepted = load(target, folder, "windowed", "--ignore_sliding_window")
    assert refused.returncode == 1 and "sliding_window is 32" in refused.stderr
    assert accepted.returncode == 0, accepted.stderr


def test_the_server_registers_a_checkpoint_folder_in_its_layers_dir(server):  # (its stubs; a server of its own)
    config, _ = configs()["qwen2"]
    torch.manual_seed(9)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    seen = captured(model, torch.randint(0, 97, (1, 30)))
    with tempfile.TemporaryDirectory() as work:
        model.save_pretrained(os.path.join(work, "layers", "qwen"))
        with local_server(os.environ["MHA_SERVER_BIN"], work, "--layers_dir", os.path.join(work, "layers")) as target:
            with mhaclient.MhaClient(target, timeout=60.0) as client:
                client.wait_ready(timeout=30)
                names = sorted(layer.name for layer in client.list_layers())
                assert names == ["demo", "qwen.0", "qwen.1"], names
                for i, (x, want) in enumerate(seen):
                    got = client.multi_head_attention(x[None], layer="qwen.%d" % i, causal=True).output[0]
                    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4, err_msg="layer %d" % i)
