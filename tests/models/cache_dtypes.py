"""Greedy decoding of transformers' own decoders with their attention in an mha_server head session, one per cache
dtype: the tokens against transformers' generate() and against the session's fp32 cache, and the attention
output's relative error against the fp32 cache over every layer and step (the keys and values the model itself
produced). Runs by hand (docs/PERFORMANCE.md, "8-bit caches"):

    py=$(tests/models/env.sh | tail -1)
    $py tests/models/cache_dtypes.py --server build/bin/mha_server [--tokens 48] [--json out.json]

Random weights from a seeded config saved with save_pretrained (no checkpoint is downloaded); the prompt is fixed
token ids. Each layer's attention is replaced (transformers' AttentionInterface) by a call that sends the new
tokens' rotated q, k and v to the session's cache of that layer and returns the heads it computes.
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import mhaclient  # noqa: E402
from local_server import local_server  # noqa: E402

DTYPES = ["fp32", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"]


def model_configs():
    """Small decoders of three families (GQA where the family has it, GPT-NeoX's partial rotary); wide enough that
    greedy decoding varies."""
    llama = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                     rope_theta=10000.0)
    qwen2 = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    neox = transformers.GPTNeoXConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, max_position_embeddings=512, rotary_pct=0.25)
    return {"llama": llama, "qwen2": qwen2, "gpt_neox": neox}


class Attention:
    """The attention function transformers calls per layer: the new tokens' q [1, H, n, d] and the cache's k and v
    [1, Hkv, T, d] (the last n are the new tokens'), already rotated; the session attends over its own cache."""

    def __init__(self):
        self.session = None
        self.outputs = []  # per call: (layer, heads [n, H, d]) in call order

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n = query.shape[2]
        q = query[0].transpose(0, 1).float().numpy()
        k = key[0, :, -n:].transpose(0, 1).float().numpy()
        v = value[0, :, -n:].transpose(0, 1).float().numpy()
        out = self.session.extend(module.layer_idx, q=q, k=k, v=v).output
        self.outputs.append((module.layer_idx, out))
        return torch.from_numpy(np.ascontiguousarray(out)).unsqueeze(0).to(query.dtype), None


def generate(model, prompt, tokens, attention=None, client=None, cache_dtype=None):
    """Greedy tokens after `prompt`; with `attention`, through a head session of `cache_dtype` on `client`."""
    config = model.config
    if attention is not None:
        head_dim = config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        attention.session = client.create_session(num_heads=config.num_attention_heads, num_kv_heads=kv_heads,
                                                  head_dim=head_dim,
                                                  scale=head_dim ** -0.5, num_layers=config.num_hidden_layers,
                                                  cache_dtype=cache_dtype)
        attention.outputs = []
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    if attention is not None:
        attention.session.close()
    return out[0, len(prompt):].tolist()


def relative_errors(got, want, comparable):
    """Per call of the first `comparable`, ||got - want|| / ||want|| over its heads (calls of one layer and step pair
    up; after the first different token the inputs differ and nothing compares)."""
    pairs = list(zip(got, want))[:comparable]
    return [float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)) for (_, g), (_, w) in pairs]


def run(server_target, tokens):
    client = mhaclient.MhaClient(server_target, timeout=60.0)
    client.wait_ready(timeout=30)
    attention = Attention()
    transformers.AttentionInterface.register("mhaserve", attention)
    results = {}
    prompt = [int(x) for x in np.random.default_rng(7).integers(1, 512, size=24)]
    with tempfile.TemporaryDirectory() as folder:
        for family, config in model_configs().items():
            torch.manual_seed(0)
            model_cls = transformers.AutoModelForCausalLM.from_config(config).__class__
            saved = os.path.join(folder, family)
            model_cls(config).save_pretrained(saved)
            reference = model_cls.from_pretrained(saved, attn_implementation="eager").eval()
            want = generate(reference, prompt, tokens)
            served = model_cls.from_pretrained(saved, attn_implementation="mhaserve").eval()
            row = {"transformers": want}
            outputs = {}
            for dtype in DTYPES:
                row[dtype] = generate(served, prompt, tokens, attention, client, dtype)
                outputs[dtype] = list(attention.outputs)
            for dtype in DTYPES:
                first_diff = next((i for i, (a, b) in enumerate(zip(row[dtype], row["fp32"])) if a != b), tokens)
                # Step i (0: the prompt) computes token i: the steps up to the first different token compare.
                errors = relative_errors(outputs[dtype], outputs["fp32"], (first_diff + 1) * config.num_hidden_layers)
                row[dtype + "_summary"] = {
                    "same_tokens_as_fp32": sum(a == b for a, b in zip(row[dtype], row["fp32"])),
                    "first_difference": None if first_diff == tokens else first_diff,
                    "rel_error_max": max(errors or [0.0]),
                    "rel_error_mean": float(np.mean(errors)) if errors else 0.0,
                }
            results[family] = row
    client.close()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.path.join(HERE, "..", "..", "build", "bin", "mha_server"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work, local_server(args.server, work, "--kv_cache_mb", "512") as target:
        sys.path.insert(0, mhaclient.generate_stubs(os.path.join(work, "stubs")))
        results = run(target, args.tokens)
    # The attention output's error against the fp32 cache over every layer of the steps up to the first token that
    # differs (after it the inputs differ).
    print("%-9s %-9s %-14s %-20s %-12s %-12s" % ("model", "cache", "= generate()", "first token != fp32",
                                                 "rel err max", "rel err mean"))
    for family, row in results.items():
        for dtype in DTYPES:
            same_hf = all(a == b for a, b in zip(row[dtype], row["transformers"]))
            s = row[dtype + "_summary"]
            first = "none of %d" % len(row[dtype]) if s["first_difference"] is None else str(s["first_difference"])
            print("%-9s %-9s %-14s %-20s %-12.4f %-12.4f" % (family, dtype, "yes" if same_hf else "no", first,
                                                             s["rel_error_max"], s["rel_error_mean"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
