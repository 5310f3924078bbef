"""PyTorch decoding over a preallocated KV cache, on decode_bench's shapes: the peer of the server's decode path.

Hugging Face's StaticCache decodes this way: K and V preallocated [B, Hkv, T_max, d_k] in the model's dtype, each
step's new key and value written at its position (index_copy_), then torch.nn.functional.scaled_dot_product_attention
of the step's queries [B, H, 1, d_k] over the cache with enable_gqa=True. Here the cache is sliced to the tokens
it holds (StaticCache passes the whole T_max with a mask, which reads more: this is the peer at its best). As in
decode_bench, every call uses caches no other call touched since (copies rotating over 4x the last-level cache),
and the rate is K/V bytes read per second: T 2 Hkv d_k sizeof(dtype) per sequence.

Runs in the peers' virtual environment (tests/bench/peers-env.sh). Prints one JSON object per line:
{"case", "peer", "gbps" (fastest call), "gbps_median", "ms_best", "ms_median", "copies", "calls"}.
Usage: decode_peers.py [--threads 2] [--seconds 0.5] [--filter SUBSTRING]
"""

import argparse
import json
import os
import sys
import time

_threads = "2"
for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        _threads = sys.argv[_i + 1]
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# decode_bench's cases: (name, sessions, cached tokens before the step, dtype); H=32, Hkv=8, d_k=128.
CASES = [
    ("decode_1x8192_bf16", 1, 8191, torch.bfloat16),
    ("decode_1x8192_fp32", 1, 8191, torch.float32),
    ("decode_32x1024_bf16", 32, 1023, torch.bfloat16),
    ("decode_32x1024_fp32", 32, 1023, torch.float32),
    ("decode_32x2048_bf16", 32, 2047, torch.bfloat16),
    ("decode_32x2048_fp32", 32, 2047, torch.float32),
    ("decode_1x8192_fp16", 1, 8191, torch.float16),
    ("decode_32x1024_fp16", 32, 1023, torch.float16),
    ("decode_32x2048_fp16", 32, 2047, torch.float16),
]
H, HKV, DK = 32, 8, 128


def last_level_cache_bytes():
    try:
        return max(os.sysconf("SC_LEVEL3_CACHE_SIZE"), 32 << 20)
    except (ValueError, OSError):
        return 32 << 20


def run_case(name, batch, length, dtype, seconds):
    t_max = length + 1
    element = torch.tensor([], dtype=dtype).element_size()
    bytes_per_call = batch * t_max * 2 * HKV * DK * element
    copies = max(1, -(-4 * last_level_cache_bytes() // bytes_per_call))
    caches = [(torch.randn(batch, HKV, t_max, DK).to(dtype), torch.randn(batch, HKV, t_max, DK).to(dtype))
              for _ in range(copies)]
    q = torch.randn(batch, H, 1, DK).to(dtype)
    new_k = torch.randn(batch, HKV, 1, DK).to(dtype)
    new_v = torch.randn(batch, HKV, 1, DK).to(dtype)
    position = torch.tensor([length])
    times = []
    i = 0

    def call(k_cache, v_cache):
        k_cache.index_copy_(2, position, new_k)
        v_cache.index_copy_(2, position, new_v)
        return F.scaled_dot_product_attention(q, k_cache[:, :, :t_max], v_cache[:, :, :t_max], enable_gqa=True)

    with torch.inference_mode():
        call(*caches[0])  # warm: thread pool, kernels
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            k_cache, v_cache = caches[i % copies]
            i += 1
            start = time.perf_counter()
            call(k_cache, v_cache)
            times.append(time.perf_counter() - start)
    times.sort()
    best, median = times[0], times[len(times) // 2]
    return {"case": name, "peer": "torch_sdpa_static_cache", "torch": torch.__version__,
            "gbps": bytes_per_call / best / 1e9, "gbps_median": bytes_per_call / median / 1e9,
            "ms_best": best * 1e3, "ms_median": median * 1e3, "copies": copies, "calls": len(times)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--filter", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, batch, length, dtype in CASES:
        if args.filter in name:
            print(json.dumps(run_case(name, batch, length, dtype, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
