"""Soak test: many concurrent clients for a while against the real mha_server, each mixing stateless calls (mixed
sizes, some returning weights, some the client cancels, some whose deadline passes) with KV-cache sessions (create,
prefill, decode, fork and decode both in one call, truncate and decode again, Extends the client cancels or lets
pass their deadline, close), in a cache pool that sessions left open keep full, so that idle sessions get evicted.

What passes:
- every call ends with a status its kind allows (stateless: ALLOWED; sessions: SessionWorker's docstring); a session
  may be evicted only as docs/SERVER.md says (NOT_FOUND saying so, counted in the server's metrics exactly as often
  as the clients met it), and an Extend refused for room only when every session left holds a call and the pool
  is full (95% of its bytes in use, or no room for the call's blocks beside them);
- a sample of every stateless kind, and of every (session kind, call kind), is compared with a reference: the
  reference backend for stateless calls, numpy in float64 from the session's own recorded history for sessions
  (the first of each and then one in SESSION_CHECK_EVERY); a cancelled Extend left its session either before or
  after it, never in between, and expected_length tells which;
- at the end no session is open and the pool holds no block;
- the server's resident memory at the end is within 10% (plus 8 MiB of allocator granularity) of what it was after
  warm-up, both read idle with the pool's chunks resident; and sampled during the run it never exceeds the warm
  level plus the stateless mix's working memory (working_memory_bytes; the pool's whole capacity is already in
  the warm level: see fill_pool).

Usage: /usr/bin/python3 tests/soak/soak.py [--server build/bin/mha_server] [--seconds 60] [--clients 64]
ctest runs it for 10 s (soak_short); `tests/soak/soak.py --seconds 60` is the full run. Loopback only; the server
is started and stopped by this script (by its PID).
"""

import argparse
import collections
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request

import grpc
import numpy as np

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(REPO_ROOT, "client", "python"))
import mhaclient  # noqa: E402

# (name, weight, batch, tokens, return_weights, wire dtype, what the client does): what each call of the mix is.
KINDS = [
    ("tiny", 50, 1, 16, False, "fp32", "wait"),
    ("weights", 12, 2, 32, True, "fp32", "wait"),
    ("bf16", 12, 4, 64, False, "bf16", "wait"),
    ("large", 3, 8, 512, False, "fp32", "wait"),
    ("cancelled", 8, 8, 256, False, "fp32", "cancel"),
    ("past_deadline", 15, 8, 512, False, "fp32", "deadline"),
]
# Statuses each kind may end with; anything else is a failure.
ALLOWED = {
    "wait": {grpc.StatusCode.OK},
    "cancel": {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED},
    "deadline": {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED},
}
CHECK_EVERY = 25  # one OK answer in this many (of the kinds that wait) is compared with the reference backend
# Both RSS readings are the lowest of samples taken without load, once that lowest has held for longer than the
# server's trim period (it returns free allocator pages every 3 s: MhaServer::Watch): calls still in flight when
# the load stops (queued large ones, cancelled ones finishing) can make the first trims after it return little.
# A fixed 4 s window read the warm or end level up to 20 MiB high now and then on a slower host.
TRIM_PERIOD_S = 3.0
IDLE_MIN_S, IDLE_MAX_S = 4.0, 15.0
SETTLED_BYTES = 1 << 20  # a drop smaller than this does not count as the level still falling
# Allowed growth: 10% of the warm level, plus 8 MiB for the allocator's granularity (a short run's warm level is
# near 70 MiB, where 10% is one arena chunk or two).
RSS_GROWTH = 0.10
RSS_SLACK_BYTES = 8 << 20
RSS_SAMPLE_S = 0.05  # how often the run's peak RSS is sampled

# ---- sessions -----------------------------------------------------------------------------------------------------

# The server's session settings for the soak. The pool holds what the clients' live sessions take (10-11 MiB at
# their peak, in three block sizes) with a little room; the sessions left open fill the rest (fill_pool's, then
# those the clients abandon), so that the pool is full from the start and the least recently used idle sessions are
# evicted all along, now and then a live one whose client was busy with stateless calls. A prefill is computed in
# chunks of PREFILL_CHUNK tokens, so that cancelling one often lands between its chunks.
KV_CACHE_MB = 16
BLOCK_TOKENS = 32
PREFILL_CHUNK = 64
SESSION_MAX_TOKENS = 1024  # every session's max_tokens; a worker closes its session before it could pass it
SESSION_SHARE = 0.5  # the share of a client's calls that go to its sessions; the rest are the stateless mix
# The share of sessions a client leaves open when it is done with them, as clients that went away do: idle, least
# recently used, they are what the pool evicts first when it is full. They are closed when the run ends.
ABANDON_SHARE = 0.3
ABANDON_PER_STEP = 0.02  # and mid-way, at any step without a fork
# Session calls are small (a prefill of 256 tokens at most), so that this deadline is far past any wait in the
# compute queue, yet lets a call the server never answers fail the run within ctest's timeout.
SESSION_TIMEOUT_S = 30
SESSION_CHECK_EVERY = 4  # of each (session kind, call kind): the first OK result and then one in this many

# The soak's own layer for layer sessions (its weights are known here, so numpy can compute the reference):
# d_model 128, 4 heads of 32 sharing 2 KV heads, biases, RoPE (rotate-half) at 10000.
SOAK_LAYER = "soak_layer"
LAYER_D_MODEL, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM, LAYER_ROPE = 128, 4, 2, 32, 10000.0

# Session kinds: (name, weight, heads, kv heads, head_dim, caches, cache dtype, rope_theta, layer session,
# (atol, rtol)). Tolerances are the proto's against the reference backend (DataType's comment): fp32 1e-4 / 1e-3 as
# the Python end-to-end tests use for fp32 on the wire against float64; a bf16 cache decodes on the 16-bit path on
# CPUs with AVX512-BF16, 3e-2. Three block sizes (32 KiB, 16 KiB and 2 KiB) share the pool's slabs.
SessionKind = collections.namedtuple(
    "SessionKind", "name weight heads kv_heads head_dim caches cache_dtype rope_theta layer tolerance")
