"""A hostile token's session traffic, F1-F9 of issue #54 at once, for tests/python/test_sessions_hostile_e2e.py.

Run as a process of its own (so that its threads do not share the measuring client's interpreter lock):
    python3 session_attacks.py TARGET TOKEN SECONDS STUBS_DIR VICTIM_IDS [ATTACKS]
Each attack runs in its own thread at a bounded rate for SECONDS, then the process prints two JSON lines: the first
message of each status each attack saw, and how many calls of each attack ended with each status.
"""

import collections
import json
import sys
import threading
import time

import grpc
import numpy as np

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def qkv(rng, n):
    return {"q": rng.standard_normal((n, 4, 16)).astype(np.float32),
            "k": rng.standard_normal((n, 2, 16)).astype(np.float32),
            "v": rng.standard_normal((n, 2, 16)).astype(np.float32)}


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, payload):
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def kserve_many_inputs(inputs):
    """ModelInferRequest bytes for model "demo" with `inputs` inputs named alike (F8: the duplicate check)."""
    one = field(5, field(1, b"query") + field(2, b"FP32"))
    return field(1, b"demo") + one * inputs


class Attacks:
    def __init__(self, target, token, seconds, pb, pb_grpc, mhaclient):
        self.target, self.token, self.seconds = target, token, seconds
        self.pb, self.mhaclient = pb, mhaclient
        self.metadata = (("authorization", "Bearer " + token),)
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.AttentionStub(self.channel)
        self.codes = collections.defaultdict(collections.Counter)
        self.examples = {}  # "attack code" -> the first message of that status
        self.lock = threading.Lock()
        self.end = time.monotonic() + seconds

    def client(self):
        return self.mhaclient.MhaClient(self.target, timeout=10.0, token=self.token, max_message_mb=64)

    def saw(self, attack, code, details=""):
        name = code.name if hasattr(code, "name") else str(code)
        with self.lock:
            self.codes[attack][name] += 1
            self.examples.setdefault("%s %s" % (attack, name), (details or "")[:300])

    def call(self, attack, fn):
        try:
            fn()
            self.saw(attack, "OK")
        except grpc.RpcError as error:
            self.saw(attack, error.code(), error.details())

    def running(self):
        return time.monotonic() < self.end

    # F1 (and F12): a queue of tiny calls behind the attacker's own busy session, some cancelled while they wait.
    def queue_behind_own_session(self):
        rng = np.random.default_rng(1)
        with self.client() as c:
            busy = c.create_session(session_id="busy", **HEADS)
            while self.running():
                prefill = self.stub.Extend.future(self.extend_request("busy", qkv(rng, 2048)), timeout=10,
                                                  metadata=self.metadata)
                waiting = [self.stub.Extend.future(self.extend_request("busy", qkv(rng, 1)),
                                                   timeout=0.05 if i % 4 == 0 else 10, metadata=self.metadata)
                           for i in range(80)]
                for future in [prefill] + waiting:
                    try:
                        future.result()
                        self.saw("F1", "OK")
                    except grpc.RpcError as error:
                        self.saw("F1", error.code(), error.details())
                self.call("F1", lambda: c._stub.TruncateSession(
                    self.pb.TruncateSessionRequest(session_id="busy", length=0), metadata=self.metadata, timeout=10))
            busy.close()

    def extend_request(self, session_id, tensors, weights=False):
        req = self.pb.ExtendRequest(return_attention_weights=weights)
        item = req.items.add(session_id=session_id)
        for name, array in tensors.items():
            getattr(item, name).CopyFrom(self.mhaclient.to_tensor(array))
        return req

    # F2: one Extend naming 100k session ids, refused before it waits.
    def name_many_sessions(self):
        req = self.pb.ExtendRequest()
        for i in range(100_000):
            req.items.add(session_id="s%d" % i)
        while self.running():
            self.call("F2", lambda: self.stub.Extend(req, timeout=10, metadata=self.metadata))
            time.sleep(0.2)

    # F3: Extends whose responses (attention weights, 16 MiB each) are large, 16 at once: 256 MiB if each call
    # allocated its buffers on arrival; admitted against --max_inflight_mb before their buffers exist instead.
    def large_responses(self):
        rng = np.random.default_rng(3)
        with self.client() as c:
            c.create_session(session_id="wide", **HEADS).extend(**qkv(rng, 1024))
            # 1024 queries attending to the 1024 cached tokens without joining them: weights [4, 1024, 1024] fp32.
            request = self.extend_request("wide", {"q": qkv(rng, 1024)["q"]}, weights=True)
            request.items[0].append = False
            while self.running():
                futures = [self.stub.Extend.future(request, timeout=10, metadata=self.metadata) for _ in range(16)]
                for future in futures:
                    try:
                        future.result()
                        self.saw("F3", "OK")
                    except grpc.RpcError as error:
                        self.saw("F3", error.code(), error.details())
                time.sleep(0.1)

    # F4: forks of a long session, over and over, and lists of them all.
    def fork_and_list(self):
        rng = np.random.default_rng(4)
        with self.client() as c:
            source = c.create_session(session_id="long", **HEADS)
            source.extend(**qkv(rng, 4096))
            while self.running():
                self.call("F4", lambda: source.fork())
                self.call("F4", lambda: c._stub.ListSessions(self.pb.ListSessionsRequest(), metadata=self.metadata,
                                                             timeout=10))

    # F5, F6: calls naming the victim's ids (in this token's scope they exist nowhere), and creating them.
    def name_the_victims_ids(self, ids):
        rng = np.random.default_rng(5)
        with self.client() as c:
            while self.running():
                for session_id in ids:
                    self.call("F5", lambda: self.stub.Extend(self.extend_request(session_id, qkv(rng, 1)),
                                                            timeout=10, metadata=self.metadata))
                    self.call("F6", lambda: c.create_session(session_id=session_id, **HEADS).close())
                time.sleep(0.01)

    # F7, F9: as many sessions as the server lets this token open, filled to evict whatever it may.
    def fill_the_pool(self):
        rng = np.random.default_rng(7)
        with self.client() as c:
            opened = []
            while self.running():
                try:
                    opened.append(c.create_session(**HEADS))
                    self.saw("F7", "OK")
                except grpc.RpcError as error:
                    self.saw("F7", error.code(), error.details())
                if opened:
                    session = opened[int(rng.integers(len(opened)))]
                    self.call("F7", lambda: session.extend(**qkv(rng, 2048)))

    # F8: KServe requests with 100k inputs.
    def kserve_many_inputs(self):
        infer = self.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        request = kserve_many_inputs(100_000)
        while self.running():
            self.call("F8", lambda: infer(request, timeout=10, metadata=self.metadata))
            time.sleep(0.2)

    def run(self, victim_ids, only=None):
        """Every attack at once, or those whose names (F1, F2, F3, F4, F5, F7, F8) are in `only`."""
        attacks = {"F1": (self.queue_behind_own_session, ()), "F2": (self.name_many_sessions, ()),
                   "F3": (self.large_responses, ()), "F4": (self.fork_and_list, ()),
                   "F5": (self.name_the_victims_ids, (victim_ids,)), "F7": (self.fill_the_pool, ()),
                   "F8": (self.kserve_many_inputs, ())}
        threads = [threading.Thread(target=attack, args=args) for name, (attack, args) in attacks.items()
                   if only is None or name in only]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {attack: dict(codes) for attack, codes in self.codes.items()}, self.examples


def main():
    target, token, seconds, stubs = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    victim_ids = sys.argv[5].split(",")
    only = sys.argv[6].split(",") if len(sys.argv) > 6 else None
    sys.path.insert(0, stubs)
    import mhaclient
    from mha.v1 import attention_pb2 as pb
    from mha.v1 import attention_pb2_grpc as pb_grpc
    codes, examples = Attacks(target, token, seconds, pb, pb_grpc, mhaclient).run(victim_ids, only)
    print(json.dumps(examples))
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
