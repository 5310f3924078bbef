"""What a user would run instead of mhaserve, on the same shapes, threads and dtype (fp32) as attention_bench.

Runs in the peers' own virtual environment (tests/bench/peers-env.sh prints its Python). One round times, shape by
shape, every peer below on the same self-attention layer: input x [B, T, d], weights in the Y = X W convention
(w_q [d, H dk], w_k and w_v [d, Hkv dk], w_o [H dk, d], no biases), fp32 in and out, the threads pinned equal:

  numpy        the math in numpy matmuls (its bundled OpenBLAS), as peers did before PyTorch 2 was here
  torch_sdpa   PyTorch 2: F.linear projections, F.scaled_dot_product_attention (fused flash kernel on the CPU;
               enable_gqa for GQA, is_causal), F.linear out
  torch_mha    PyTorch 2: nn.MultiheadAttention (zero biases), eval and inference_mode: its fused fast path
               without a mask, F.scaled_dot_product_attention inside for causal; no GQA
  ort_attention  ONNX Runtime: MatMul, Split, the standard ONNX Attention op (opset 23; GQA by kv_num_heads,
               is_causal), MatMul; weights through its qk_matmul_output (mode 3, after the softmax)
  ort_gqa      ONNX Runtime: MatMul, Split, com.microsoft GroupQueryAttention (causal 0 or 1), MatMul
  ort_fused    ONNX Runtime: com.microsoft Attention, the BERT-style op with the input projection inside, MatMul;
               no GQA (one head count), no weights
  openvino     OpenVINO: MatMul, Split, opset13 ScaledDotProductAttention (K/V heads repeated to H for GQA),
               MatMul; INFERENCE_PRECISION_HINT f32 (its default on AVX512-BF16/AMX CPUs is bf16), no weights

Weights are constants of the compiled graph for ONNX Runtime and OpenVINO (they prepack them, as the server's
registered layers are), tensors for PyTorch. Causal masks: every shape here is self-attention (Tq = Tk), where
top-left and bottom-right alignment agree; with Tq < Tk only ort_attention and ort_gqa would express the server's
bottom-right mask. A peer that cannot express a case prints {"na": reason} instead of timing another case.
Each peer's first output is checked against a float64 reference on 32 query rows (max |diff| in "max_err").

Between peers the process sleeps --pause seconds: one library's idle OpenMP / OpenBLAS / TBB threads spin for a
while after its last call and slow the next one (measured: the server read 42-51% of peak right after numpy, 72-84%
after half a second). With --probe, the FMA probe (attention_bench with no benchmark selected) runs right before
and right after each shape's peers, in its own process; the higher reading goes with that shape's lines (a shape's
lines come out when it is done).

Prints one JSON object per line: first {"versions": {...}, "threads": N, "cpu": ...}, then per (shape, weights,
peer) {"round", "shape", "weights", "peer", "impl", "gflops" (fastest call), "gflops_median", "ms_best",
"ms_median", "runs", "max_err", "peak_gflops"} or the same keys up to "impl" with "na".

Usage: tests/bench/peers.py [--threads 2] [--min_time 0.3] [--pause 0.5] [--round 0] [--filter SUBSTRING]
                            [--peers numpy,torch_sdpa,...] [--probe build/bin/attention_bench]
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

# Thread counts must be fixed before the libraries load their thread pools.
_threads = "2"
for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        _threads = sys.argv[_i + 1]
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import numpy as np  # noqa: E402

# (name, B, T, d_model, H, Hkv, causal, weights cases). The first eight are attention_bench's table (weights off
# and on); then many short sequences and one long one (weights off), which tests/bench/server_shapes.py times on
# the server's demo layer (d=512, H=8).
SHAPES = [
    ("b1_t16_d64_h4", 1, 16, 64, 4, 4, False, (False, True)),
    ("b32_t64_d256_h4", 32, 64, 256, 4, 4, False, (False, True)),
    ("b8_t128_d512_h8", 8, 128, 512, 8, 8, False, (False, True)),
    ("b8_t512_d512_h8", 8, 512, 512, 8, 8, False, (False, True)),
    ("b8_t512_d512_h8_gqa2", 8, 512, 512, 8, 2, False, (False, True)),
    ("b8_t512_d512_h8_gqa2_causal", 8, 512, 512, 8, 2, True, (False, True)),
    ("b1_t2048_d1024_h16", 1, 2048, 1024, 16, 16, False, (False, True)),
    ("b1_t2048_d1024_h16_causal", 1, 2048, 1024, 16, 16, True, (False, True)),
    ("b64_t32_d512_h8", 64, 32, 512, 8, 8, False, (False,)),
    ("b64_t64_d512_h8", 64, 64, 512, 8, 8, False, (False,)),
    ("b64_t96_d512_h8", 64, 96, 512, 8, 8, False, (False,)),
    ("b64_t128_d512_h8", 64, 128, 512, 8, 8, False, (False,)),
    ("b1_t8192_d512_h8", 1, 8192, 512, 8, 8, False, (False,)),
]

# The shapes attention_bench's table lacks: server_shapes.py times ours on them through the server's demo layer.
SERVER_SHAPES = [s[0] for s in SHAPES if s[0].startswith("b64_") or s[0].startswith("b1_t8192")]

PEERS = ["numpy", "torch_sdpa", "torch_mha", "ort_attention", "ort_gqa", "ort_fused", "openvino"]


class NotApplicable(Exception):
    """The peer cannot express this case; the message says why."""


def flops(B, T, d, H, Hkv, causal):
    """AttentionFlops (proto/mha/v1/attention_shape.h) for self-attention: causal counts the visible pairs only."""
    dk = d // H
    pairs = T * (T + 1) // 2 if causal else T * T
    return 2 * B * T * d * H * dk + 4 * B * T * d * Hkv * dk + 2 * B * T * H * dk * d + 4 * B * H * dk * pairs


class Problem:
    """One layer's inputs and weights, filled deterministically, with a float64 reference on a few query rows."""

    def __init__(self, B, T, d, H, Hkv, causal):
        self.B, self.T, self.d, self.H, self.Hkv, self.causal = B, T, d, H, Hkv, causal
        self.dk = d // H
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((B, T, d), dtype=np.float32)
        bound = np.float32(1.0 / math.sqrt(d))
        self.w_q = rng.standard_normal((d, H * self.dk), dtype=np.float32) * bound
        self.w_k = rng.standard_normal((d, Hkv * self.dk), dtype=np.float32) * bound
        self.w_v = rng.standard_normal((d, Hkv * self.dk), dtype=np.float32) * bound
        self.w_o = rng.standard_normal((H * self.dk, d), dtype=np.float32) * bound
        self.w_qkv = np.ascontiguousarray(np.concatenate([self.w_q, self.w_k, self.w_v], axis=1))
        self.rows = np.unique(np.linspace(0, T - 1, min(T, 32)).astype(int))
        self.reference = self._reference()

    def _reference(self):
        """Output rows self.rows of batch item B-1, in float64."""
        x = self.x[-1].astype(np.float64)
        dk, group = self.dk, self.H // self.Hkv
        q = (x[self.rows] @ self.w_q).reshape(len(self.rows), self.H, dk)
        k = (x @ self.w_k).reshape(self.T, self.Hkv, dk)
        v = (x @ self.w_v).reshape(self.T, self.Hkv, dk)
        heads = np.empty((len(self.rows), self.H, dk))
        for h in range(self.H):
            s = q[:, h] @ k[:, h // group].T / math.sqrt(dk)
            if self.causal:
                s[np.arange(self.T)[None, :] > self.rows[:, None]] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            heads[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
        return heads.reshape(len(self.rows), -1) @ self.w_o

    def error(self, out):
        return float(np.abs(np.asarray(out, dtype=np.float64)[-1, self.rows] - self.reference).max())


# ---- the peers: each returns a call that computes the layer and returns (output, weights or None) ----------------

def numpy_peer(p, weights):
    def call():
        B, T, H, Hkv, dk = p.B, p.T, p.H, p.Hkv, p.dk
        q = (p.x @ p.w_q).reshape(B, T, H, dk).transpose(0, 2, 1, 3)
        k = (p.x @ p.w_k).reshape(B, T, Hkv, dk).transpose(0, 2, 3, 1)
        v = (p.x @ p.w_v).reshape(B, T, Hkv, dk).transpose(0, 2, 1, 3)
        if Hkv != H:
            k = np.repeat(k, H // Hkv, axis=1)
            v = np.repeat(v, H // Hkv, axis=1)
        s = (q @ k) * np.float32(1.0 / math.sqrt(dk))
        if p.causal:
            s += np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, H * dk)
        return o @ p.w_o, (s if weights else None)
    if p.T >= 8192:
        raise NotApplicable("skipped: materialises the [B,H,T,T] scores several times (GiBs, minutes)")
    return "numpy %s matmuls, exact softmax" % np.__version__, call


def torch_sdpa_peer(p, weights):
    import torch
    import torch.nn.functional as F
    if weights:
        raise NotApplicable("scaled_dot_product_attention returns no weights")
    x = torch.from_numpy(p.x)
    w_qkv = torch.from_numpy(p.w_qkv.T.copy())  # nn.Linear's [out, in]
    w_o = torch.from_numpy(p.w_o.T.copy())
    B, T, H, Hkv, dk = p.B, p.T, p.H, p.Hkv, p.dk

    def call():
        with torch.inference_mode():
            q, k, v = F.linear(x, w_qkv).split([H * dk, Hkv * dk, Hkv * dk], dim=-1)
            q = q.view(B, T, H, dk).transpose(1, 2)
            k = k.view(B, T, Hkv, dk).transpose(1, 2)
            v = v.view(B, T, Hkv, dk).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, enable_gqa=Hkv != H)
            return F.linear(o.transpose(1, 2).reshape(B, T, H * dk), w_o).numpy(), None
    return "torch %s F.scaled_dot_product_attention" % torch.__version__, call


def torch_mha_peer(p, weights):
    import torch
    if p.Hkv != p.H:
        raise NotApplicable("nn.MultiheadAttention has one head count (no GQA)")
    # Zero biases rather than bias=False: without biases the module skips its fused fast path
    # (_native_multi_head_attention) for F.multi_head_attention_forward.
    module = torch.nn.MultiheadAttention(p.d, p.H, batch_first=True).eval()
    with torch.no_grad():
        module.in_proj_weight.copy_(torch.from_numpy(p.w_qkv.T))
        module.out_proj.weight.copy_(torch.from_numpy(p.w_o.T))
        module.in_proj_bias.zero_()
        module.out_proj.bias.zero_()
    x = torch.from_numpy(p.x)
    mask = torch.triu(torch.full((p.T, p.T), float("-inf")), 1) if p.causal else None

    def call():
        with torch.inference_mode():
            out, w = module(x, x, x, attn_mask=mask, is_causal=p.causal, need_weights=weights,
                            average_attn_weights=False)
            return out.numpy(), (w.numpy() if weights else None)
    return "torch %s nn.MultiheadAttention" % torch.__version__, call


def _ort_session(p, nodes, initializers, outputs, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [p.B, p.T, p.d])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(a, name) for name, a in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": p.x}

    def call():
        result = session.run(None, feeds)
        return result[0], (result[1] if len(result) > 1 else None)
    return call


def _ort_split(p):
    from onnx import helper
    splits = np.array([p.H * p.dk, p.Hkv * p.dk, p.Hkv * p.dk], np.int64)
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]),
             helper.make_node("Split", ["qkv", "splits"], ["q", "k", "v"], axis=2)]
    return nodes, {"w_qkv": p.w_qkv, "w_o": p.w_o, "splits": splits}


