"""Sessions through a proxy that routes by the session id (deploy/scale-out-test.sh's sessions phase).

    session_affinity.py TARGET SESSIONS decode   create SESSIONS head sessions with ids the client chooses, prefill
                                                 each, decode steps; every call must succeed
    session_affinity.py TARGET SESSIONS step     one more decode step on each; prints a JSON object of the ids that
                                                 failed, by gRPC status code name, and how many succeeded

Every session call carries the id as mha-session-id metadata (the client library sets it), so the proxy's hash on
it sends all of a session's calls, CreateSession included, to one replica. Standard library, numpy and grpcio with
the project's Python client (PYTHONPATH=client/python and its generated stubs).
"""
import json
import sys

import grpc
import numpy as np

import mhaclient

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def tokens(rng, n):
    return {"q": rng.standard_normal((n, 4, 16)).astype(np.float32),
            "k": rng.standard_normal((n, 2, 16)).astype(np.float32),
            "v": rng.standard_normal((n, 2, 16)).astype(np.float32)}


def session_ids(count):
    return ["affinity-%02d" % i for i in range(count)]


def main():
    target, count, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = np.random.default_rng(7)
    with mhaclient.MhaClient(target, timeout=20.0) as client:
        if mode == "decode":
            sessions = [client.create_session(session_id=sid, idle_timeout_s=600, **HEADS)
                        for sid in session_ids(count)]
            for s in sessions:
                s.extend(**tokens(rng, 16))
            for _ in range(4):
                for s in sessions:
                    s.extend(**tokens(rng, 1))
            print(json.dumps({"sessions": count, "steps": 4}))
            return 0
        failed, ok = {}, 0
        for sid in session_ids(count):
            item = dict(session=sid, **tokens(rng, 1))
            try:
                client.extend([item])
                ok += 1
            except grpc.RpcError as e:
                failed.setdefault(e.code().name, []).append(sid)
        print(json.dumps({"ok": ok, "failed": failed}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
