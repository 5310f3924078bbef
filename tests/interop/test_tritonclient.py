"""Triton's Python gRPC client (tritonclient.grpc.InferenceServerClient) against mhaserve's KServe v2 front door,
exactly as a Triton user calls a model: nothing of this project's on the client side. Results are checked against
reference.py (PyTorch in float64 under tests/interop/run.sh) with the proto's tolerances."""
import os
import threading

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import D_MODEL, HEADS, LAYER, TOKENS

# |got - want| <= atol + rtol |want| (proto/mha/v1/attention.proto): fp32; fp16 and bf16 on the paths that compute
# in 16 bits.
TOLERANCE = {"FP32": (2e-5, 1e-4), "FP16": (4e-3, 4e-3), "BF16": (3e-2, 3e-2)}
NUMPY_TYPE = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.target)
    yield c
    c.close()


def tensor(name, array, datatype):
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def rng_array(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_close(got, want, datatype):
    atol, rtol = TOLERANCE[datatype]
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    excess = np.abs(got - want) - (atol + rtol * np.abs(want))
    assert excess.max() <= 0, "worst excess %.3g at %s" % (excess.max(), np.unravel_index(excess.argmax(), got.shape))


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(LAYER)
    assert not client.is_model_ready("no-such-layer")
    metadata = client.get_server_metadata()
    assert metadata.name == "mhaserve"
    assert "system_shared_memory" in metadata.extensions


def test_model_metadata_config_and_index(client):
    metadata = client.get_model_metadata(LAYER)
    assert metadata.versions == ["1"]
    inputs = {t.name: list(t.shape) for t in metadata.inputs}
    assert inputs["query"] == [-1, -1, D_MODEL]
    assert inputs["head_mask"] == [HEADS]
    config = client.get_model_config(LAYER).config
    assert config.backend == "mhaserve" and config.max_batch_size == 0
    assert [o.name for o in config.output] == ["output", "attention_weights", "lse", "head_entropy",
                                               "head_normalized_entropy", "head_confidence", "head_distance",
                                               "head_sink_mass", "head_contribution"]
    assert {m.name for m in client.get_model_repository_index().models} == {"demo", LAYER, "sdpa"}


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_cross_attention_with_weights_matches_the_reference(client, reference, weights, datatype):
    query = rng_array((2, 5, D_MODEL), 1).astype(NUMPY_TYPE[datatype])
    key = rng_array((2, 7, D_MODEL), 2).astype(NUMPY_TYPE[datatype])
    lengths = np.array([7, 4], dtype=np.int32)
    result = client.infer(LAYER, [tensor("query", query, datatype), tensor("key", key, datatype),
                                  tensor("key_lengths", lengths, "INT32")],
                          outputs=[grpcclient.InferRequestedOutput("output"),
                                   grpcclient.InferRequestedOutput("attention_weights")],
                          parameters={"causal": True})
    want = reference(x=query.astype(np.float64), key=key.astype(np.float64), num_heads=HEADS, causal=True,
                     key_lengths=lengths, **weights)
    output = result.get_output("output")
    assert output.datatype == datatype
    assert_close(result.as_numpy("output").astype(np.float64), want["output"], datatype)
    assert_close(result.as_numpy("attention_weights").astype(np.float64), want["attention_weights"], datatype)


def test_sdpa_with_a_bool_mask_and_gqa(client, reference):
    q, k, v = rng_array((1, 6, 4, 8), 3), rng_array((1, 9, 2, 8), 4), rng_array((1, 9, 2, 8), 5)
    mask = np.random.default_rng(6).random((6, 9)) < 0.7
    mask[:, 0] = True  # every row sees a key
    result = client.infer("sdpa", [tensor("q", q, "FP32"), tensor("k", k, "FP32"), tensor("v", v, "FP32"),
                                   tensor("attn_mask", mask, "BOOL")], parameters={"scale": 0.5})
    want = reference(q=q, k=k, v=v, attn_mask=mask, mask_keep=True, scale=0.5)
    assert_close(result.as_numpy("output"), want["output"], "FP32")


def test_sdpa_lse_and_head_statistics_as_outputs(client):
    q, k, v = rng_array((2, 5, 4, 8), 9), rng_array((2, 7, 2, 8), 10), rng_array((2, 7, 2, 8), 11)
    result = client.infer("sdpa", [tensor("q", q, "FP32"), tensor("k", k, "FP32"), tensor("v", v, "FP32")],
                          outputs=[grpcclient.InferRequestedOutput("lse"),
                                   grpcclient.InferRequestedOutput("head_confidence")])
    # Query head h reads KV head h // 2; numpy's float64 log-sum-exp of the scaled scores.
    scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), np.repeat(k, 2, axis=2).astype(np.float64))
    scores /= np.sqrt(8)
    peak = scores.max(-1, keepdims=True)
    lse = (peak + np.log(np.exp(scores - peak).sum(-1, keepdims=True)))[..., 0]
    assert_close(result.as_numpy("lse"), lse, "FP32")
    confidence = np.exp(peak[..., 0] - lse).mean(-1)  # the largest weight, averaged over the rows
    assert_close(result.as_numpy("head_confidence"), confidence, "FP32")