def ort_attention_peer(p, weights, threads):
    import onnxruntime as ort
    from onnx import helper
    nodes, inits = _ort_split(p)
    extra = {"qk_matmul_output_mode": 3} if weights else {}
    nodes += [helper.make_node("Attention", ["q", "k", "v"], ["heads", "", "", "probs"] if weights else ["heads"],
                               q_num_heads=p.H, kv_num_heads=p.Hkv, is_causal=int(p.causal), **extra),
              helper.make_node("MatMul", ["heads", "w_o"], ["y"])]
    return ("onnxruntime %s Attention (opset 23)" % ort.__version__,
            _ort_session(p, nodes, inits, ["y", "probs"] if weights else ["y"], threads))


def ort_gqa_peer(p, weights, threads):
    import onnxruntime as ort
    from onnx import helper
    nodes, inits = _ort_split(p)
    inits["seqlens_k"] = np.full((p.B,), p.T - 1, np.int32)
    inits["total_len"] = np.array(p.T, np.int32)
    extra = {"qk_output": 2} if weights else {}
    nodes += [helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total_len"],
                               ["heads", "", "", "probs"] if weights else ["heads"], domain="com.microsoft",
                               num_heads=p.H, kv_num_heads=p.Hkv, causal=int(p.causal), **extra),
              helper.make_node("MatMul", ["heads", "w_o"], ["y"])]
    return ("onnxruntime %s com.microsoft.GroupQueryAttention" % ort.__version__,
            _ort_session(p, nodes, inits, ["y", "probs"] if weights else ["y"], threads))


