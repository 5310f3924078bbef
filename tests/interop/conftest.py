"""Fixtures for the interop tests: tritonclient against the real mha_server, results checked against reference.py.

Environment (tests/interop/run.sh sets them):
  MHA_SERVER_BIN        the server binary (tests/server_process.py)
  MHA_REFERENCE_PYTHON  the Python that runs reference.py: tests/bench/peers-env.sh's, with PyTorch; unset: this one
                        (numpy)
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from server_process import run_server  # noqa: E402

# The layer every test calls: GQA (4 query heads over 2 KV heads of 16 dims), d_model 64, with biases.
D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
LAYER = "gqa"
TOKENS = ("interop-compute-token-0123456789",)


def layer_weights():
    rng = np.random.default_rng(5)
    shapes = {"w_q": (D_MODEL, HEADS * HEAD_DIM), "w_k": (D_MODEL, KV_HEADS * HEAD_DIM),
              "w_v": (D_MODEL, KV_HEADS * HEAD_DIM), "w_o": (HEADS * HEAD_DIM, D_MODEL),
              "b_q": (HEADS * HEAD_DIM,), "b_k": (KV_HEADS * HEAD_DIM,), "b_v": (KV_HEADS * HEAD_DIM,),
              "b_o": (D_MODEL,)}
    return {name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
            for name, shape in shapes.items()}


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


@pytest.fixture(scope="session")
def weights():
    return layer_weights()


@pytest.fixture(scope="session")
def layers_dir(tmp_path_factory, weights):
    folder = tmp_path_factory.mktemp("layers")
    write_safetensors(folder / (LAYER + ".safetensors"), weights,
                      {"num_heads": str(HEADS), "num_kv_heads": str(KV_HEADS)})
    return folder


@pytest.fixture(scope="session")
def server(tmp_path_factory, layers_dir):
    with run_server(tmp_path_factory.mktemp("server"), "--layers_dir", str(layers_dir),
                    "--max_shared_memory_regions", "4") as s:
        yield s


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", "-c", 'source "$0"/../test_certs.sh && make_test_certs "$1" pem server',
                    HERE, str(folder)], check=True)
    return folder


@pytest.fixture(scope="session")
def secure_server(tmp_path_factory, layers_dir, certs):
    """TLS with bearer tokens."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("".join(t + "\n" for t in TOKENS))
    with run_server(tmp_path_factory.mktemp("secure"), "--layers_dir", str(layers_dir),
                    "--tls_cert", str(certs / "server.pem"), "--tls_key", str(certs / "server.key"),
                    "--auth_tokens_file", str(tokens)) as s:
        yield s


class Reference:
    """reference.py in its own process (PyTorch's environment when given)."""

    def __init__(self, python, work):
        self._work, self._n = work, 0
        self._proc = subprocess.Popen([python, os.path.join(HERE, "reference.py")], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self.engine = self._proc.stdout.readline().strip()

    def __call__(self, **inputs):
        self._n += 1
        path = str(self._work / ("case%d.npz" % self._n))
        np.savez(path, **{k: np.asarray(v) for k, v in inputs.items() if v is not None})
        self._proc.stdin.write(path + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline().strip()
        assert answer == "ok", "reference.py: %s" % answer
        with np.load(path + ".out.npz") as out:
            return {k: out[k] for k in out.files}

    def close(self):
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    ref = Reference(os.environ.get("MHA_REFERENCE_PYTHON") or sys.executable, tmp_path_factory.mktemp("reference"))
    print("\nreference: " + ref.engine)
    yield ref
    ref.close()
