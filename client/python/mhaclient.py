"""Thin Python client for mhaserve (gRPC package ``mha.v1``, service ``Attention``): numpy in, numpy out.

Stubs
-----
The module needs Python stubs generated from the wire contract and from the standard gRPC health service.
Generate them once, from the repository root, with::

    protoc -I proto -I grpc_health/v1=/usr/share/grpc-proto/grpc/health/v1 --python_out=OUT --grpc_out=OUT \\
        --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin proto/mha/v1/attention.proto grpc_health/v1/health.proto

and put ``OUT`` on ``PYTHONPATH`` (no ``__init__.py`` files are needed: ``mha`` and ``grpc_health`` are namespace
packages). ``generate_stubs(OUT)`` runs exactly that command.

Why ``grpc_health/v1`` and not ``grpc/health/v1``: generating health.proto under its own path writes
``OUT/grpc/health/v1/health_pb2.py``, but the installed ``grpc`` is a regular package, so ``import grpc.health`` only
searches the installed package and fails (the generated folder cannot be merged into it). The ``-I virtual=disk``
mapping above compiles the very same health.proto (proto package ``grpc.health.v1``, so the RPC is still
``/grpc.health.v1.Health/Check``) into ``OUT/grpc_health/v1/``, which is the module layout of PyPI's
``grpcio-health-checking``; ``from grpc_health.v1 import health_pb2, health_pb2_grpc`` therefore works with either.

Tensors
-------
Tensors travel as raw little-endian row-major bytes. On input, numpy ``float16`` arrays go as FP16 and every other
array is converted to ``float32`` and goes as FP32, unless ``wire_dtype`` asks for 'fp32', 'fp16' or 'bf16' (BF16 is
rounded to nearest even, see ``to_bf16_bytes``). On output, FP32 decodes to ``float32``, FP16 to ``float16`` and BF16
(which numpy lacks) to ``float32``.

Errors
------
Every RPC failure is raised unchanged as ``grpc.RpcError``; ``err.code()`` is a ``grpc.StatusCode``
(INVALID_ARGUMENT for bad input, NOT_FOUND for an unknown layer, UNAVAILABLE when the server or a backend is not
there, RESOURCE_EXHAUSTED for an oversized message or a full queue, DEADLINE_EXCEEDED after ``timeout``) and
``err.details()`` the server's message. Bad arguments detected locally (e.g. an unknown dtype name) raise
ValueError / TypeError.

Shared memory
-------------
A client on the server's host can leave tensors out of the messages (the server must run with
``--max_shared_memory_regions`` > 0): ``SharedMemoryRegion(client, name, byte_size)`` creates a POSIX shared-memory
object and registers it; ``region.put(array, offset)`` writes an array there and returns a Tensor that references it
(pass it as query, key, value, q, k or v), and ``output_shared_memory=region.output_at(offset)`` has the server write
the output there; the result's output is then read back from the region. ``client.shared_memory_status()`` lists
the server's regions.

Sessions
--------
A decoder keeps each sequence's KV cache on the server: ``client.create_session(layers=["demo"])`` (or a head
session with ``num_heads``, ``num_kv_heads``, ``head_dim``) returns a ``Session``; ``session.extend(layer_index,
x=...)`` appends the new tokens and returns their attention over the whole cache; ``fork()``, ``truncate(n)`` and
``close()`` do what they say. ``client.extend([...])`` runs several sessions' tokens in one call. Every session call
sends the session id as ``mha-session-id`` metadata. ``decode_example.py`` is a tiny decoder built this way.
``create_session(..., recover=True)`` (or a ``Recovery``) records what the session is fed; when a call finds it lost
(NOT_FOUND, UNAVAILABLE: a restarted server, an eviction, a dead replica behind a proxy) the session is re-created
under its id, its record replayed and the call sent again, with outputs exactly as they would have been;
``session.recoveries`` counts the rebuilds.

Softmax statistics
------------------
``return_lse=True`` on multi_head_attention, scaled_dot_product_attention and extend fills the result's ``lse``
(float32, [B, H, Tq]; [H, n] per ExtendResult): the log-sum-exp of each query row's scaled, masked scores, -inf for a
row that sees no key. Outputs computed over disjoint sets of keys merge exactly by it: ``merge_attention(outputs,
lses)`` (a context sharded over several head sessions, each ExtendItem but the last with ``"append": False``).
``return_head_stats=True`` fills ``head_stats``, a dict of float32 arrays [B, H] ([H] per ExtendResult) keyed by
HeadStats' field names (entropy, normalized_entropy, confidence, distance, sink_mass and, for MultiHeadAttention and
layer sessions, contribution); ``return_row_stats=True`` (with return_head_stats) fills ``row_stats``, the same per
query row, [B, H, Tq] ([H, n]). ``sink_tokens`` sets the keys sink_mass counts (0: the server's 4).
``heads_example.py`` ranks a layer's heads by them. ``ShardedSession(clients, num_heads=...)`` keeps one head
session per client (replica) for a context too long for one server: ``prefill`` spreads the tokens over them,
``extend`` appends to the last and reads the others, and both return the merged (output, lse).

Example::

    with MhaClient("127.0.0.1:50051") as c:
        r = c.multi_head_attention(np.random.randn(2, 16, 512).astype(np.float32), layer="demo")
        print(r.output.shape, r.backend, r.compute_us)
        s = c.create_session(layers=["demo"])
        print(s.extend(0, x=np.random.randn(5, 512)).length)  # 5
"""

import collections
import concurrent.futures
import hashlib
import math
import queue
import struct
import threading
import time

import grpc
import numpy as np

__all__ = [
    "MhaClient",
    "Session",
    "ExtendResult",
    "SharedMemoryRegion",
    "AttentionResult",
    "LayerInfo",
    "generate_stubs",
    "protoc_command",
    "to_tensor",
    "from_tensor",
    "to_bf16_bytes",
    "from_bf16_bytes",
    "merge_attention",
    "rope_scaling_message",
    "HEAD_STAT_FIELDS",
    "ShardedSession",
    "Recovery",
]

# Stub generation needs only the standard library, so that the package's build step can use it too.
from mhaclient_stubs import generate_stubs, protoc_command  # noqa: E402,F401


_stub_modules = None


def _stubs():
    """Imports the generated stubs on first use, so that generate_stubs works before they exist."""
    global _stub_modules
    if _stub_modules is None:
        from mha.v1 import attention_pb2, attention_pb2_grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        _stub_modules = (attention_pb2, attention_pb2_grpc, health_pb2, health_pb2_grpc)
    return _stub_modules


# --------------------------------------------------------------------------------------------------------------
# RoPE scaling.