def test_head_mask_ablates_heads(client, reference, weights):
    query = rng_array((1, 4, D_MODEL), 7)
    head_mask = np.array([1, 0, 1, 0.5], dtype=np.float32)
    result = client.infer(LAYER, [tensor("query", query, "FP32"), tensor("head_mask", head_mask, "FP32")])
    want = reference(x=query, num_heads=HEADS, head_mask=head_mask, **weights)
    assert_close(result.as_numpy("output"), want["output"], "FP32")


def test_shared_memory_in_and_out(client, reference, weights):
    query = rng_array((2, 3, D_MODEL), 8)
    size = query.nbytes
    keys = ("/mha_interop_in_%d" % os.getpid(), "/mha_interop_out_%d" % os.getpid())
    handles = [shm.create_shared_memory_region(name, key, size) for name, key in zip(("in", "out"), keys)]
    try:
        shm.set_shared_memory_region(handles[0], [query])
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("in", keys[0], size)
        client.register_system_shared_memory("out", keys[1], size)
        assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {"in", "out"}
        given = grpcclient.InferInput("query", list(query.shape), "FP32")
        given.set_shared_memory("in", size)
        wanted = grpcclient.InferRequestedOutput("output")
        wanted.set_shared_memory("out", size)
        result = client.infer(LAYER, [given], outputs=[wanted])
        output = result.get_output("output")
        got = shm.get_contents_as_numpy(handles[1], np.float32, list(output.shape))
        assert_close(got, reference(x=query, num_heads=HEADS, **weights)["output"], "FP32")
    finally:
        client.unregister_system_shared_memory()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_async_infer(client, reference, weights):
    query = rng_array((1, 2, D_MODEL), 9)
    done, results = threading.Event(), []

    def callback(result, error):
        results.append((result, error))
        done.set()

    client.async_infer(LAYER, [tensor("query", query, "FP32")], callback)
    assert done.wait(30)
    result, error = results[0]
    assert error is None
    assert_close(result.as_numpy("output"), reference(x=query, num_heads=HEADS, **weights)["output"], "FP32")


def test_statistics_count_the_calls(client):
    before = client.get_inference_statistics(LAYER).model_stats[0].inference_stats.success.count
    client.infer(LAYER, [tensor("query", rng_array((1, 2, D_MODEL), 10), "FP32")])
    stats = client.get_inference_statistics(LAYER).model_stats[0]
    assert stats.inference_stats.success.count == before + 1
    assert stats.inference_stats.compute_infer.ns > 0


def query_named(name, shape=(1, 2, D_MODEL), datatype="FP32", dtype=np.float32):
    return [tensor(name, rng_array(shape, 11).astype(dtype), datatype)]


# What a Triton user gets wrong, and the exact code and the words each answer carries.
ERRORS = [
    ("unknown_model", "no-such-layer", query_named("query"), "NOT_FOUND", "model 'no-such-layer' is not served"),
    ("missing_input", LAYER, query_named("key"), "INVALID_ARGUMENT", "'query' is missing"),
    ("misnamed_input", LAYER, query_named("Query"), "INVALID_ARGUMENT", "takes no input 'Query'"),
    ("wrong_datatype", LAYER, query_named("query", datatype="INT32", dtype=np.int32), "INVALID_ARGUMENT",
     "query: datatype 'INT32' is not taken"),
    ("bad_shape", LAYER, query_named("query", shape=(1, 2, D_MODEL + 1)), "INVALID_ARGUMENT", "query"),
]


@pytest.mark.parametrize("model,inputs,code,words", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_keep_their_codes(client, model, inputs, code, words):
    with pytest.raises(InferenceServerException) as raised:
        client.infer(model, inputs)
    assert raised.value.status() == "StatusCode." + code
    assert words in raised.value.message()
    assert client.is_server_live()


def test_tls_and_a_bearer_token(secure_server, certs, reference, weights):
    options = dict(ssl=True, root_certificates=str(certs / "ca.pem"))
    with grpcclient.InferenceServerClient(secure_server.target, **options) as c:
        with pytest.raises(InferenceServerException) as raised:
            c.is_server_live()
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        query = rng_array((1, 3, D_MODEL), 12)
        headers = {"authorization": "Bearer " + TOKENS[0]}
        assert c.is_server_live(headers=headers)
        result = c.infer(LAYER, [tensor("query", query, "FP32")], headers=headers)
        assert_close(result.as_numpy("output"), reference(x=query, num_heads=HEADS, **weights)["output"], "FP32")