SESSION_KINDS = [
    SessionKind("heads_fp32", 4, 8, 2, 64, 1, "fp32", 0.0, False, (1e-4, 1e-3)),
    # Small enough that most of its Extends run inline on the gRPC thread (--inline_max_mflop), prefills of more than
    # PREFILL_CHUNK tokens among them. The reference rounds its keys and values to fp16 as the cache does, but from
    # RoPE in float64 where the server rotates in fp32: a key near a rounding boundary can land on the other fp16
    # neighbour (outputs then differ by up to about 2e-4), so fp16's tolerance, 1e-3.
    SessionKind("heads_tiny_fp16", 2, 2, 1, 16, 1, "fp16", 10000.0, False, (1e-3, 1e-3)),
    SessionKind("heads_bf16", 3, 8, 4, 64, 2, "bf16", 10000.0, False, (3e-2, 3e-2)),
    SessionKind("layer_fp32", 3, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM, 1, "fp32", LAYER_ROPE, True,
                (1e-4, 1e-3)),
]

# What the RSS sampled during the run may add to the idle level read after warm-up. The pool is already in that
# level, whole: fill_pool writes every chunk and the pool keeps up to 64 MiB of emptied chunks backed (BlockPool's
# keep_resident_bytes), so that cache memory gets no allowance of its own here and a session's memory outside the
# pool has to fit in what the stateless mix leaves. What remains is the stateless mix's working memory:
# - one computation at a time, at most the `large` call's (B=8, T=512, d_model 512): its 8 MiB query, Q, K, V and
#   the heads (32 MiB), its output and the serialised response (16 MiB): 56 MiB. Attention scratch per compute
#   thread is in the warm level already (warm_every_thread);
# - the requests being received, waiting or being refused, and the responses not yet sent: each client has one
#   call in flight, a stateless one (1 - session share) of the time, and a quarter of those (cancelled,
#   past_deadline, large: weights 26 of 100) carry 4-8 MiB, held twice while they wait (gRPC's received bytes and
#   the parsed message): 16 MiB each, allowed at 1.5 times their mean count for the moments when several meet
#   (the allocator keeps what they freed until its next trim, so the peak is the most that was live at once).
#   Session calls are small (a 256-token prefill of heads_bf16 is under 1 MiB each way).
# At 64 clients and half their calls to sessions that is 56 + 200 = 256 MiB. Measured on a 2-vCPU Zen 4 VM: 85-130
# MiB above the warm level in 10 s runs (ctest's form), 133 and 175 MiB in 60 s ones with the allocator as
# deployed; the stateless mix alone (--session_share 0) 185 MiB, where this allows 455.
LARGEST_CALL_BYTES = 56 << 20
BIG_CALL_SHARE = 26 / 100
BIG_REQUEST_BYTES = 16 << 20


def working_memory_bytes(clients, session_share):
    return int(LARGEST_CALL_BYTES + 1.5 * clients * (1 - session_share) * BIG_CALL_SHARE * BIG_REQUEST_BYTES)


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def idle_rss_bytes(pid):
    """The lowest RSS sampled every 0.25 s without load, once it has not fallen by SETTLED_BYTES for longer than
    TRIM_PERIOD_S (after IDLE_MIN_S at least, IDLE_MAX_S at most)."""
    start = time.time()
    lowest = rss_bytes(pid)
    settled_since = start
    while True:
        time.sleep(0.25)
        now = time.time()
        rss = rss_bytes(pid)
        if rss < lowest - SETTLED_BYTES:
            settled_since = now
        lowest = min(lowest, rss)
        if now - start >= IDLE_MAX_S or (now - start >= IDLE_MIN_S and now - settled_since > TRIM_PERIOD_S + 0.5):
            return lowest


class PeakRss:
    """Samples a process's RSS every RSS_SAMPLE_S on a thread between start() and stop(); peak is the highest, and
    pool_peak the highest mha_kv_cache_used_bytes read from its metrics every tenth sample."""

    def __init__(self, pid, metrics_port):
        self.pid, self.metrics_port, self.peak, self.pool_peak, self.samples = pid, metrics_port, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            if self.samples % 10 == 0:
                self.pool_peak = max(self.pool_peak, metrics(self.metrics_port).get("mha_kv_cache_used_bytes", 0))
            self.samples += 1
            self._stop.wait(RSS_SAMPLE_S)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, log, mmap_threshold, kv_cache_mb, metrics_port, log_level, extra_args):
    port_file = tempfile.mktemp(prefix="mha_soak_port_")
    env = dict(os.environ)
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port_file", port_file, "--log_level", log_level,
                             "--max_queue_size", "512", "--kv_cache_mb", str(kv_cache_mb),
                             "--kv_block_tokens", str(BLOCK_TOKENS), "--max_prefill_chunk", str(PREFILL_CHUNK),
                             "--metrics_listen", "127.0.0.1:%d" % metrics_port] + extra_args,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 20
    while time.time() < deadline:
        if os.path.exists(port_file):
            with open(port_file) as f:
                port = f.read().strip()
            os.unlink(port_file)
            return proc, "127.0.0.1:" + port
        if proc.poll() is not None:
            sys.exit("mha_server exited at start with %s" % proc.returncode)
        time.sleep(0.05)
    proc.kill()
    sys.exit("mha_server did not start in 20 s")