# RopeScaling's fields: transformers' rope_scaling / rope_parameters keys, by the same names.
_ROPE_SCALING_FIELDS = ("rope_type", "factor", "original_max_position_embeddings", "max_position_embeddings",
                        "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                        "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor")


def rope_scaling_message(scaling, max_position_embeddings=None):
    """A RopeScaling message from a transformers rope_scaling dict (config.rope_scaling, or transformers 5's
    config.rope_parameters): its keys by their names, "type" as an old name of "rope_type"; "rope_theta" and
    "partial_rotary_factor" are HeadConfig's rope_theta and rope_dim, not part of it, and are skipped. None values are
    unset. max_position_embeddings: the model's (config.max_position_embeddings), which dynamic needs and from which
    yarn and longrope derive a missing factor; taken for those types when the dict has none. A RopeScaling message
    passes through."""
    pb = _stubs()[0]
    if isinstance(scaling, pb.RopeScaling):
        return scaling
    fields = {}
    for key, value in dict(scaling).items():
        key = "rope_type" if key == "type" else key
        if key in ("rope_theta", "partial_rotary_factor") or value is None:
            continue
        if key not in _ROPE_SCALING_FIELDS:
            raise ValueError("rope_scaling has %r, which RopeScaling does not know; its fields are %s"
                             % (key, ", ".join(_ROPE_SCALING_FIELDS)))
        fields[key] = value
    reads_max = fields.get("rope_type") in ("dynamic", "yarn", "longrope")  # the server refuses unread fields
    if max_position_embeddings and reads_max and not fields.get("max_position_embeddings"):
        fields["max_position_embeddings"] = int(max_position_embeddings)
    return pb.RopeScaling(**fields)


# --------------------------------------------------------------------------------------------------------------
# Tensor conversion.

_DTYPE_NAMES = {"fp32": 1, "float32": 1, "fp16": 2, "float16": 2, "half": 2, "bf16": 3, "bfloat16": 3}


_CACHE_DTYPE_NAMES = {"int8": 4, "fp8_e4m3": 5, "fp8_e5m2": 6}


def prefix_keys(token_ids, block_tokens, extra=b""):
    """Shared-prefix keys (CreateSessionRequest.prefix_keys) of the full blocks of `token_ids`: key i =
    SHA-256(key i-1 (none for block 0) | len(extra) as 8 bytes little-endian | extra | block i's ids as 8-byte
    little-endian integers), 32 bytes each, as the C++ client's mha::PrefixKeys. block_tokens: the server's
    kv_block_tokens (MhaClient.server_info()["limits"]["kv_block_tokens"]). extra (bytes or str): what else the
    blocks depend on (the model, a LoRA adapter)."""
    if int(block_tokens) < 1:
        raise ValueError("block_tokens must be >= 1, got %r" % block_tokens)
    extra = extra.encode() if isinstance(extra, str) else bytes(extra)
    ids = [int(t) for t in token_ids]
    keys, parent = [], b""
    for b in range(len(ids) // int(block_tokens)):
        block = ids[b * int(block_tokens):(b + 1) * int(block_tokens)]
        message = parent + struct.pack("<Q", len(extra)) + extra + struct.pack("<%dq" % len(block), *block)
        parent = hashlib.sha256(message).digest()
        keys.append(parent)
    return keys


def _cache_dtype_enum(dtype):
    """A cache_dtype: what _dtype_enum takes, or 'int8' / 'fp8_e4m3' / 'fp8_e5m2' (4..6), which only a cache stores."""
    if isinstance(dtype, str) and dtype.lower() in _CACHE_DTYPE_NAMES:
        return _CACHE_DTYPE_NAMES[dtype.lower()]
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool) and int(dtype) in (4, 5, 6):
        return int(dtype)
    return _dtype_enum(dtype)


def _dtype_enum(dtype):
    """Maps None / 'fp32' / 'fp16' / 'bf16' / np.float32 / np.float16 / enum value to the DataType number."""
    if dtype is None:
        return 0
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) not in (0, 1, 2, 3):
            raise ValueError("unknown DataType value %r" % (dtype,))
        return int(dtype)
    if isinstance(dtype, str):
        key = dtype.lower()
        if key not in _DTYPE_NAMES:
            raise ValueError("unknown dtype %r; use 'fp32', 'fp16' or 'bf16'" % (dtype,))
        return _DTYPE_NAMES[key]
    np_dtype = np.dtype(dtype)
    if np_dtype == np.float32:
        return 1
    if np_dtype == np.float16:
        return 2
    raise ValueError("unsupported dtype %r; use 'fp32', 'fp16' or 'bf16'" % (dtype,))


def to_bf16_bytes(array):
    """bfloat16 bytes (little-endian, row-major) of array, rounded to nearest even; NaN stays a (quiet) NaN."""
    a = np.ascontiguousarray(np.asarray(array, dtype=np.float32))
    u = a.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(a)
    out = np.where(nan, (u >> 16) | 0x40, rounded).astype("<u2")
    return out.tobytes()


def from_bf16_bytes(data, shape=None):
    """float32 array from bfloat16 bytes: each uint16 becomes the upper half of a float32."""
    u16 = np.frombuffer(data, dtype="<u2")
    out = (u16.astype(np.uint32) << 16).view(np.float32)
    return out.reshape(shape) if shape is not None else out


def to_tensor(array, dtype=None):
    """An mha.v1.Tensor from a numpy array (or array-like). An existing Tensor message is returned unchanged.

    dtype None: float16 arrays go as FP16, everything else as FP32. Otherwise 'fp32', 'fp16' or 'bf16'.
    """
    attention_pb2 = _stubs()[0]
    if isinstance(array, attention_pb2.Tensor):
        return array
    a = np.asarray(array)
    code = _dtype_enum(dtype)
    if code == 0:
        code = 2 if a.dtype == np.float16 else 1
    if code == 1:
        data = np.ascontiguousarray(a, dtype="<f4").tobytes()
    elif code == 2:
        data = np.ascontiguousarray(a, dtype="<f2").tobytes()
    else:
        data = to_bf16_bytes(a)
    return attention_pb2.Tensor(shape=[int(d) for d in a.shape], dtype=code, data=data)


def from_tensor(tensor):
    """numpy array of a Tensor: FP32 -> float32, FP16 -> float16, BF16 -> float32. None for an unset tensor."""
    if tensor is None or (len(tensor.shape) == 0 and len(tensor.data) == 0):
        return None
    shape = tuple(int(d) for d in tensor.shape)
    if tensor.dtype == 1:
        return np.frombuffer(tensor.data, dtype="<f4").astype(np.float32).reshape(shape)
    if tensor.dtype == 2:
        return np.frombuffer(tensor.data, dtype="<f2").astype(np.float16).reshape(shape)
    if tensor.dtype == 3:
        return from_bf16_bytes(tensor.data, shape)
    raise ValueError("tensor has unknown dtype %r" % (tensor.dtype,))


# --------------------------------------------------------------------------------------------------------------
# Results.

AttentionResult = collections.namedtuple(
    "AttentionResult", ["output", "attention_weights", "backend", "queue_us", "compute_us", "lse", "head_stats",
                        "row_stats"], defaults=(None, None, None))
AttentionResult.__doc__ = """Result of an attention call: output ndarray, attention_weights ndarray [B, H, Tq, Tk] or
None, the backend that ran ("cpu", "reference", "cuda") and the server's queue / compute time in microseconds; when
asked for (else None): lse float32 [B, H, Tq], head_stats a dict of float32 [B, H] arrays and row_stats one of
[B, H, Tq] arrays, keyed by HeadStats' field names (see HEAD_STAT_FIELDS)."""

# HeadStats' fields, in the proto's order. contribution is filled for MultiHeadAttention and layer sessions only.
HEAD_STAT_FIELDS = ("entropy", "normalized_entropy", "confidence", "distance", "sink_mass", "contribution")


def _head_stats(stats, shape):
    """Dict of float32 arrays of a HeadStats message, each field's values reshaped to `shape`; a field the server
    left empty (contribution of ScaledDotProductAttention and head sessions) is left out."""
    out = {}
    for name in HEAD_STAT_FIELDS:
        values = getattr(stats, name)
        if len(values):
            out[name] = np.asarray(values, dtype=np.float32).reshape(shape)
    return out


def _softmax_stats(resp, batch_shape, rows):
    """(lse, head_stats, row_stats) of a response or ExtendResult: None for each one not in it. batch_shape is
    (B,) or () (an Extend item); rows is Tq or n. The head count is what the values' count says."""
    lse = from_tensor(resp.lse) if resp.HasField("lse") else None
    head_stats = row_stats = None
    if resp.HasField("head_stats"):
        count = len(resp.head_stats.entropy)
        per_item = int(np.prod(batch_shape, dtype=np.int64))
        heads = count // per_item if per_item else 0
        head_stats = _head_stats(resp.head_stats, tuple(batch_shape) + (heads,))
    if resp.HasField("row_stats"):
        count = len(resp.row_stats.entropy)
        per = int(np.prod(batch_shape, dtype=np.int64)) * int(rows)
        heads = count // per if per else 0
        row_stats = _head_stats(resp.row_stats, tuple(batch_shape) + (heads, int(rows)))
    return lse, head_stats, row_stats


