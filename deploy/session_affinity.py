"""Sessions through a proxy that routes by the session id (deploy/scale-out-test.sh's sessions phases).

    session_affinity.py decode TARGET SESSIONS     create SESSIONS head sessions with ids the client chooses, prefill
                                                   each, decode steps; every call must succeed
    session_affinity.py step TARGET SESSIONS       one more decode step on each; prints a JSON object of the ids that
                                                   failed, by gRPC status code name, and how many succeeded
    session_affinity.py homes SESSIONS LOG...      from the replicas' logs (replica N's is the Nth LOG), one "id N"
                                                   line per session; exits 1 unless every session is in exactly one
    session_affinity.py lost HOMES REPLICA STEP    exits 0 when the step's JSON (STEP) failed exactly the sessions
                                                   that HOMES puts on REPLICA, each with NOT_FOUND or UNAVAILABLE,
                                                   and every other session succeeded; prints a summary line
    session_affinity.py busiest LOG...             the replica (N for the Nth LOG) where `mha_client decode` created
                                                   the most sessions (decode-...)
    session_affinity.py recovered REPORT REPLICA LOG...
                                                   after REPLICA was killed under `mha_client decode --recover
                                                   --check -O json` (REPORT): exits 0 when the run had no errors,
                                                   every step done and the check passed, and the sessions created
                                                   again on the other replicas are exactly those REPLICA held, each
                                                   counted in the report's recoveries; prints a summary line

Every session call carries the id as mha-session-id metadata (the client library sets it), so the proxy's hash on
it sends all of a session's calls, CreateSession included, to one replica. Standard library, numpy and grpcio with
the project's Python client (PYTHONPATH=client/python and its generated stubs).
"""
import json
import re
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


def decode(client, rng, count):
    sessions = [client.create_session(session_id=sid, idle_timeout_s=600, **HEADS) for sid in session_ids(count)]
    for s in sessions:
        s.extend(**tokens(rng, 16))
    for _ in range(4):
        for s in sessions:
            s.extend(**tokens(rng, 1))
    print(json.dumps({"sessions": count, "steps": 4}))
    return 0


def step(client, rng, count):
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


def homes(count, logs):
    seen = {}
    for replica, log in enumerate(logs, start=1):
        with open(log) as f:
            for sid in set(re.findall(r"session=(affinity-\d+)", f.read())):
                seen.setdefault(sid, []).append(replica)
    split = {s: rs for s, rs in seen.items() if len(rs) > 1}
    if len(seen) != count or split:
        print(f"{len(seen)} sessions seen; on more than one replica: {split}")
        return 1
    for sid, (replica,) in sorted(seen.items()):
        print(sid, replica)
    return 0


def lost(homes_file, replica, step_file):
    with open(homes_file) as f:
        home = dict(line.split() for line in f)
    with open(step_file) as f:
        result = json.load(f)
    gone = {sid for sid, r in home.items() if r == replica}
    failed = {sid for ids in result["failed"].values() for sid in ids}
    print(f"  replica {replica} killed: {len(failed)} sessions failed "
          f"({', '.join(f'{len(ids)} {code}' for code, ids in sorted(result['failed'].items()))}), "
          f"{len(gone)} lived there; the other {result['ok']} went on")
    return 0 if (failed == gone and result["ok"] == len(home) - len(gone)
                 and set(result["failed"]) <= {"NOT_FOUND", "UNAVAILABLE"}) else 1


def created(logs):
    """Per replica (1-based), how many times each decode-... session was created there."""
    counts = {}
    for replica, log in enumerate(logs, start=1):
        with open(log) as f:
            for sid in re.findall(r"rpc=CreateSession session=(decode-[0-9a-f]+-\d+) .*status=OK", f.read()):
                per_replica = counts.setdefault(replica, {})
                per_replica[sid] = per_replica.get(sid, 0) + 1
    return counts


def busiest(logs):
    counts = created(logs)
    print(max(range(1, len(logs) + 1), key=lambda r: len(counts.get(r, {}))))
    return 0


def recovered(report_file, replica, logs):
    with open(report_file) as f:
        report = json.load(f)
    counts = created(logs)
    held = set(counts.get(replica, {}))
    rebuilt = {sid: n for r, per in counts.items() if r != replica for sid, n in per.items() if sid in held}
    moved_elsewhere = {sid for r, per in counts.items() if r != replica for sid, n in per.items()
                       if sid not in held and n > 1}
    check = report.get("check", {})
    print(f"  replica {replica} killed mid-run: it held {len(held)} of {report['sessions']} sessions, "
          f"{len(rebuilt)} rebuilt elsewhere, {report['recoveries']} recoveries; {report['decode_tokens']} of "
          f"{report['sessions'] * report['steps']} tokens decoded, {report['errors']} errors, check max error "
          f"{check.get('max_error')} (tolerance {check.get('tolerance')})")
    return 0 if (held and set(rebuilt) == held and not moved_elsewhere and report["errors"] == 0
                 and report["recoveries"] >= len(held) and report["recoveries"] == sum(rebuilt.values())
                 and report["decode_tokens"] == report["sessions"] * report["steps"]
                 and check and check["max_error"] <= check["tolerance"]) else 1


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "homes":
        return homes(int(args[0]), args[1:])
    if mode == "lost":
        return lost(*args)
    if mode == "busiest":
        return busiest(args)
    if mode == "recovered":
        return recovered(args[0], int(args[1]), args[2:])
    target, count = args[0], int(args[1])
    with mhaclient.MhaClient(target, timeout=20.0) as client:
        return {"decode": decode, "step": step}[mode](client, np.random.default_rng(7), count)


if __name__ == "__main__":
    sys.exit(main())