def ort_fused_peer(p, weights, threads):
    import onnxruntime as ort
    from onnx import helper
    if p.Hkv != p.H:
        raise NotApplicable("com.microsoft.Attention has one head count (no GQA)")
    if weights:
        raise NotApplicable("com.microsoft.Attention returns no weights")
    inits = {"w_qkv": p.w_qkv, "w_o": p.w_o, "bias": np.zeros(p.w_qkv.shape[1], np.float32)}
    nodes = [helper.make_node("Attention", ["x", "w_qkv", "bias"], ["heads"], domain="com.microsoft",
                              num_heads=p.H, unidirectional=int(p.causal)),
             helper.make_node("MatMul", ["heads", "w_o"], ["y"])]
    return ("onnxruntime %s com.microsoft.Attention (projection fused)" % ort.__version__,
            _ort_session(p, nodes, inits, ["y"], threads))


def openvino_peer(p, weights, threads):
    import openvino as ov
    import openvino.opset13 as ops
    if weights:
        raise NotApplicable("ScaledDotProductAttention returns no weights")
    B, T, H, Hkv, dk = p.B, p.T, p.H, p.Hkv, p.dk

    def const(values):
        return ops.constant(np.array(values, np.int64))

    def heads(t, n):  # [B, T, n dk] -> [B, n, T, dk]
        return ops.transpose(ops.reshape(t, const([B, T, n, dk]), False), const([0, 2, 1, 3]))

    x = ops.parameter([B, T, p.d], ov.Type.f32, name="x")
    q, k, v = ops.variadic_split(ops.matmul(x, ops.constant(p.w_qkv), False, False), 2,
                                 [H * dk, Hkv * dk, Hkv * dk]).outputs()
    q = heads(q, H)
    if Hkv == H:
        k, v = heads(k, H), heads(v, H)
    else:  # repeat each K/V head for its H/Hkv query heads (faster here than SDPA's own 5-D broadcasting)
        def repeat(t):
            t = ops.transpose(ops.reshape(t, const([B, T, Hkv, 1, dk]), False), const([0, 2, 3, 1, 4]))
            return ops.reshape(ops.broadcast(t, const([B, Hkv, H // Hkv, T, dk])), const([B, H, T, dk]), False)
        k, v = repeat(k), repeat(v)
    o = ops.scaled_dot_product_attention(q, k, v, causal=p.causal)
    o = ops.reshape(ops.transpose(o, const([0, 2, 1, 3])), const([B, T, H * dk]), False)
    y = ops.matmul(o, ops.constant(p.w_o), False, False)
    compiled = ov.Core().compile_model(ov.Model([y], [x]), "CPU", {
        "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1})
    request = compiled.create_infer_request()

    def call():
        return request.infer({0: p.x})[0], None
    return "openvino %s ScaledDotProductAttention" % ov.__version__, call


def make_peer(name, p, weights, threads):
    if name == "numpy":
        return numpy_peer(p, weights)
    if name == "torch_sdpa":
        return torch_sdpa_peer(p, weights)
    if name == "torch_mha":
        return torch_mha_peer(p, weights)
    return globals()[name + "_peer"](p, weights, threads)


def time_calls(call, min_time):
    """Times calls until min_time has passed and at least 3 calls (2 for calls over a second) ran; seconds each."""
    seconds = []
    while sum(seconds) < min_time or len(seconds) < (2 if seconds and seconds[0] > 1.0 else 3):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)


def probe(command, threads):
    """The FMA probe's fp32 peak in GFLOP/s: attention_bench with no benchmark selected prints it first."""
    out = subprocess.run([command, "--benchmark_filter=^$"], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads))).stdout
    found = re.search(r"fp32 peak: ([0-9.]+) GFLOP/s", out)
    return float(found.group(1)) if found else None


def versions():
    import onnxruntime
    import openvino
    import torch
    return {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "openvino": openvino.__version__}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min_time", type=float, default=0.3, help="seconds of timed calls per peer and shape")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds of sleep between two peers")
    parser.add_argument("--round", type=int, default=0, help="label of this round in the output")
    parser.add_argument("--filter", default="", help="only shapes whose name contains this")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--probe", default="", help="attention_bench binary: the FMA probe around each shape")
    args = parser.parse_args()
    import torch  # after the thread variables; set_num_threads for its intra-op pool as well
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "")
    print(json.dumps({"versions": versions(), "threads": args.threads, "cpu": cpu, "round": args.round}),
          flush=True)
    for name, B, T, d, H, Hkv, causal, weight_cases in SHAPES:
        if args.filter not in name:
            continue
        problem = Problem(B, T, d, H, Hkv, causal)
        peak_before = probe(args.probe, args.threads) if args.probe else None
        lines = []
        for weights in weight_cases:
            for peer in args.peers.split(","):
                row = {"round": args.round, "shape": name, "weights": weights, "peer": peer}
                try:
                    impl, call = make_peer(peer, problem, weights, args.threads)
                except NotApplicable as why:
                    lines.append(dict(row, impl="", na=str(why)))
                    continue
                time.sleep(args.pause)
                out, _ = call()  # warm-up: allocation, first touch, the libraries' own caches
                seconds = time_calls(call, args.min_time)
                best, median = seconds[0], seconds[len(seconds) // 2]
                f = flops(B, T, d, H, Hkv, causal)
                lines.append(dict(row, impl=impl, gflops=f / best / 1e9, gflops_median=f / median / 1e9,
                                  ms_best=best * 1e3, ms_median=median * 1e3, runs=len(seconds),
                                  max_err=problem.error(out)))
                del call, out
        # The probe's peak: the higher of its readings right before and right after the shape's peers.
        peak = max(peak_before, probe(args.probe, args.threads)) if args.probe else None
        for line in lines:
            if "na" not in line:
                line["peak_gflops"] = peak
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