def merge_attention(outputs, lses):
    """Merges attention outputs computed over disjoint sets of keys (shards of one context) into the output over
    all of them, as FlashAttention's split-KV and ring attention do: lse = logsumexp_s lse_s and
    out = sum_s exp(lse_s - lse) out_s, exact up to rounding.

    outputs: per shard an array laid out [..., T, H, d_k] (head-packed: ScaledDotProductAttention's [B, Tq, H, d_k],
    a head session's ExtendResult.output [n, H, d_k]); lses: per shard its lse [..., H, T] (the results' lse, asked
    for with return_lse=True). A layer's output [.., d_model] has already mixed the heads and cannot be merged so.
    Computes in float64; returns (out float32 [..., T, H, d_k], lse float32 [..., H, T]). A row whose lse is -inf in
    every shard (no visible key anywhere) comes out zero with lse -inf, never NaN.
    """
    outputs = [np.asarray(o, dtype=np.float64) for o in outputs]
    lses = [np.asarray(x, dtype=np.float64) for x in lses]
    if not outputs or len(outputs) != len(lses):
        raise ValueError("merge_attention needs one lse per output and at least one of each (got %d outputs, %d lses)"
                         % (len(outputs), len(lses)))
    shape = outputs[0].shape
    if len(shape) < 3:
        raise ValueError("outputs must be laid out [..., T, H, d_k]; got shape %s" % (shape,))
    lse_shape = shape[:-3] + (shape[-2], shape[-3])
    for i, (o, x) in enumerate(zip(outputs, lses)):
        if o.shape != shape:
            raise ValueError("outputs[%d] has shape %s, outputs[0] %s" % (i, o.shape, shape))
        if x.shape != lse_shape:
            raise ValueError("lses[%d] has shape %s; outputs of shape %s need [..., H, T] = %s"
                             % (i, x.shape, shape, lse_shape))
    stacked = np.stack(lses)  # [S, ..., H, T]
    peak = stacked.max(axis=0)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        lse = peak + np.log(np.exp(stacked - peak).sum(axis=0))
    seen = np.isfinite(lse)
    out = np.zeros(shape, dtype=np.float64)
    for o, x in zip(outputs, lses):
        with np.errstate(invalid="ignore"):
            w = np.where(seen, np.exp(x - lse), 0.0)  # -inf - -inf is NaN where no shard sees a key
        w = np.swapaxes(w, -1, -2)[..., None]  # [..., T, H, 1]
        out += np.where(w > 0.0, w * o, 0.0)  # a shard's unseen rows add nothing
    return out.astype(np.float32), lse.astype(np.float32)


LayerInfo = collections.namedtuple(
    "LayerInfo", ["name", "num_heads", "num_kv_heads", "head_dim", "causal", "scale", "d_model", "d_kv_in",
                  "d_v_in", "has_bias", "source", "size_bytes"])
LayerInfo.__doc__ = "A registered layer as described by the server (head config normalised)."

_BACKENDS = {"auto": 0, "cpu": 1, "cuda": 2, "reference": 3}
_WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


def _backend_enum(backend):
    if backend is None:
        return 0
    if isinstance(backend, (int, np.integer)) and not isinstance(backend, bool):
        return int(backend)
    key = str(backend).lower()
    if key not in _BACKENDS:
        raise ValueError("unknown backend %r; use one of %s" % (backend, ", ".join(_BACKENDS)))
    return _BACKENDS[key]


def _result(resp, regions):
    """AttentionResult of a response; an output in shared memory is read from `regions` (name -> region)."""
    if resp.output.HasField("shared_memory"):
        region = regions.get(resp.output.shared_memory.region)
        if region is None:
            raise ValueError("the output lies in shared-memory region %r, which this client did not register"
                             % resp.output.shared_memory.region)
        output = region.read(resp.output)
    else:
        output = from_tensor(resp.output)
    rows = int(resp.output.shape[1]) if len(resp.output.shape) >= 2 else 0
    batch = (int(resp.output.shape[0]),) if len(resp.output.shape) >= 1 else (0,)
    lse, head_stats, row_stats = _softmax_stats(resp, batch, rows)
    return AttentionResult(
        output=output,
        attention_weights=from_tensor(resp.attention_weights) if resp.HasField("attention_weights") else None,
        backend=resp.backend,
        queue_us=int(resp.timing.queue_us),
        compute_us=int(resp.timing.compute_us),
        lse=lse, head_stats=head_stats, row_stats=row_stats,
    )


def _layer_info(info):
    h = info.heads
    return LayerInfo(info.name, h.num_heads, h.num_kv_heads, h.head_dim, h.causal, h.scale, int(info.d_model),
                     int(info.d_kv_in), int(info.d_v_in), info.has_bias, info.source, int(info.size_bytes))


