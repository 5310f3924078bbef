"""Soak test: many concurrent clients for a while against the real mha_server, with mixed sizes, some calls that
return weights, some the client cancels, some whose deadline passes. Every answer is checked for its status; a
sample of OK answers is checked against the reference backend; the server's resident memory at the end must be
within 10% (plus 8 MiB of allocator granularity) of what it was after warm-up, both read idle.

Usage: /usr/bin/python3 tests/soak/soak.py [--server build/bin/mha_server] [--seconds 60] [--clients 64]
ctest runs it for 10 s (soak_short); `tests/soak/soak.py --seconds 60` is the full run. Loopback only; the server
is started and stopped by this script (by its PID).
"""

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

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


def start_server(binary, log, mmap_threshold=0):
    port_file = tempfile.mktemp(prefix="mha_soak_port_")
    env = dict(os.environ)
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port_file", port_file, "--log_level", "warn",
                             "--max_queue_size", "512"], stdout=log, stderr=subprocess.STDOUT, env=env)
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


class Soak:
    def __init__(self, target, seed):
        pb, pb_grpc, _, _ = mhaclient._stubs()
        self.pb = pb
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.AttentionStub(self.channel)
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.failures = []
        self.checked = 0
        self.ok_small = 0
        self.seed = seed

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

    def client(self, index, until):
        rng = np.random.default_rng(self.seed * 1000 + index)
        pick = random.Random(self.seed * 1000 + index)
        names = [k[0] for k in KINDS]
        weights = [k[1] for k in KINDS]
        while time.time() < until:
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

    def run(self, clients, seconds):
        until = time.time() + seconds
        threads = [threading.Thread(target=self.client, args=(i, until)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.path.join(REPO_ROOT, "build", "bin", "mha_server"))
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--warmup_seconds", type=float, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fixed_mmap_threshold", type=int, default=0, metavar="BYTES",
                        help="start the server with glibc's mmap threshold fixed at BYTES (MALLOC_MMAP_THRESHOLD_): "
                             "freed large buffers then leave the process instead of staying in the arenas wherever "
                             "the dynamic threshold put them, so that a short run's two RSS readings compare what "
                             "the server holds (ctest's 10 s form); 0, the default: the allocator as deployed")
    args = parser.parse_args()
    sys.path.insert(0, mhaclient.generate_stubs(tempfile.mkdtemp(prefix="mha_soak_stubs_"), REPO_ROOT))

    log = tempfile.NamedTemporaryFile(prefix="mha_soak_server_", suffix=".log", delete=False)
    proc, target = start_server(args.server, log, args.fixed_mmap_threshold)
    failures = []
    try:
        warm = Soak(target, args.seed)
        warm.run(args.clients, args.warmup_seconds)
        warm.warm_every_thread()
        rss_warm = idle_rss_bytes(proc.pid)
        soak = Soak(target, args.seed + 1)
        start = time.time()
        soak.run(args.clients, args.seconds)
        elapsed = time.time() - start
        rss_end = idle_rss_bytes(proc.pid)
        failures = warm.failures + soak.failures
        total = sum(soak.counts.values())
        print("soak: %d clients, %.1f s, %d calls (%.0f/s), %d checked against the reference" %
              (args.clients, elapsed, total, total / elapsed, soak.checked))
        for (name, code), count in sorted(soak.counts.items()):
            print("  %-14s %-18s %6d" % (name, code, count))
        print("soak: server RSS %.1f MiB after warm-up, %.1f MiB at the end (%+.1f%%)" %
              (rss_warm / 2**20, rss_end / 2**20, 100.0 * (rss_end - rss_warm) / rss_warm))
        if rss_end > (1 + RSS_GROWTH) * rss_warm + RSS_SLACK_BYTES:
            failures.append("RSS grew more than 10%% + 8 MiB (%.1f -> %.1f MiB)" % (rss_warm / 2**20, rss_end / 2**20))
        if proc.poll() is not None:
            failures.append("the server exited during the soak (%s)" % proc.returncode)
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
        print("server log:", log.name)
    print("soak: %d passed, %d failed" % (0 if failures else 1, 1 if failures else 0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