def metrics(port):
    """The server's Prometheus metrics as {name or name{labels}: value}."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def evictions(values, reason):
    return values.get('mha_session_evictions_total{reason="%s"}' % reason, 0.0)


# ---- the numpy reference of a session -----------------------------------------------------------------------------

def rounded(a, cache_dtype):
    """What a cache of cache_dtype keeps of a (float64): each element rounded once (nearest even), as float64."""
    a32 = np.asarray(a, dtype=np.float32)
    if cache_dtype == "fp16":
        a32 = a32.astype(np.float16).astype(np.float32)
    if cache_dtype == "bf16":
        a32 = mhaclient.from_bf16_bytes(mhaclient.to_bf16_bytes(a32), a32.shape)
    return a32.astype(np.float64)


def rope(x, start, theta):
    """x [n, heads, d] (float64) rotated at positions start..start+n-1: rotate-half pairs (i, i + d/2), angle
    position * theta^(-2i/d), as HeadConfig.rope_theta says; theta 0 = unchanged."""
    if not theta:
        return x
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = np.outer(np.arange(start, start + x.shape[0], dtype=np.float64), inv_freq)[:, None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attend(q, keys, values, scale):
    """The new queries q [n, H, d] over a cache's keys and values [T, Hkv, d] (the last n of them q's own tokens),
    causal bottom-right (query i sees keys 0..T-n+i), GQA's KV head h // (H / Hkv). Returns [n, H, d] (float64)."""
    n, heads = q.shape[0], q.shape[1]
    total, kv_heads = keys.shape[0], keys.shape[1]
    k = np.repeat(keys, heads // kv_heads, axis=1)
    v = np.repeat(values, heads // kv_heads, axis=1)
    scores = np.einsum("nhd,thd->hnt", q, k) * scale
    visible = np.arange(total)[None, :] <= np.arange(n)[:, None] + (total - n)
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, v)


class Tokens:
    """n new tokens for one cache of a session: what goes on the wire (q, k, v or x, fp32) and, once placed at the
    cache position they land at, their rotated queries and the keys and values the cache keeps (float64)."""

    def __init__(self, kind, rng, n, layer_weights):
        self.kind, self.n, self.layer_weights = kind, n, layer_weights
        if kind.layer:
            self.wire = {"x": rng.standard_normal((n, LAYER_D_MODEL)).astype(np.float32)}
        else:
            self.wire = {"q": rng.standard_normal((n, kind.heads, kind.head_dim)).astype(np.float32),
                         "k": rng.standard_normal((n, kind.kv_heads, kind.head_dim)).astype(np.float32),
                         "v": rng.standard_normal((n, kind.kv_heads, kind.head_dim)).astype(np.float32)}

    def projected(self):
        """q [n, H, d], k and v [n, Hkv, d] before RoPE, float64."""
        if not self.kind.layer:
            return tuple(self.wire[name].astype(np.float64) for name in ("q", "k", "v"))
        w, x = self.layer_weights, self.wire["x"].astype(np.float64)

        def project(name, heads):
            return (x @ w["w_" + name] + w["b_" + name]).reshape(self.n, heads, LAYER_HEAD_DIM)

        return project("q", LAYER_HEADS), project("k", LAYER_KV_HEADS), project("v", LAYER_KV_HEADS)

    def at(self, start):
        """(rotated q, kept k, kept v) of these tokens appended at position start."""
        q, k, v = self.projected()
        theta, dtype = self.kind.rope_theta, self.kind.cache_dtype
        return rope(q, start, theta), rounded(rope(k, start, theta), dtype), rounded(v, dtype)


class SessionRecord:
    """A session as its client knows it: every cache's kept keys and values (what the numpy reference reads), and the
    caches whose length an interrupted Extend left unknown (cache -> (length before, its Tokens))."""

    def __init__(self, kind, session):
        self.kind, self.session, self.id = kind, session, session.id
        shape = (0, kind.kv_heads, kind.head_dim)
        self.keys = [np.zeros(shape) for _ in range(kind.caches)]
        self.values = [np.zeros(shape) for _ in range(kind.caches)]
        self.unsure = {}
        self.last = None  # (cache, length before, Tokens) of the last Extend this client saw answered
        self.evicted = False
        self.after = None  # what the session's last call was, when its next Extend counts as "after" it

    def length(self, cache):
        return self.keys[cache].shape[0]

    def lengths(self):
        return [self.length(c) for c in range(self.kind.caches)]

    def append(self, cache, tokens):
        _, k, v = tokens.at(self.length(cache))
        self.keys[cache] = np.concatenate([self.keys[cache], k])
        self.values[cache] = np.concatenate([self.values[cache], v])

    def truncate(self, length):
        for c in range(self.kind.caches):
            self.keys[c], self.values[c] = self.keys[c][:length], self.values[c][:length]

    def fork(self, session):
        other = SessionRecord(self.kind, session)
        other.keys, other.values = list(self.keys), list(self.values)
        return other

    def expected(self, cache, tokens, layer_weights):
        """What an Extend of tokens at this cache's current length returns: [n, H, d], or [n, d_model] for a layer
        session; the record does not change."""
        q, k, v = tokens.at(self.length(cache))
        heads = attend(q, np.concatenate([self.keys[cache], k]), np.concatenate([self.values[cache], v]),
                       1.0 / math.sqrt(self.kind.head_dim))
        if not self.kind.layer:
            return heads
        return heads.reshape(tokens.n, -1) @ layer_weights["w_o"] + layer_weights["b_o"]


def layer_weights_for(seed):
    rng = np.random.default_rng(seed)
    d, heads, kv_heads, dk = LAYER_D_MODEL, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM

    def f32(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {"w_q": f32(d, heads * dk, scale=d ** -0.5), "w_k": f32(d, kv_heads * dk, scale=d ** -0.5),
            "w_v": f32(d, kv_heads * dk, scale=d ** -0.5), "w_o": f32(heads * dk, d, scale=(heads * dk) ** -0.5),
            "b_q": f32(heads * dk, scale=0.3), "b_k": f32(kv_heads * dk, scale=0.3),
            "b_v": f32(kv_heads * dk, scale=0.3), "b_o": f32(d, scale=0.3)}


# The session calls that are Extends (SessionWorker's call kinds).
EXTEND_CALLS = ("prefill", "decode", "fork_decode", "after_truncate", "after_interrupted", "cancelled",
                "past_deadline", "retried")
# Statuses a session call may end with besides OK, and when (SessionWorker.expected_error says it precisely).
EVICTED = re.compile(r"session '([A-Za-z0-9._-]+)' was evicted .*the KV cache was full")
POOL_FULL = re.compile(r"the KV cache is full: (\d+) of (\d+) bytes .* of (\d+) sessions, (\d+) in use by calls"
                       r".*needs at least (\d+) more block\(s\) of (\d+) bytes")
# A refusal for room with less of the pool in use fails the run, unless the call's blocks would not fit beside what
# is in use anyway (#52: whatever the mix of block sizes, the pool refuses only when it is full).
FULL_POOL_SHARE = 0.95


class Soak:
    def __init__(self, target, seed, layer_weights, session_share=SESSION_SHARE):
        pb, pb_grpc, _, _ = mhaclient._stubs()
        self.pb = pb
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.AttentionStub(self.channel)
        self.client = mhaclient.MhaClient(target, timeout=SESSION_TIMEOUT_S, max_message_mb=64)
        self.layer_weights = layer_weights
        self.session_share = session_share
        self.lock = threading.Lock()
        self.counts = collections.Counter()  # (stateless kind, status) -> calls
        self.session_counts = collections.Counter()  # (session kind, call kind, status) -> calls
        self.session_checked = collections.Counter()  # (session kind, call kind) -> results checked
        self.sessions_created = collections.Counter()  # session kind -> sessions (forks included)
        self.evicted_ids = set()
        self.pool_full_refusals = []  # the share of the pool's bytes in use, as each refusal said
        self.unsure_resolved = collections.Counter()  # "committed" / "not committed": interrupted Extends
        self.failures = []
        self.checked = 0
        self.ok_small = 0
        self.seed = seed

    def close(self):
        self.client.close()
        self.channel.close()

    def fail(self, message):
        with self.lock:
            self.failures.append(message)

    def request(self, rng, batch, tokens, return_weights, dtype, backend=0):
        query = rng.standard_normal((batch, tokens, 512)).astype(np.float32)
        return self.pb.MultiHeadAttentionRequest(query=mhaclient.to_tensor(query, dtype), layer="demo",
                                                 return_attention_weights=return_weights, backend=backend)

    def check_against_reference(self, request, response, dtype):
        reference_request = self.pb.MultiHeadAttentionRequest()
        reference_request.CopyFrom(request)
        reference_request.backend = self.pb.BACKEND_REFERENCE
        want = self.stub.MultiHeadAttention(reference_request, timeout=60)
        tol = 2e-2 if dtype == "bf16" else 1e-4
        got_out, want_out = mhaclient.from_tensor(response.output), mhaclient.from_tensor(want.output)
        if not np.allclose(got_out, want_out, atol=tol, rtol=tol):
            return "output differs from the reference by %g" % np.max(np.abs(got_out - want_out))
        if request.return_attention_weights:
            got_w, want_w = (mhaclient.from_tensor(response.attention_weights),
                             mhaclient.from_tensor(want.attention_weights))
            if not np.allclose(got_w, want_w, atol=tol, rtol=tol):
                return "weights differ from the reference by %g" % np.max(np.abs(got_w - want_w))
        return None

    def warm_every_thread(self, rounds=3):
        """Large calls, several at once, a few times: every compute thread then holds the scratch of the mix's
        largest call (kept per thread for reuse, tens of MiB; only scratch above 64 MiB is freed after its call),
        so that the warm RSS reading does not depend on which threads the random warm-up happened to use."""
        _, _, batch, tokens, return_weights, dtype, _ = KINDS[[k[0] for k in KINDS].index("large")]
        concurrent = min(16, max(4, 2 * (os.cpu_count() or 1)))
        rng = np.random.default_rng(self.seed)
        request = self.request(rng, batch, tokens, return_weights, dtype)
        for _ in range(rounds):
            futures = [self.stub.MultiHeadAttention.future(request, timeout=60) for _ in range(concurrent)]
            for future in futures:
                future.result()

    def fill_pool(self, capacity_bytes, metrics_port, tokens=1024):
        """Fills the KV-cache pool with fp32 head sessions of `tokens` tokens, two more than fit (the two oldest are
        evicted to make room), and leaves them open and idle, as clients that went away leave theirs: every chunk
        of the pool has then been written and stays resident (up to BlockPool's keep_resident_bytes), so that the
        warm RSS reading holds the pool whole, and the run's sessions must have these evicted to find room (all of
        one block size, so that other sizes find runs of the lengths these leave). Returns the pool's use in bytes when it was
        full, from the metrics, and the sessions (SessionRecords of kind "fill"), for close_left_open."""
        kind = SESSION_KINDS[0]._replace(name="fill")
        rng = np.random.default_rng(self.seed)
        per_session = kind.kv_heads * kind.head_dim * 2 * 4 * tokens
        records = []
        for _ in range(capacity_bytes // per_session + 2):
            session = self.client.create_session(num_heads=kind.heads, num_kv_heads=kind.kv_heads,
                                                 head_dim=kind.head_dim, max_tokens=tokens)
            records.append(SessionRecord(kind, session))
            session.extend(0, **Tokens(kind, rng, tokens, None).wire)
        return metrics(metrics_port).get("mha_kv_cache_used_bytes", 0), records

    def close_left_open(self, records):
        """Closes sessions left open (fill_pool's): OK, or NOT_FOUND for those the server evicted."""
        worker = SessionWorker(self, np.random.default_rng(self.seed), random.Random(self.seed))
        for record in records:
            worker.close(record, "close_abandoned")

    def stateless_call(self, rng, pick):
        names = [k[0] for k in KINDS]
        weights = [k[1] for k in KINDS]
        name, _, batch, tokens, return_weights, dtype, action = KINDS[names.index(pick.choices(names, weights)[0])]
        request = self.request(rng, batch, tokens, return_weights, dtype)
        timeout = 0.005 if action == "deadline" else 60
        future = self.stub.MultiHeadAttention.future(request, timeout=timeout)
        if action == "cancel":
            time.sleep(0.005)
            future.cancel()
        try:
            response = future.result()
            code = grpc.StatusCode.OK
        except grpc.FutureCancelledError:
            code = grpc.StatusCode.CANCELLED
        except grpc.RpcError as e:
            code = e.code()
            response = None
        failure = None
        if code not in ALLOWED[action]:
            failure = "%s ended %s: %s" % (name, code, getattr(future.exception(), "details", lambda: "")())
        elif code == grpc.StatusCode.OK and action == "wait" and name != "large":
            with self.lock:
                self.ok_small += 1
                check = self.ok_small % CHECK_EVERY == 0
            if check:
                failure = self.check_against_reference(request, response, dtype)
                with self.lock:
                    self.checked += 1
        with self.lock:
            self.counts[(name, code.name)] += 1
            if failure:
                self.failures.append(failure)

    def client_loop(self, index, until):
        rng = np.random.default_rng(self.seed * 1000 + index)
        pick = random.Random(self.seed * 1000 + index)
        worker = SessionWorker(self, rng, pick)
        try:
            while time.time() < until:
                if pick.random() < self.session_share:
                    worker.step()
                else:
                    self.stateless_call(rng, pick)
            worker.finish()
        except Exception:  # a bug here, not the server's: the run fails with its traceback
            self.fail("client %d: %s" % (index, traceback.format_exc()))

    def run(self, clients, seconds):
        until = time.time() + seconds
        threads = [threading.Thread(target=self.client_loop, args=(i, until)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class SessionWorker:
    """One client's sessions: one at a time, and now and then a fork of it. Each step() makes one call (or one per
    cache for an Extend of a multi-layer session):
    - create: a session of a kind drawn by weight, max_tokens SESSION_MAX_TOKENS; then a prefill of 16-256 tokens;
    - decode: 1 token; prefill: 16-96 more tokens (several of PREFILL_CHUNK chunks at once);
    - fork: then the session and its fork decode together, one two-item Extend per cache, 2-5 steps, and the fork
      is closed;
    - truncate: keep all but the last 1-40 tokens (a rejected speculation), then decode on;
    - interrupted: an Extend (one token or a prefill) the client cancels after 0-15 ms or gives a 1-10 ms deadline;
      its cache's length is then unknown: the next Extend there sends expected_length = the length before, and
      FAILED_PRECONDITION means the interrupted one committed whole (its tokens are recorded, and the Extend is sent
      again with the length after), any other outcome that it did not;
    - retry: a decode step, then the same Extend again with the same expected_length, as a client that missed
      the answer resends it: FAILED_PRECONDITION, nothing appended;
    - close: after 8-40 steps or near max_tokens, or abandon instead (ABANDON_SHARE; ABANDON_PER_STEP at any step):
      the session stays open without calls until the run ends, when every open or abandoned session is closed.
    Every Extend sends expected_length. Statuses besides OK: CANCELLED or DEADLINE_EXCEEDED for an interrupted
    Extend; NOT_FOUND on any call of a session the server evicted, saying so (the session is then dropped); and
    RESOURCE_EXHAUSTED for an Extend when the pool is full, only if every session left holds a call (the server
    evicts the least recently used idle ones first) and the pool is really full: FULL_POOL_SHARE of its bytes in
    use, or the call's blocks not fitting beside them, whatever the mix of block sizes.
    Anything else, FAILED_PRECONDITION on an Extend whose
    expected_length the client knew included, is a failure."""

    def __init__(self, soak, rng, pick):
        self.soak, self.rng, self.pick = soak, rng, pick
        self.session = None  # SessionRecord
        self.fork = None  # SessionRecord of its fork, while they decode together
        self.fork_steps = 0
        self.steps_left = 0
        self.abandoned = []  # SessionRecords left open without calls, as clients that went away leave them

    # ---- bookkeeping ----------------------------------------------------------------------------------------

    def count(self, record, call, code):
        """Counts one call; returns how many of its (kind, call, status) there have been, this one included."""
        with self.soak.lock:
            self.soak.session_counts[(record.kind.name, call, code.name)] += 1
            return self.soak.session_counts[(record.kind.name, call, code.name)]

    def expected_error(self, record, call, error):
        """Whether error is one of the statuses a session call may end with (class docstring); records an eviction
        of record; a failure is recorded otherwise."""
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.NOT_FOUND:
            match = EVICTED.search(details)
            if match and match.group(1) in (record.id, self.fork.id if self.fork else None):
                evicted = record if match.group(1) == record.id else self.fork
                evicted.evicted = True
                with self.soak.lock:
                    self.soak.evicted_ids.add(evicted.id)
                return True
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and call in EXTEND_CALLS:
            match = POOL_FULL.search(details)
            if match and match.group(3) == match.group(4):
                used, capacity = int(match.group(1)), int(match.group(2))
                wanted = int(match.group(5)) * int(match.group(6))
                with self.soak.lock:
                    self.soak.pool_full_refusals.append(used / capacity)
                if used >= FULL_POOL_SHARE * capacity or used + wanted > capacity:
                    return True
                details += " (refused with %.0f%% of the pool in use and room for the call)" % (100 * used / capacity)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            details += " (no answer within the client's %g s: a call the server never finished?)" % SESSION_TIMEOUT_S
        self.soak.fail("%s session %s: %s ended %s: %s" % (record.kind.name, record.id, call, code.name, details))
        return False

    def counted_ok(self, record, call):
        """Counts an OK call; whether its result is checked: the first of its (kind, call) and then one in
        SESSION_CHECK_EVERY."""
        return (self.count(record, call, grpc.StatusCode.OK) - 1) % SESSION_CHECK_EVERY == 0

    def compare(self, record, call, got, want, length, want_length):
        atol, rtol = record.kind.tolerance
        with self.soak.lock:
            self.soak.session_checked[(record.kind.name, call)] += 1
        if length != want_length:
            self.soak.fail("%s session %s: %s left length %d, expected %d" %
                           (record.kind.name, record.id, call, length, want_length))
        elif got.shape != want.shape:
            self.soak.fail("%s session %s: %s output shape %s, expected %s" %
                           (record.kind.name, record.id, call, got.shape, want.shape))
        elif not np.all(np.abs(got - want) <= atol + rtol * np.abs(want)):
            self.soak.fail("%s session %s: %s output differs from numpy by %g (length %d)" %
                           (record.kind.name, record.id, call, np.max(np.abs(got - want)), want_length))

    # ---- calls ----------------------------------------------------------------------------------------------

    def create(self):
        names = [k.name for k in SESSION_KINDS]
        kind = SESSION_KINDS[names.index(self.pick.choices(names, [k.weight for k in SESSION_KINDS])[0])]
        client = self.soak.client
        try:
            if kind.layer:
                session = client.create_session(layers=[SOAK_LAYER], max_tokens=SESSION_MAX_TOKENS)
            else:
                session = client.create_session(num_heads=kind.heads, num_kv_heads=kind.kv_heads,
                                                head_dim=kind.head_dim, rope_theta=kind.rope_theta,
                                                num_layers=kind.caches, cache_dtype=kind.cache_dtype,
                                                max_tokens=SESSION_MAX_TOKENS)
        except grpc.RpcError as e:
            self.soak.fail("%s: create ended %s: %s" % (kind.name, e.code().name, e.details()))
            with self.soak.lock:
                self.soak.session_counts[(kind.name, "create", e.code().name)] += 1
            return
        self.session = SessionRecord(kind, session)
        self.count(self.session, "create", grpc.StatusCode.OK)
        with self.soak.lock:
            self.soak.sessions_created[kind.name] += 1
        if session.lengths() != [0] * kind.caches:
            self.soak.fail("%s session %s: created with lengths %s" % (kind.name, session.id, session.lengths()))
        self.steps_left = self.pick.randint(8, 40)
        self.extend(self.pick.randint(16, 256), "prefill")

    def extend(self, n, call, interrupt=None):
        """n new tokens on every cache of the session (one Extend each); interrupt: None, or "cancel" / "deadline"
        for one of the caches."""
        record = self.session
        interrupted_cache = self.pick.randrange(record.kind.caches) if interrupt else None
        call = call or ("decode" if n == 1 else "prefill")
        for cache in range(record.kind.caches):
            tokens = Tokens(record.kind, self.rng, n, self.soak.layer_weights)
            if cache == interrupted_cache:
                self.interrupted_extend(record, cache, tokens, interrupt)
            else:
                self.extend_one(record, cache, tokens, record.after or call)
            if record.evicted:
                return
        record.after = None

    def extend_one(self, record, cache, tokens, call):
        """One Extend of one session's cache, with expected_length; resolves an earlier interrupted Extend there."""
        if cache in record.unsure:
            before, pending = record.unsure.pop(cache)
            call = "after_interrupted"
            try:
                result = record.session.extend(cache, expected_length=before, **tokens.wire)
                with self.soak.lock:
                    self.soak.unsure_resolved["not committed"] += 1
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    self.count(record, call, e.code())
                    if self.expected_error(record, call, e):
                        record.unsure[cache] = (before, pending)  # refused for room: still unknown
                    return
                if "expected_length is %d but" % before not in (e.details() or "") or \
                        "holds %d tokens" % (before + pending.n) not in (e.details() or ""):
                    self.count(record, call, e.code())
                    self.soak.fail("%s session %s: an Extend interrupted at length %d of %d tokens left: %s" %
                                   (record.kind.name, record.id, before, pending.n, e.details()))
                    self.close(record)  # its state is unknown: dropped
                    record.evicted = True
                    return
                with self.soak.lock:
                    self.soak.unsure_resolved["committed"] += 1
                record.append(cache, pending)
                result = None
            if result is not None:
                self.finish_extend(record, cache, tokens, call, result, before)
                return
        before = record.length(cache)
        try:
            result = record.session.extend(cache, expected_length=before, **tokens.wire)
        except grpc.RpcError as e:
            self.count(record, call, e.code())
            self.expected_error(record, call, e)
            return
        self.finish_extend(record, cache, tokens, call, result, before)

    def finish_extend(self, record, cache, tokens, call, result, before):
        check = self.counted_ok(record, call)
        record.last = (cache, before, tokens)
        if check:
            want = record.expected(cache, tokens, self.soak.layer_weights)
            self.compare(record, call, result.output.astype(np.float64), want, result.length, before + tokens.n)
        elif result.length != before + tokens.n:
            self.soak.fail("%s session %s: %s left length %d, expected %d" %
                           (record.kind.name, record.id, call, result.length, before + tokens.n))
        record.append(cache, tokens)

    def interrupted_extend(self, record, cache, tokens, how):
        """An Extend the client cancels, or whose deadline passes; the cache's length is unknown afterwards, unless
        the call answered."""
        if cache in record.unsure:  # resolve an earlier one first, with these tokens
            self.extend_one(record, cache, tokens, "after_interrupted")
            return
        pb = self.soak.pb
        call = "cancelled" if how == "cancel" else "past_deadline"
        before = record.length(cache)
        request = pb.ExtendRequest(layer_index=cache, output_dtype=pb.FP32)
        item = request.items.add(session_id=record.id, expected_length=before)
        for name, array in tokens.wire.items():
            getattr(item, name).CopyFrom(mhaclient.to_tensor(array))
        timeout = self.pick.uniform(0.001, 0.010) if how == "deadline" else 60
        future = self.soak.stub.Extend.future(request, timeout=timeout, metadata=(("mha-session-id", record.id),))
        if how == "cancel":
            time.sleep(self.pick.uniform(0.0, 0.015))
            future.cancel()
        try:
            response = future.result()
        except grpc.FutureCancelledError:
            self.count(record, call, grpc.StatusCode.CANCELLED)
            record.unsure[cache] = (before, tokens)
            return
        except grpc.RpcError as e:
            self.count(record, call, e.code())
            if e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                record.unsure[cache] = (before, tokens)
            else:
                self.expected_error(record, call, e)
            return
        result = response.results[0]
        if self.counted_ok(record, call):
            want = record.expected(cache, tokens, self.soak.layer_weights)
            self.compare(record, call, mhaclient.from_tensor(result.output).astype(np.float64), want, result.length,
                         before + tokens.n)
        record.append(cache, tokens)

    def fork_extend(self):
        """One decode step of the session and its fork together: a two-item Extend per cache."""
        parent, fork = self.session, self.fork
        client = self.soak.client
        call = "fork_decode"
        for cache in range(parent.kind.caches):
            pairs = [(record, Tokens(record.kind, self.rng, 1, self.soak.layer_weights)) for record in (parent, fork)]
            items = [dict(session=record.session, expected_length=record.length(cache), **tokens.wire)
                     for record, tokens in pairs]
            try:
                results = client.extend(items, layer_index=cache)
            except grpc.RpcError as e:
                self.count(parent, call, e.code())
                self.expected_error(parent, call, e)
                return
            check = self.counted_ok(parent, call)
            for (record, tokens), result in zip(pairs, results):
                before = record.length(cache)
                if check:
                    want = record.expected(cache, tokens, self.soak.layer_weights)
                    self.compare(record, call, result.output.astype(np.float64), want, result.length, before + 1)
                elif result.length != before + 1:
                    self.soak.fail("%s session %s: %s left length %d, expected %d" %
                                   (record.kind.name, record.id, call, result.length, before + 1))
                record.append(cache, tokens)

    def retry(self):
        """A decode step, then the same Extend again, as a client that missed the answer resends it: with the
        expected_length it was sent with, it must be refused with FAILED_PRECONDITION and append nothing."""
        record = self.session
        self.extend(1, "decode")
        if record.evicted or record.last is None or record.unsure:
            return
        cache, before, tokens = record.last
        try:
            record.session.extend(cache, expected_length=before, **tokens.wire)
        except grpc.RpcError as e:
            self.count(record, "retried", e.code())
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                    "expected_length is %d but" % before in (e.details() or "") and \
                    "holds %d tokens" % record.length(cache) in (e.details() or ""):
                return
            self.expected_error(record, "retried", e)
            return
        self.count(record, "retried", grpc.StatusCode.OK)
        self.soak.fail("%s session %s: an Extend resent with expected_length %d appended again (cache %d held %d)" %
                       (record.kind.name, record.id, before, cache, record.length(cache)))

    def start_fork(self):
        record = self.session
        try:
            forked = record.session.fork()
        except grpc.RpcError as e:
            self.count(record, "fork", e.code())
            self.expected_error(record, "fork", e)
            return
        self.count(record, "fork", grpc.StatusCode.OK)
        with self.soak.lock:
            self.soak.sessions_created[record.kind.name] += 1
        self.fork = record.fork(forked)
        self.fork_steps = self.pick.randint(2, 5)
        if forked.lengths() != record.lengths():
            self.soak.fail("%s session %s: its fork %s has lengths %s, expected %s" %
                           (record.kind.name, record.id, forked.id, forked.lengths(), record.lengths()))

    def truncate(self):
        record = self.session
        keep = max(0, min(record.lengths()) - self.pick.randint(1, 40))
        try:
            record.session.truncate(keep)
        except grpc.RpcError as e:
            self.count(record, "truncate", e.code())
            self.expected_error(record, "truncate", e)
            return
        self.count(record, "truncate", grpc.StatusCode.OK)
        want = [min(length, keep) for length in record.lengths()]
        if record.session.lengths() != want:
            self.soak.fail("%s session %s: truncate(%d) left lengths %s, expected %s" %
                           (record.kind.name, record.id, keep, record.session.lengths(), want))
        record.truncate(keep)
        record.after = "after_truncate"

    def close(self, record, call="close"):
        try:
            record.session.close()
            self.count(record, call, grpc.StatusCode.OK)
        except grpc.RpcError as e:
            self.count(record, call, e.code())
            self.expected_error(record, call, e)

    def drop_evicted(self):
        """After an eviction: the other of the pair (if any) is closed and the worker starts over."""
        for record in (self.fork, self.session):
            if record is not None and not record.evicted:
                self.close(record)
        self.session = self.fork = None

    # ---- the state machine ----------------------------------------------------------------------------------

    def step(self):
        if self.session is None:
            self.create()
        elif self.fork is not None and not self.session.unsure:
            self.fork_extend()
            self.fork_steps -= 1
            if self.fork_steps == 0 and not (self.session.evicted or self.fork.evicted):
                self.close(self.fork)
                self.fork = None
        elif self.fork is not None:  # an interrupted Extend of the session to resolve first
            self.extend(1, "decode")
        elif self.pick.random() < ABANDON_PER_STEP:
            self.abandoned.append(self.session)
            self.session = None
        elif self.steps_left <= 0 or max(self.session.lengths()) > SESSION_MAX_TOKENS - 300:
            if self.pick.random() < ABANDON_SHARE:
                self.abandoned.append(self.session)
            else:
                self.close(self.session)
            self.session = None
        else:
            self.steps_left -= 1
            roll = self.pick.random()
            if self.session.unsure:
                self.extend(1, "decode")
            elif roll < 0.08:
                self.start_fork()
            elif roll < 0.16:
                self.truncate()
            elif roll < 0.21:
                self.extend(self.pick.choice([1, self.pick.randint(64, 200)]), None, "cancel")
            elif roll < 0.26:
                self.extend(self.pick.choice([1, self.pick.randint(64, 200)]), None, "deadline")
            elif roll < 0.34:
                self.extend(self.pick.randint(16, 96), "prefill")
            elif roll < 0.38:
                self.retry()
            else:
                self.extend(1, "decode")
        if self.session is not None and (self.session.evicted or (self.fork is not None and self.fork.evicted)):
            self.drop_evicted()

    def finish(self):
        """Closes what is still open when the run ends, the abandoned sessions too (those the server evicted answer
        NOT_FOUND saying so, which counts them)."""
        for record in (self.fork, self.session):
            if record is not None and not record.evicted:
                self.close(record)
        for record in self.abandoned:
            self.close(record, "close_abandoned")
        self.session = self.fork = None
        self.abandoned = []


class WarmUpFailed(Exception):
    pass


def report_sessions(soak):
    created = ", ".join("%s %d" % item for item in sorted(soak.sessions_created.items()))
    refusals = soak.pool_full_refusals
    print("soak: sessions (forks included): %s; %d evicted; %d Extends refused for a full pool%s; interrupted "
          "Extends found committed %d, not committed %d" %
          (created, len(soak.evicted_ids), len(refusals),
           " (%.0f-%.0f%% of its bytes in use)" % (100 * min(refusals), 100 * max(refusals)) if refusals else "",
           soak.unsure_resolved["committed"], soak.unsure_resolved["not committed"]))
    by_call = collections.defaultdict(collections.Counter)
    for (kind, call, code), count in soak.session_counts.items():
        by_call[(kind, call)][code] += count
    for (kind, call), codes in sorted(by_call.items()):
        statuses = ", ".join("%s %d" % item for item in sorted(codes.items()))
        checked = soak.session_checked.get((kind, call), 0)
        print("  %-15s %-17s %-55s checked %d" % (kind, call, statuses, checked))


def check_coverage(soak):
    """Every (session kind, call kind) that computed an output had at least one checked."""
    failures = []
    for (kind, call, code), count in soak.session_counts.items():
        if code == "OK" and call in EXTEND_CALLS and call != "retried" and \
                soak.session_checked.get((kind, call), 0) == 0:
            failures.append("%s %s: %d OK and none checked" % (kind, call, count))
    for kind in SESSION_KINDS:
        if not any(k == kind.name for k, _ in soak.session_checked):
            failures.append("no %s session's output was checked" % kind.name)
    return failures


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.path.join(REPO_ROOT, "build", "bin", "mha_server"))
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup_seconds", type=float, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--session_share", type=float, default=SESSION_SHARE,
                        help="the share of each client's calls that go to its sessions (0: the stateless mix alone)")
    parser.add_argument("--kv_cache_mb", type=int, default=KV_CACHE_MB,
                        help="the server's KV-cache pool; small enough that the sessions get evicted now and then")
    parser.add_argument("--server_arg", action="append", default=[], metavar="FLAG",
                        help="one more flag for the server (repeatable), e.g. --server_arg=--max_prefill_chunk=0")
    parser.add_argument("--server_log_level", default="warn",
                        help="the server's --log_level (info logs every call, for a failure's story)")
    parser.add_argument("--fixed_mmap_threshold", type=int, default=0, metavar="BYTES",
                        help="start the server with glibc's mmap threshold fixed at BYTES (MALLOC_MMAP_THRESHOLD_): "
                             "freed large buffers then leave the process instead of staying in the arenas wherever "
                             "the dynamic threshold put them, so that a short run's two RSS readings compare what "
                             "the server holds (ctest's 10 s form); 0, the default: the allocator as deployed")
    return parser.parse_args()


def main():
    args = parse_args()
    stubs = tempfile.TemporaryDirectory(prefix="mha_soak_stubs_")  # removed at exit; the imports are loaded by then
    sys.path.insert(0, mhaclient.generate_stubs(stubs.name, REPO_ROOT))

    log = tempfile.NamedTemporaryFile(prefix="mha_soak_server_", suffix=".log", delete=False)
    metrics_port = free_port()
    proc, target = start_server(args.server, log, args.fixed_mmap_threshold, args.kv_cache_mb, metrics_port,
                                args.server_log_level, args.server_arg)
    failures = []
    layer_weights = layer_weights_for(args.seed)
    try:
        with mhaclient.MhaClient(target) as client:
            client.load_layer(SOAK_LAYER, layer_weights, LAYER_HEADS, LAYER_KV_HEADS, LAYER_HEAD_DIM,
                              rope_theta=LAYER_ROPE)
            capacity = int(client.server_info()["limits"]["kv_cache_bytes"])
        warm = Soak(target, args.seed, layer_weights, args.session_share)
        warm.run(args.clients, args.warmup_seconds)
        warm.warm_every_thread()
        filled, left_open = warm.fill_pool(capacity, metrics_port)
        if filled < capacity - (1 << 20):
            failures.append("filling the pool reached %d of its %d bytes" % (filled, capacity))
        if warm.failures:  # the run would only repeat them, past ctest's timeout if calls were lost
            raise WarmUpFailed()
        rss_warm = idle_rss_bytes(proc.pid)
        soak = Soak(target, args.seed + 1, layer_weights, args.session_share)
        peak = PeakRss(proc.pid, metrics_port).start()
        start = time.time()
        soak.run(args.clients, args.seconds)
        elapsed = time.time() - start
        peak.stop()
        soak.close_left_open(left_open)
        after = metrics(metrics_port)
        open_sessions = soak.client.list_sessions()
        rss_end = idle_rss_bytes(proc.pid)
        failures += warm.failures + soak.failures + (check_coverage(soak) if args.session_share > 0 else [])
        warm.close()
        soak.close()
        total = sum(soak.counts.values())
        session_calls = sum(soak.session_counts.values())
        print("soak: %d clients, %.1f s, %d stateless calls and %d session calls (%.0f/s), %d stateless and %d "
              "session results checked against the references" %
              (args.clients, elapsed, total, session_calls, (total + session_calls) / elapsed, soak.checked,
               sum(soak.session_checked.values())))
        for (name, code), count in sorted(soak.counts.items()):
            print("  %-14s %-18s %6d" % (name, code, count))
        report_sessions(soak)
        evicted_by_server = evictions(after, "cache_full")
        evicted_met = len(warm.evicted_ids | soak.evicted_ids)
        print("soak: the server evicted %d sessions for room (metrics, warm-up included), the clients met %d; %d "
              "expired; the pool's use peaked at %.1f of %.0f MiB" % (evicted_by_server, evicted_met,
                                                  evictions(after, "idle_timeout"), peak.pool_peak / 2**20,
                                                  capacity / 2**20))
        if evicted_by_server != evicted_met:
            failures.append("the server counted %d evictions, its clients met %d" % (evicted_by_server, evicted_met))
        if evictions(after, "idle_timeout"):
            failures.append("%d sessions expired (none idles past its timeout here)" % evictions(after, "idle_timeout"))
        if open_sessions or after.get("mha_kv_cache_used_bytes", -1) != 0 or after.get("mha_sessions_open", -1) != 0:
            failures.append("after every session was closed: %d listed, mha_sessions_open %s, "
                            "mha_kv_cache_used_bytes %s" % (len(open_sessions), after.get("mha_sessions_open"),
                                                            after.get("mha_kv_cache_used_bytes")))
        working = working_memory_bytes(args.clients, args.session_share)
        bound = rss_warm + working
        print("soak: server RSS %.1f MiB after warm-up (KV-cache pool of %.0f MiB resident), %.1f MiB at the end "
              "(%+.1f%%), peak %.1f MiB during the run (%d samples; bound %.1f MiB: warm + %d MiB working memory)" %
              (rss_warm / 2**20, capacity / 2**20, rss_end / 2**20, 100.0 * (rss_end - rss_warm) / rss_warm,
               peak.peak / 2**20, peak.samples, bound / 2**20, working >> 20))
        if rss_end > (1 + RSS_GROWTH) * rss_warm + RSS_SLACK_BYTES:
            failures.append("RSS grew more than 10%% + 8 MiB (%.1f -> %.1f MiB)" % (rss_warm / 2**20, rss_end / 2**20))
        if peak.peak > bound:
            failures.append("RSS reached %.1f MiB during the run, past the pool and working memory (%.1f MiB)" %
                            (peak.peak / 2**20, bound / 2**20))
        if proc.poll() is not None:
            failures.append("the server exited during the soak (%s)" % proc.returncode)
    except WarmUpFailed:
        failures += ["warm-up: " + f for f in warm.failures]
        warm.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed after 40 s"
            if code != 0:
                failures.append("the server exited with %s after SIGTERM" % code)
    for f in failures[:20]:
        print("FAIL:", f)
    if failures:
        print("server log:", log.name)  # kept for the failure's story
    else:
        os.unlink(log.name)
    print("soak: %d passed, %d failed" % (0 if failures else 1, 1 if failures else 0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