def _to_dict(msg):
    """Plain dict of a protobuf message (defaults included, enums as names, nested messages as dicts)."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)

        def conv(v, field=field):
            if field.type == field.TYPE_MESSAGE:
                return _to_dict(v)
            if field.type == field.TYPE_ENUM:
                return field.enum_type.values_by_number[v].name if v in field.enum_type.values_by_number else v
            return v

        # protobuf 6 and later say is_repeated; FieldDescriptor.label is gone from 7.
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated:
            out[field.name] = [conv(v) for v in value]
        else:
            out[field.name] = conv(value)
    return out


def _pem(value):
    """PEM bytes from bytes, or from the file a str names; None stays None."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class MhaClient:
    """Blocking client for one mhaserve server.

    target: "host:port". timeout: seconds per call (None = no deadline). max_message_mb: send / receive limit of
    the channel, which should match the server's --max_message_mb. Use as a context manager or call close().
    Transport security (servers with --tls_cert): tls_ca (PEM bytes or a path) verifies the server, None with
    tls=True uses the default roots; tls_cert and tls_key (PEM bytes or paths) are this client's identity for
    mutual TLS; tls_server_name overrides the name checked in the server's certificate. token: a bearer token sent
    with every call (servers with --auth_tokens_file). max_extend_streams: Extend calls (MhaClient.extend,
    Session.extend) go over ExtendStream, a stream per session stepping (each with a sending thread of grpcio's),
    kept open between steps, up to this many; past them, where the server has none, and with 0, unary. A target
    "unix:/path" reaches a server's --listen_unix socket.
    All RPC errors are raised as grpc.RpcError (see the module docstring).
    """

    def __init__(self, target, timeout=30.0, max_message_mb=256, tls=False, tls_ca=None, tls_cert=None,
                 tls_key=None, tls_server_name=None, token=None, max_extend_streams=16):
        attention_pb2, attention_pb2_grpc, health_pb2, health_pb2_grpc = _stubs()
        self._pb = attention_pb2
        self._health_pb = health_pb2
        limit = int(max_message_mb * 1024 * 1024)
        self.target = target
        self.timeout = timeout
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        if tls or tls_ca is not None or tls_cert is not None:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key go together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert))
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        self._stub = attention_pb2_grpc.AttentionStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._regions = {}  # SharedMemoryRegion objects of this client by name
        self._streams = _ExtendStreams(self, int(max_extend_streams))

    def close(self):
        self._streams.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=10.0):
        """Blocks until the channel connects; raises grpc.FutureTimeoutError after timeout seconds."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    # ---- helpers -------------------------------------------------------------------------------------------

    def _heads(self, num_heads, num_kv_heads, head_dim, causal, scale, rope_theta=0.0, rope_dim=0,
               rope_interleaved=False, rope_scaling=None):
        heads = self._pb.HeadConfig(num_heads=int(num_heads), num_kv_heads=int(num_kv_heads),
                                    head_dim=int(head_dim), causal=bool(causal), scale=float(scale),
                                    rope_theta=float(rope_theta), rope_dim=int(rope_dim),
                                    rope_interleaved=bool(rope_interleaved))
        if rope_scaling is not None:
            heads.rope_scaling.CopyFrom(rope_scaling_message(rope_scaling))
        return heads

    def _weights(self, weights, wire_dtype):
        if isinstance(weights, self._pb.AttentionWeights):
            return weights
        unknown = set(weights) - set(_WEIGHT_NAMES)
        if unknown:
            raise ValueError("unknown weight names %s; expected %s" % (sorted(unknown), ", ".join(_WEIGHT_NAMES)))
        msg = self._pb.AttentionWeights()
        for name in _WEIGHT_NAMES:
            if weights.get(name) is not None:
                getattr(msg, name).CopyFrom(to_tensor(weights[name], wire_dtype))
        return msg

    # ---- attention ----------------------------------------------------------------------------------------

    def multi_head_attention(self, query, key=None, value=None, layer=None, weights=None, num_heads=0,
                             num_kv_heads=0, head_dim=0, causal=False, scale=0.0, key_lengths=None,
                             attn_mask=None, head_mask=None, return_weights=False, output_dtype=None,
                             backend="auto", wire_dtype=None, output_shared_memory=None, rope_theta=0.0,
                             rope_dim=0, rope_interleaved=False, return_lse=False, return_head_stats=False,
                             return_row_stats=False, sink_tokens=0, rope_scaling=None):
        """Full attention layer: project, attend, concatenate heads, project out.

        query [B, Tq, d_model]; key [B, Tk, d_kv_in] (None: self-attention); value [B, Tk, d_v_in] (None: key).
        Exactly one of layer (a registered name) or weights (dict w_q, w_k, w_v, w_o and optional b_q, b_k, b_v,
        b_o of arrays in the Y = X W convention, W [in, out]) must be given. With weights, num_heads is required.
        num_kv_heads 0 = num_heads, head_dim 0 = d_model / num_heads, scale 0 = 1/sqrt(head_dim).
        key_lengths: B ints; attn_mask: [Tq, Tk] or [B, Tq, Tk], additive when floating point (-inf masks), boolean
        when numpy bool (True attends, as in torch's scaled_dot_product_attention); head_mask: H floats.
        output_dtype: None (query's), 'fp32', 'fp16' or 'bf16'. backend: 'auto', 'cpu', 'cuda' or 'reference'.
        wire_dtype: send every float tensor as this dtype instead of the arrays' own (see to_tensor).
        output_shared_memory: SharedMemoryRegion.output_at(offset) to have the output written there.
        rope_theta, rope_dim, rope_interleaved: rotary position embeddings (HeadConfig; a layer's own apply anyway).
        rope_scaling: scaled RoPE frequencies, a transformers rope_scaling dict (see rope_scaling_message).
        return_lse, return_head_stats, return_row_stats, sink_tokens: softmax statistics (module docstring): the
        result's lse [B, H, Tq], head_stats {field: [B, H]} with contribution, row_stats {field: [B, H, Tq]}.
        Returns AttentionResult.
        """
        rope = (rope_theta, rope_dim, rope_interleaved, rope_scaling)
        if (layer is None) == (weights is None):
            raise ValueError("give exactly one of layer or weights")
        req = self._pb.MultiHeadAttentionRequest(
            query=to_tensor(query, wire_dtype),
            return_attention_weights=bool(return_weights),
            output_dtype=_dtype_enum(output_dtype),
            backend=_backend_enum(backend),
        )
        if key is not None:
            req.key.CopyFrom(to_tensor(key, wire_dtype))
        if value is not None:
            req.value.CopyFrom(to_tensor(value, wire_dtype))
        if layer is not None:
            req.layer = layer
            if num_heads or num_kv_heads or head_dim or causal or scale or any(x is not None and x for x in rope):
                req.heads.CopyFrom(self._heads(num_heads, num_kv_heads, head_dim, causal, scale, *rope))
        else:
            req.inline_weights.CopyFrom(self._weights(weights, wire_dtype))
            req.heads.CopyFrom(self._heads(num_heads, num_kv_heads, head_dim, causal, scale, *rope))
        if key_lengths is not None:
            req.key_lengths.extend(int(x) for x in key_lengths)
        if attn_mask is not None:
            self._set_mask(req, attn_mask, wire_dtype)
        if head_mask is not None:
            req.head_mask.extend(float(x) for x in head_mask)
        if output_shared_memory is not None:
            req.output_shared_memory.CopyFrom(output_shared_memory)
        self._set_stats(req, return_lse, return_head_stats, return_row_stats, sink_tokens)
        return _result(self._call(self._stub.MultiHeadAttention, req), self._regions)

    def _call(self, rpc, req, session_id=None):
        """One unary call with the client's deadline and token; a session call also sends its session's id as
        mha-session-id metadata, for proxies that route a session's calls to the replica holding it."""
        metadata = self._metadata + ((("mha-session-id", session_id),) if session_id else ())
        return rpc(req, timeout=self.timeout, metadata=metadata)

    @staticmethod
    def _set_stats(req, return_lse, return_head_stats, return_row_stats, sink_tokens):
        """The softmax statistics' request fields, passed on as given (the server checks them)."""
        req.return_lse = bool(return_lse)
        req.return_head_stats = bool(return_head_stats)
        req.return_row_stats = bool(return_row_stats)
        req.sink_tokens = int(sink_tokens)

    def _set_mask(self, req, attn_mask, wire_dtype):
        """A numpy bool mask goes as MASK_KEEP (1 attends, 0 masked); anything else as an additive mask."""
        mask = np.asarray(attn_mask)
        if mask.dtype == np.bool_:
            req.attn_mask.CopyFrom(to_tensor(mask.astype(np.float32), wire_dtype))
            req.attn_mask_type = self._pb.MASK_KEEP
        else:
            req.attn_mask.CopyFrom(to_tensor(mask, wire_dtype))

    def scaled_dot_product_attention(self, q, k, v, causal=False, scale=0.0, key_lengths=None, attn_mask=None,
                                     return_weights=False, output_dtype=None, backend="auto", wire_dtype=None,
                                     output_shared_memory=None, rope_theta=0.0, rope_dim=0, rope_interleaved=False,
                                     return_lse=False, return_head_stats=False, return_row_stats=False,
                                     sink_tokens=0, rope_scaling=None):
        """Attention core on head-packed tensors: q [B, Tq, H, d_k], k and v [B, Tk, Hkv, d_k] (Hkv divides H).

        rope_theta, rope_dim, rope_interleaved rotate q and k first (HeadConfig's RoPE); rope_scaling scales its
        frequencies (a transformers rope_scaling dict, see rope_scaling_message).
        return_lse, return_head_stats, return_row_stats, sink_tokens: softmax statistics, as in multi_head_attention
        (no contribution: there is no W_O). Outputs over disjoint key sets merge with merge_attention.
        Returns AttentionResult with output [B, Tq, H, d_k] and, if asked, weights [B, H, Tq, Tk].
        """
        req = self._pb.ScaledDotProductAttentionRequest(
            q=to_tensor(q, wire_dtype),
            k=to_tensor(k, wire_dtype),
            v=to_tensor(v, wire_dtype),
            heads=self._heads(0, 0, 0, causal, scale, rope_theta, rope_dim, rope_interleaved, rope_scaling),
            return_attention_weights=bool(return_weights),
            output_dtype=_dtype_enum(output_dtype),
            backend=_backend_enum(backend),
        )
        if key_lengths is not None:
            req.key_lengths.extend(int(x) for x in key_lengths)
        if attn_mask is not None:
            self._set_mask(req, attn_mask, wire_dtype)
        if output_shared_memory is not None:
            req.output_shared_memory.CopyFrom(output_shared_memory)
        self._set_stats(req, return_lse, return_head_stats, return_row_stats, sink_tokens)
        return _result(self._call(self._stub.ScaledDotProductAttention, req), self._regions)

    # ---- layers -------------------------------------------------------------------------------------------

    def load_layer(self, name, weights, num_heads, num_kv_heads=0, head_dim=0, causal=False, scale=0.0,
                   wire_dtype=None, rope_theta=0.0, rope_dim=0, rope_interleaved=False, rope_scaling=None):
        """Registers weights (dict as in multi_head_attention) under name, with the layer's RoPE if any (and its
        rope_scaling, a transformers dict). Returns the server's LayerInfo."""
        req = self._pb.LoadLayerRequest(name=name, weights=self._weights(weights, wire_dtype),
                                        heads=self._heads(num_heads, num_kv_heads, head_dim, causal, scale,
                                                          rope_theta, rope_dim, rope_interleaved, rope_scaling))
        return _layer_info(self._call(self._stub.LoadLayer, req).layer)

    def unload_layer(self, name):
        self._call(self._stub.UnloadLayer, self._pb.UnloadLayerRequest(name=name))

    def list_layers(self):
        """List of LayerInfo for every registered layer (the built-in "demo" included)."""
        resp = self._call(self._stub.ListLayers, self._pb.ListLayersRequest())
        return [_layer_info(info) for info in resp.layers]

    # ---- shared memory ------------------------------------------------------------------------------------

    def register_shared_memory(self, name, key, byte_size):
        """RegisterSharedMemory: the server maps byte_size bytes of the POSIX shared-memory object `key` ("/mha_...")
        as region `name`. SharedMemoryRegion does this for an object it creates."""
        self._call(self._stub.RegisterSharedMemory,
                   self._pb.RegisterSharedMemoryRequest(name=name, key=key, byte_size=int(byte_size)))

    def unregister_shared_memory(self, name=""):
        """UnregisterSharedMemory: drops region `name` on the server ("" drops every region)."""
        self._call(self._stub.UnregisterSharedMemory, self._pb.UnregisterSharedMemoryRequest(name=name))

    def shared_memory_status(self, name=""):
        """GetSharedMemoryStatus: the registered regions as dicts (name, key, byte_size, intact), ordered by name;
        `name` asks for that one region (grpc.StatusCode.NOT_FOUND when it is not registered)."""
        resp = self._call(self._stub.GetSharedMemoryStatus, self._pb.GetSharedMemoryStatusRequest(name=name))
        return [_to_dict(region) for region in resp.regions]

    # ---- sessions -----------------------------------------------------------------------------------------

    def create_session(self, layers=None, num_heads=0, num_kv_heads=0, head_dim=0, scale=0.0, rope_theta=0.0,
                       rope_dim=0, rope_interleaved=False, num_layers=0, cache_dtype=None, max_tokens=0,
                       idle_timeout_s=0, session_id="", recover=False, rope_scaling=None, layer_heads=None,
                       prefix_keys=None, cache_salt=""):
        """CreateSession: a KV cache the server keeps. layers: names of registered layers (a layer session: x in,
        the layer's output out, one cache per layer); otherwise a head session of num_heads / num_kv_heads /
        head_dim (q, k, v in, the heads out) with num_layers caches (0 = 1). cache_dtype: None ('fp32'), 'fp16',
        'bf16', or the 8-bit 'int8', 'fp8_e4m3', 'fp8_e5m2' (a byte per element, scales computed by the server).
        rope_scaling: a head session's scaled RoPE frequencies (a transformers rope_scaling dict).
        layer_heads: a head session's configuration per cache, num_layers dicts of scale, rope_theta, rope_dim,
        rope_interleaved and rope_scaling (each a whole configuration: what a dict leaves out takes HeadConfig's
        default), for models whose scale or RoPE differs by layer.
        max_tokens 0 / idle_timeout_s 0: the server's defaults. session_id "": the server picks one.
        recover: True (or a Recovery) records what the session is fed and rebuilds it when it is lost (see
        Recovery); choose session_id when a proxy routes by it. prefix_keys (the module's prefix_keys of the
        prompt's token ids) attaches the blocks the server holds under them: the Session's attached_tokens says how
        many tokens, and the caller extends from there; the blocks it fills become findable under the rest.
        cache_salt: part of the keys' scope. Returns a Session."""
        if recover and prefix_keys:
            raise ValueError("recover records what this client sends, and attached prefix tokens are never sent: "
                             "use one or the other")
        req = self._pb.CreateSessionRequest(session_id=session_id, num_layers=int(num_layers),
                                            cache_dtype=_cache_dtype_enum(cache_dtype), max_tokens=int(max_tokens),
                                            idle_timeout_s=int(idle_timeout_s), cache_salt=cache_salt)
        req.prefix_keys.extend([bytes(k) for k in prefix_keys or []])
        if layers:
            req.layers.extend(list(layers))
        else:
            req.heads.CopyFrom(self._heads(num_heads, num_kv_heads, head_dim, False, scale, rope_theta, rope_dim,
                                           rope_interleaved, rope_scaling))
            for entry in layer_heads or []:
                unknown = set(entry) - {"scale", "rope_theta", "rope_dim", "rope_interleaved", "rope_scaling"}
                if unknown:
                    raise ValueError("layer_heads entries take scale, rope_theta, rope_dim, rope_interleaved and "
                                     "rope_scaling; got %s" % sorted(unknown))
                req.layer_heads.add().CopyFrom(self._heads(0, 0, 0, False, entry.get("scale", 0.0),
                                                           entry.get("rope_theta", 0.0), entry.get("rope_dim", 0),
                                                           entry.get("rope_interleaved", False),
                                                           entry.get("rope_scaling")))
        info = self._call(self._stub.CreateSession, req, session_id or None).session
        if not recover:
            return Session(self, info)
        recovery = recover if isinstance(recover, Recovery) else Recovery()
        req.session_id = info.session_id
        return Session(self, info, _SessionRecord(req, recovery.max_record_bytes), recovery)

    def extend(self, items, layer_index=0, return_weights=False, output_dtype="fp32", backend="auto",
               wire_dtype=None, return_lse=False, return_head_stats=False, return_row_stats=False, sink_tokens=0):
        """Extend: appends tokens to several sessions' caches of one layer in one call and attends.

        items: a list of dicts, each {"session": Session or id, "x": [n, d_model]} for a layer session or
        {"session": ..., "q": [n, H, d_k], "k": [n, Hkv, d_k], "v": [n, Hkv, d_k]} for a head session, optionally
        "expected_length" (the cache's length before the call, checked) and "append": False (the tokens attend to
        the cache without joining it; k and v may then be left out of a head session's item: a shard of a context
        spread over sessions, merged with merge_attention), "prefix_keys" (ExtendItem.prefix_keys). return_lse,
        return_head_stats, return_row_stats, sink_tokens: softmax statistics per item (lse [H, n], head_stats
        {field: [H]}, row_stats {field: [H, n]}).
        Returns a list of ExtendResult in order.

        Items of recording sessions (create_session(recover=...)) join their records when the call succeeds; when it
        fails as a lost session does and every item's session records, they are rebuilt and the call sent again.
        """
        req = self._pb.ExtendRequest(layer_index=int(layer_index), return_attention_weights=bool(return_weights),
                                     output_dtype=_dtype_enum(output_dtype), backend=_backend_enum(backend))
        self._set_stats(req, return_lse, return_head_stats, return_row_stats, sink_tokens)
        sessions = []
        for entry in items:
            session = entry["session"]
            session_id = session.id if isinstance(session, Session) else str(session)
            item = req.items.add(session_id=session_id)
            for name in ("x", "q", "k", "v"):
                if entry.get(name) is not None:
                    getattr(item, name).CopyFrom(to_tensor(entry[name], wire_dtype))
            if entry.get("expected_length") is not None:
                item.expected_length = int(entry["expected_length"])
            if entry.get("append") is not None:
                item.append = bool(entry["append"])
            item.prefix_keys.extend([bytes(k) for k in entry.get("prefix_keys") or []])
            sessions.append(session if isinstance(session, Session) else None)
        recording = [session for session in sessions if session is not None and session._record is not None]

        def call():
            return self._streams.extend(req, req.items[0].session_id if req.items else None)

        resp = self._recovering(call, recording) if recording and len(recording) == len(sessions) else call()
        for session, item in zip(sessions, req.items):
            if session is not None and session._record is not None:
                session._record.append(int(layer_index), item, req.backend)
        results = []
        for session, result in zip(sessions, resp.results):
            if session is not None:
                session._lengths[int(layer_index)] = int(result.length)
            lse, head_stats, row_stats = _softmax_stats(
                result, (), int(result.output.shape[0]) if len(result.output.shape) else 0)
            results.append(ExtendResult(
                output=from_tensor(result.output),
                attention_weights=from_tensor(result.attention_weights) if result.HasField("attention_weights")
                else None,
                length=int(result.length), backend=resp.backend,
                lse=lse, head_stats=head_stats, row_stats=row_stats))
        return results

    def _recovering(self, call, sessions):
        """call() on recording sessions; after a lost-session error (_LOST) the sessions are rebuilt and call() runs
        again, as their Recovery says (the first session's). Other errors, and the last when the attempts run out,
        are raised as they came."""
        try:
            return call()
        except grpc.RpcError as e:
            error = e
        recovery = sessions[0]._recovery
        backoff = recovery.backoff_s
        for _ in range(recovery.attempts):
            if error.code() not in _LOST or not all(s._record.recoverable for s in sessions):
                break
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                time.sleep(backoff)
                backoff = min(2 * backoff, recovery.max_backoff_s)
                try:
                    grpc.channel_ready_future(self._channel).result(timeout=recovery.reconnect_timeout_s)
                except grpc.FutureTimeoutError:
                    pass
            try:
                for session in sessions:
                    self._rebuild(session, error.code(), recovery.chunk_tokens)
                return call()
            except grpc.RpcError as e:
                error = e
        raise error

    def _rebuild(self, session, failure, chunk_tokens):
        """CreateSession under the session's id, then its record replayed. A session still there (ALREADY_EXISTS)
        is kept after NOT_FOUND (a failed call changes no session), closed and rebuilt after UNAVAILABLE (the call
        may have reached it). A replay that fails closes the session, so that it is never left half rebuilt."""
        record = session._record
        try:
            self._call(self._stub.CreateSession, record.create, session.id)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            if failure == grpc.StatusCode.NOT_FOUND:
                return
            try:
                self._call(self._stub.CloseSession, self._pb.CloseSessionRequest(session_id=session.id), session.id)
            except grpc.RpcError as closed:
                if closed.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            self._call(self._stub.CreateSession, record.create, session.id)
        try:
            for req in record.replay_requests(chunk_tokens, self._pb):
                self._call(self._stub.Extend, req, session.id)
        except grpc.RpcError:
            try:
                self._call(self._stub.CloseSession, self._pb.CloseSessionRequest(session_id=session.id), session.id)
            except grpc.RpcError:
                pass
            raise
        session.recoveries += 1

    def list_sessions(self):
        """ListSessions: this caller's sessions (every one for an admin token) as dicts of SessionInfo."""
        return [_to_dict(info) for info in self._call(self._stub.ListSessions, self._pb.ListSessionsRequest()).sessions]

    # ---- server -------------------------------------------------------------------------------------------

    def server_info(self):
        """GetServerInfo as a plain dict: version, backends (list of dicts), default_backend, limits (dict)."""
        return _to_dict(self._call(self._stub.GetServerInfo, self._pb.GetServerInfoRequest()))

    def health(self, service=""):
        """grpc.health.v1 Check: the status name, e.g. "SERVING" (service "" = the whole server)."""
        resp = self._call(self._health.Check, self._health_pb.HealthCheckRequest(service=service))
        return self._health_pb.HealthCheckResponse.ServingStatus.Name(resp.status)


class _ExtendStream:
    """One ExtendStream call: each step's request goes through a queue that grpcio's sending thread reads, and its
    answer is the next response. Opened with a deadline of twice the client's timeout and replaced between steps once
    less than one timeout is left, so that every step has the timeout at least. A failed step ends the stream (the
    server's contract). One step at a time."""

    def __init__(self, client, session_id):
        self._requests = queue.SimpleQueue()
        timeout = client.timeout
        self.expires = math.inf if timeout is None else time.monotonic() + timeout
        metadata = client._metadata + ((("mha-session-id", session_id),) if session_id else ())
        self._responses = client._stub.ExtendStream(iter(self._requests.get, None),
                                                    timeout=None if timeout is None else 2 * timeout,
                                                    metadata=metadata)

    def ended(self):
        return self._responses.done()

    def step(self, req):
        self._requests.put(req)
        try:
            return next(self._responses)
        except StopIteration:
            raise RuntimeError("the server ended the stream without answering the step") from None

    def close(self):
        self._requests.put(None)  # lets the sending thread end
        self._responses.cancel()


class _StreamReset(grpc.RpcError):
    """A stream reset on its way (RST_STREAM, which grpcio reports as INTERNAL "Received RST_STREAM with error code
    N"): cut by a hop, since the server never resets a stream (a proxy whose upstream died resets the streams it
    carried, where a unary call would have got UNAVAILABLE). Raised as UNAVAILABLE, as the unary call's error would
    be, for retries and session recovery alike (the step may or may not have reached the server)."""

    def __init__(self, reset):
        super().__init__()
        self._details = "the stream was reset on its way to the server (%s)" % reset.details()

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def __str__(self):
        return "StatusCode.UNAVAILABLE: " + self._details


class _ExtendStreams:
    """A client's ExtendStream calls, shared by its threads and keyed by the session a step names first (a routing
    proxy sends a whole stream where its mha-session-id hashes, so a stream carries its own session's steps). A step
    takes an idle stream of its session, or opens one while fewer than max_streams are open, or takes the place of
    one idle for STALE_S (a session no longer stepping); else, and for good once the server shows it has no
    ExtendStream (UNIMPLEMENTED before any metadata), it goes unary. Thread-safe."""

    STALE_S = 1.0

    def __init__(self, client, max_streams):
        self._client = client
        self._max = max_streams
        self._lock = threading.Lock()
        self._idle = {}  # session id -> [(stream, idle since)]
        self._opened = 0
        self.streaming = max_streams > 0

    def extend(self, req, session_id):
        client = self._client
        stream, stale = self._take(session_id)
        if stale is not None:
            stale.close()
        if stream is None:
            return client._call(client._stub.Extend, req, session_id)
        try:
            # A stream that ended while idle (a server restarted, a connection lost) is replaced before the step,
            # which it would fail unsent.
            if stream is True or stream.expires < time.monotonic() or stream.ended():
                if stream is not True:
                    stream.close()
                stream = None
                stream = _ExtendStream(client, session_id)
            resp = stream.step(req)
        except BaseException as e:  # the stream is done with, whatever ended the step: its place is freed
            if stream is not None:
                stream.close()
            with self._lock:
                self._opened -= 1
            if not isinstance(e, grpc.RpcError):
                raise
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and not e.initial_metadata():
                self.streaming = False
                return client._call(client._stub.Extend, req, session_id)
            if e.code() == grpc.StatusCode.INTERNAL and (e.details() or "").startswith("Received RST_STREAM"):
                raise _StreamReset(e) from e
            raise
        with self._lock:
            self._idle.setdefault(session_id, []).append((stream, time.monotonic()))
        return resp

    def _take(self, session_id):
        """(stream, stale): the session's idle stream, True where one may be opened, or None (go unary); and a stale
        stream whose place it takes, to close, or None."""
        if not self.streaming:
            return None, None
        with self._lock:
            mine = self._idle.get(session_id)
            if mine:
                stream = mine.pop()[0]
                if not mine:
                    del self._idle[session_id]
                return stream, None
            if self._opened < self._max:
                self._opened += 1
                return True, None
            oldest = min(self._idle, key=lambda key: self._idle[key][0][1], default=None)
            if oldest is None or time.monotonic() - self._idle[oldest][0][1] < self.STALE_S:
                return None, None
            stale = self._idle[oldest].pop(0)[0]
            if not self._idle[oldest]:
                del self._idle[oldest]
            return True, stale

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, {}
            self._max = 0
        for streams in idle.values():
            for stream, _ in streams:
                stream.close()


ExtendResult = collections.namedtuple("ExtendResult", ["output", "attention_weights", "length", "backend", "lse",
                                                     "head_stats", "row_stats"], defaults=(None, None, None))
ExtendResult.__doc__ = """One session's part of an Extend: output ([n, d_model] for a layer session, [n, H, d_k] for a
head session), attention_weights [H, n, length] or None, the cache's length after the call, the backend that ran;
when asked for (else None): lse float32 [H, n], head_stats {field: float32 [H]} (contribution for layer sessions
only) and row_stats {field: float32 [H, n]}."""


Recovery = collections.namedtuple(
    "Recovery", ["attempts", "backoff_s", "max_backoff_s", "reconnect_timeout_s", "chunk_tokens", "max_record_bytes"],
    defaults=(5, 0.1, 2.0, 10.0, 1024, None))
Recovery.__doc__ = """How a recording session recovers when lost (create_session(recover=Recovery(...)); True means
these defaults). A session call that fails with NOT_FOUND (the server does not hold the session: it restarted, or
evicted or closed it) or UNAVAILABLE (no server answered: a replica died, a server is restarting) re-creates the
session under its id and configuration (a proxy hashing on mha-session-id sends it where the hash now points),
replays what it was fed per cache in the original order, with append, and sends the call again. A head session's
k and v are replayed chunk_tokens tokens per Extend, with zeros for q; a layer session's x call by call, with the
rows each call had and the backend it asked for, since the server projects them again. The outputs are then exactly
what they would have been; for a layer session that shared calls with other sessions (MhaClient.extend with several
items), within rounding: its rows were projected together with theirs (the CPU backend's rounding depends on the
row count).

attempts: rebuilds tried per failed call. After UNAVAILABLE the client first waits backoff_s (doubling up to
max_backoff_s), then up to reconnect_timeout_s for the channel to connect. max_record_bytes: the bytes of tensors
the record may keep (None: no limit); past them it is dropped, and the session's errors come back as they are. A
session still open under its id (ALREADY_EXISTS) is kept after NOT_FOUND (a failed call changes no session), closed
and rebuilt after UNAVAILABLE (the call may have reached it)."""

_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


class _SessionRecord:
    """What one session was fed, enough to rebuild its caches: its CreateSessionRequest (with its id) and per cache
    the tensors that joined it, in order, as they travelled: x (layer session) or k and v (head session). A head
    session's runs of calls alike (the same backend, dtypes and row shapes) share one segment, whose bytes are
    joined when needed; a layer session's calls keep a segment each, replayed with the rows they had."""

    def __init__(self, create, max_bytes):
        self.create = create
        self.max_bytes = max_bytes
        self.recoverable = True
        self.bytes = 0
        self._names = ("x",) if len(create.layers) else ("k", "v")
        self._caches = {}  # layer_index -> [segment]; segment: dict(backend, headers, pieces, tokens)

    def lengths(self):
        """Tokens recorded per cache, {layer_index: tokens}."""
        return {layer: sum(seg["tokens"] for seg in segs) for layer, segs in self._caches.items()}

    def _drop(self):
        self.recoverable = False
        self._caches = {}
        self.bytes = 0

    def append(self, layer_index, item, backend):
        """The ExtendItem `item` joined cache layer_index (its call asked for `backend` and succeeded)."""
        if not self.recoverable or (item.HasField("append") and not item.append):
            return
        tensors = [getattr(item, name) for name in self._names]
        rows = tensors[0].shape[0] if len(tensors[0].shape) else 0
        if any(t.HasField("shared_memory") or len(t.shape) == 0 or t.shape[0] != rows for t in tensors) or rows < 1:
            return self._drop()
        added = sum(len(t.data) for t in tensors)
        if self.max_bytes is not None and self.bytes + added > self.max_bytes:
            return self._drop()
        self.bytes += added
        headers = [(t.dtype, tuple(t.shape[1:])) for t in tensors]
        segments = self._caches.setdefault(layer_index, [])
        # A layer session's calls stay apart: its keys and values are projections of x, recomputed on replay, and a
        # projection's rounding may depend on its row count (the CPU backend's one-row path differs by an ulp).
        if (self._names == ("x",) or not segments or segments[-1]["backend"] != backend
                or segments[-1]["headers"] != headers):
            segments.append(dict(backend=backend, headers=headers, pieces=[[] for _ in tensors], tokens=0))
        last = segments[-1]
        for pieces, t in zip(last["pieces"], tensors):
            pieces.append(t.data)
        last["tokens"] += rows

    @staticmethod
    def _joined(segment):
        """The segment's bytes per tensor, joined into one piece each."""
        segment["pieces"] = [[b"".join(pieces)] for pieces in segment["pieces"]]
        return [pieces[0] for pieces in segment["pieces"]]

    def truncate(self, length):
        """Every cache cut to at most `length` tokens, as TruncateSession does."""
        for layer, segments in self._caches.items():
            kept, out = 0, []
            for segment in segments:
                if kept >= length:
                    self.bytes -= sum(len(b) for b in self._joined(segment))
                    continue
                keep = min(segment["tokens"], length - kept)
                if keep < segment["tokens"]:
                    datas = self._joined(segment)
                    cut = [d[:len(d) // segment["tokens"] * keep] for d in datas]
                    self.bytes -= sum(len(d) - len(c) for d, c in zip(datas, cut))
                    segment["pieces"] = [[c] for c in cut]
                    segment["tokens"] = keep
                kept += keep
                out.append(segment)
            self._caches[layer] = out

    def fork(self, new_id):
        """The record of a fork named new_id: the same tokens (their bytes shared, never changed in place)."""
        create = type(self.create)()
        create.CopyFrom(self.create)
        create.session_id = new_id
        fork = _SessionRecord(create, self.max_bytes)
        fork.recoverable, fork.bytes = self.recoverable, self.bytes
        fork._caches = {layer: [dict(seg, pieces=[list(p) for p in seg["pieces"]]) for seg in segments]
                        for layer, segments in self._caches.items()}
        return fork

    def replay_requests(self, chunk_tokens, pb):
        """The ExtendRequests that rebuild a freshly created session: per cache, in order, per segment at most
        chunk_tokens tokens each (one more rather than a one-row tail), append with expected_length at the chunk's
        first position; outputs asked for as bf16 (dropped)."""
        chunk_tokens = max(int(chunk_tokens), 1)
        heads = self.create.heads.num_heads
        for layer, segments in sorted(self._caches.items()):
            position = 0
            for segment in segments:
                datas = self._joined(segment)
                n = segment["tokens"]
                begin = 0
                while begin < n:
                    end = min(n, begin + chunk_tokens)
                    end = n if n - end == 1 else end
                    item = pb.ExtendItem(session_id=self.create.session_id, expected_length=position + begin,
                                         append=True)
                    for name, data, (dtype, rest) in zip(self._names, datas, segment["headers"]):
                        row = len(data) // n
                        getattr(item, name).CopyFrom(pb.Tensor(shape=[end - begin, *rest], dtype=dtype,
                                                               data=data[begin * row:end * row]))
                    if self._names == ("k", "v"):
                        # q [n, H, d_k] of zeros (all-zero bytes in every dtype): a head session's call needs one.
                        dtype, rest = segment["headers"][0]
                        size = len(datas[0]) // n // int(np.prod(rest, dtype=np.int64))
                        item.q.CopyFrom(pb.Tensor(shape=[end - begin, heads, rest[-1]], dtype=dtype,
                                                  data=bytes((end - begin) * heads * rest[-1] * size)))
                    yield pb.ExtendRequest(layer_index=layer, items=[item], backend=segment["backend"],
                                           output_dtype=3)
                    begin = end
                position += n


class _ClosedOnExit:
    """`with` closes the object (its close()); a server that is gone by then is no error."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except grpc.RpcError:
            pass


class Session(_ClosedOnExit):
    """A KV-cache session on the server (MhaClient.create_session): its id and the calls on it, each sending the id
    as mha-session-id metadata. Destroying the object does not close the session (idle sessions expire).

    A recording session (create_session(recover=True) or a Recovery) keeps what it was fed and rebuilds itself when
    lost: extend, fork and truncate then recover as Recovery says, and `recoveries` counts the rebuilds."""

    def __init__(self, client, info, record=None, recovery=None):
        self._client = client
        self.id = info.session_id
        self.info = _to_dict(info)
        self._lengths = [int(n) for n in info.lengths]
        self.attached_tokens = int(info.attached_tokens)  # from the shared-prefix cache at creation
        self._record = record
        self._recovery = recovery
        self.recoveries = 0

    @property
    def recovering(self):
        """Whether the session records and can still be rebuilt (False past Recovery.max_record_bytes)."""
        return self._record is not None and self._record.recoverable

    def lengths(self):
        """Tokens held per cache (layer), as of this client's last call on the session."""
        return list(self._lengths)

    def extend(self, layer_index=0, x=None, q=None, k=None, v=None, expected_length=None, return_weights=False,
               output_dtype="fp32", backend="auto", wire_dtype=None, append=None, return_lse=False,
               return_head_stats=False, return_row_stats=False, sink_tokens=0, check_length=True, prefix_keys=None):
        """Appends tokens to cache `layer_index` and attends: x [n, d_model] for a layer session, q, k, v for a head
        session. append=False: the tokens attend to the cache without joining it (k, v may be None). The
        statistics' options as in MhaClient.extend. prefix_keys: the keys of the blocks the tokens land in, from
        block length // kv_block_tokens on (ExtendItem.prefix_keys). Returns ExtendResult.

        expected_length (the cache's length before the call, checked by the server) defaults to the length this
        handle last saw, so that a step retried after an error that hid its commit (DEADLINE_EXCEEDED can) fails
        with FAILED_PRECONDITION instead of appending twice; check_length=False sends none."""
        if expected_length is None and check_length and 0 <= int(layer_index) < len(self._lengths):
            expected_length = self._lengths[int(layer_index)]
        item = {"session": self, "x": x, "q": q, "k": k, "v": v, "expected_length": expected_length,
                "append": append, "prefix_keys": prefix_keys}
        return self._client.extend([item], layer_index, return_weights, output_dtype, backend, wire_dtype,
                                   return_lse, return_head_stats, return_row_stats, sink_tokens)[0]

    def fork(self, new_id=""):
        """A copy sharing every cached token (copy-on-write on the server). Returns the new Session; a recording
        session's fork records too, from the same tokens (its recoveries start at 0)."""
        pb = self._client._pb
        resp = self._call(self._client._stub.ForkSession,
                          pb.ForkSessionRequest(session_id=self.id, new_session_id=new_id))
        if self._record is None:
            return Session(self._client, resp.session)
        return Session(self._client, resp.session, self._record.fork(resp.session.session_id), self._recovery)

    def truncate(self, length):
        """Keeps at most `length` tokens of every cache."""
        pb = self._client._pb
        resp = self._call(self._client._stub.TruncateSession,
                          pb.TruncateSessionRequest(session_id=self.id, length=int(length)))
        if self._record is not None:
            self._record.truncate(int(length))
        self.info = _to_dict(resp.session)
        self._lengths = [int(n) for n in resp.session.lengths]

    def _call(self, rpc, req):
        """One call on this session, recovered when it records."""
        def call():
            return self._client._call(rpc, req, self.id)

        return self._client._recovering(call, [self]) if self._record is not None else call()

    def close(self):
        self._client._call(self._client._stub.CloseSession, self._client._pb.CloseSessionRequest(session_id=self.id),
                           self.id)


class ShardedSession(_ClosedOnExit):
    """One head session's context spread over several head sessions, one per client (a replica each): attention
    over a context too long for one server. Shard i holds a contiguous part of the tokens; a call fans out to every
    shard at once and the heads merge by their lse (merge_attention), so the outputs are the attention over the
    whole context. The tokens of prefill() go to the shards in order, each part's rows also attending to the
    earlier shards (append=False); extend() appends to the last shard and reads the others with append=False.
    The shards' heads have no RoPE: it would turn each cache's keys by that cache's own positions. Calls on one
    ShardedSession are not thread-safe."""

    def __init__(self, clients, num_heads, num_kv_heads=0, head_dim=0, scale=0.0, num_layers=0, cache_dtype=None,
                 max_tokens=0, idle_timeout_s=0):
        if not clients:
            raise ValueError("ShardedSession needs at least one client")
        self.shards = [c.create_session(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        scale=scale, num_layers=num_layers, cache_dtype=cache_dtype,
                                        max_tokens=max_tokens, idle_timeout_s=idle_timeout_s) for c in clients]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(clients))

    def lengths(self, layer_index=0):
        """Tokens each shard holds at cache `layer_index`, in shard order."""
        return [s.lengths()[layer_index] for s in self.shards]

    def _fan_out(self, calls):
        """Runs (session, kwargs) pairs at once; returns their ExtendResults in order."""
        futures = [self._pool.submit(lambda s=s, kw=kw: s.extend(**kw)) for s, kw in calls]
        return [f.result() for f in futures]

    def _step(self, owner, q, k, v, layer_index, output_dtype, backend):
        """q [n, H, d_k] attends to shards 0..owner-1 whole (append=False) and joins shard `owner` (k, v appended,
        causal among the new tokens); returns the merged (output [n, H, d_k], lse [H, n])."""
        calls = [(self.shards[i], dict(layer_index=layer_index, q=q, append=False, return_lse=True,
                                       output_dtype=output_dtype, backend=backend))
                 for i in range(owner) if self.shards[i].lengths()[layer_index] > 0]
        calls.append((self.shards[owner], dict(layer_index=layer_index, q=q, k=k, v=v, return_lse=True,
                                               output_dtype=output_dtype, backend=backend)))
        results = self._fan_out(calls)
        return merge_attention([r.output for r in results], [r.lse for r in results])

    def prefill(self, q, k, v, layer_index=0, backend="auto"):
        """n tokens (q [n, H, d_k], k and v [n, Hkv, d_k]) cut into contiguous parts, one per shard (sizes within
        one token of each other), each appended to its shard. Returns the merged (output [n, H, d_k], lse [H, n]),
        exactly one session's answer for those tokens."""
        n, count = len(q), len(self.shards)
        bounds = [n * i // count for i in range(count + 1)]
        outputs, lses = [], []
        for i in range(count):
            a, b = bounds[i], bounds[i + 1]
            if a == b:
                continue
            out, lse = self._step(i, q[a:b], k[a:b], v[a:b], layer_index, "fp32", backend)
            outputs.append(out)
            lses.append(lse)
        return np.concatenate(outputs), np.concatenate(lses, axis=-1)

    def extend(self, q, k, v, layer_index=0, backend="auto"):
        """Decode steps (or a chunk): the tokens join the last shard and attend to every shard. Returns the merged
        (output [n, H, d_k], lse [H, n])."""
        return self._step(len(self.shards) - 1, q, k, v, layer_index, "fp32", backend)

    def close(self):
        for s in self.shards:
            s.close()
        self._pool.shutdown(wait=False)


class SharedMemoryRegion:
    """A POSIX shared-memory object this process creates (key "/mha_py_<pid>_<n>") and registers with the client's
    server as `name`, for tensors that skip the socket (see the module docstring). Use as a context manager or call
    close(), which unregisters the region and removes the object. The caller must not change what put() wrote, nor
    expect the output's bytes, while a call that uses them is in flight."""

    _count = 0

    def __init__(self, client, name, byte_size):
        from multiprocessing import shared_memory
        import os

        SharedMemoryRegion._count += 1
        self._client = client
        self.name = name
        self.byte_size = int(byte_size)
        self._shm = shared_memory.SharedMemory(
            name="mha_py_%d_%d" % (os.getpid(), SharedMemoryRegion._count), create=True, size=self.byte_size)
        self.key = "/" + self._shm.name  # shm_open's name
        try:
            client.register_shared_memory(name, self.key, self.byte_size)
        except Exception:
            self._release()
            raise
        client._regions[name] = self

    def put(self, array, offset, dtype=None):
        """Writes `array` (encoded as to_tensor would, in `dtype`) at byte `offset` and returns a Tensor that
        references it there, for query, key, value, q, k or v."""
        tensor = to_tensor(array, dtype)
        data = tensor.data
        offset = int(offset)
        if offset < 0 or offset + len(data) > self.byte_size:
            raise ValueError("%d bytes at offset %d do not fit the region's %d" % (len(data), offset, self.byte_size))
        self._shm.buf[offset:offset + len(data)] = data
        ref = _stubs()[0].Tensor(shape=tensor.shape, dtype=tensor.dtype)
        ref.shared_memory.region = self.name
        ref.shared_memory.offset = offset
        return ref

    def output_at(self, offset):
        """A SharedMemoryRef for output_shared_memory: the output's bytes go to byte `offset` of this region."""
        return _stubs()[0].SharedMemoryRef(region=self.name, offset=int(offset))

    def read(self, tensor):
        """The array a Tensor that references this region describes (a copy of its bytes)."""
        count = 1
        for d in tensor.shape:
            count *= int(d)
        size = {1: 4, 2: 2, 3: 2}.get(tensor.dtype)
        if size is None:
            raise ValueError("tensor has unknown dtype %r" % (tensor.dtype,))
        start = int(tensor.shared_memory.offset)
        if start + count * size > self.byte_size:
            raise ValueError("the tensor passes the end of region %r" % self.name)
        copy = _stubs()[0].Tensor(shape=tensor.shape, dtype=tensor.dtype,
                                  data=bytes(self._shm.buf[start:start + count * size]))
        return from_tensor(copy)

    def close(self):
        """Unregisters the region (if the server still answers) and removes the object."""
        if self._shm is None:
            return
        self._client._regions.pop(self.name, None)
        try:
            self._client.unregister_shared_memory(self.name)
        except grpc.RpcError:
            pass
        finally:
            self._release()

    def _release(self):
        self._shm.close()
        self._shm.unlink()
        self._shm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
