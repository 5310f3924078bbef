"""Recovery of lost KV-cache sessions (MhaClient.create_session(recover=...)) against the real server.

A recording session whose server is killed and restarted on the same port mid-decode, or whose session is closed
behind its back, is re-created under its id, its record replayed and the failed call sent again: its outputs must
equal an uninterrupted session's bit for bit. Forks and truncations keep the record consistent; a record past its
byte bound is dropped (the error then comes back as it is); a server that never returns ends the attempts.
Loopback only; the servers killed here are this test's own, by PID.
"""

import contextlib
import time

import grpc
import numpy as np
import pytest

import mhaclient
from conftest import STARTUP_TIMEOUT_S, run_server, start_server

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, num_layers=2, cache_dtype="bf16")
LAYER = dict(layers=["demo", "demo"])  # the built-in layer twice: two caches, d_model 512
PREFILL, STEPS = 40, 10


def _calls(kind, seed, prefill=PREFILL, steps=STEPS):
    """Inputs of a decode: one prefill call, then `steps` one-token calls; each call a list of per-cache kwargs."""
    rng = np.random.default_rng(seed)

    def inputs(n):
        if kind == "layer":
            return dict(x=rng.standard_normal((n, 512)).astype(np.float32))
        return dict(q=rng.standard_normal((n, 4, 16)).astype(np.float32),
                    k=rng.standard_normal((n, 2, 16)).astype(np.float32),
                    v=rng.standard_normal((n, 2, 16)).astype(np.float32))

    return [[inputs(n) for _ in range(2)] for n in [prefill] + [1] * steps]


def _decode(session, calls, before=None):
    """Every call's every cache, in order; before(step, layer) runs ahead of each. Returns the outputs in order."""
    outputs = []
    for step, per_layer in enumerate(calls):
        for layer, inputs in enumerate(per_layer):
            if before is not None:
                before(step, layer)
            outputs.append(session.extend(layer, **inputs).output)
    return outputs


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg="output %d" % i)


def _close_behind_its_back(client, session_id):
    """CloseSession from a handle that does not record: the recording one finds its session gone."""
    mhaclient.Session(client, client._pb.SessionInfo(session_id=session_id)).close()


@pytest.mark.parametrize("kind", ["heads", "layer"])
def test_a_session_on_a_restarted_server_decodes_on_exactly(kind, stubs_dir, tmp_path):
    config = HEADS if kind == "heads" else LAYER
    calls = _calls(kind, seed=11)
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    first = start_server(tmp_path / "first", "--threads", "1")
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: first.proc.poll() is None and (first.proc.kill(), first.proc.wait()))
        client = stack.enter_context(mhaclient.MhaClient(first.target, timeout=30.0))
        client.wait_ready(timeout=STARTUP_TIMEOUT_S)
        want = _decode(client.create_session(session_id="uninterrupted-" + kind, **config), calls)
        session = client.create_session(session_id="recovering-" + kind, recover=True, **config)

        def restart(step, layer):
            # Between the two caches of step 4: the record holds one more token at cache 0 than at cache 1.
            if (step, layer) == (4, 1):
                first.proc.kill()
                first.proc.wait()
                stack.enter_context(run_server(tmp_path / "again", "--threads", "1", listen=first.target))

        got = _decode(session, calls, before=restart)
        assert session.recoveries == 1
        assert session.lengths() == [PREFILL + STEPS] * 2
        _assert_same(got, want)


def test_a_session_closed_behind_its_back_is_rebuilt_with_its_fork_and_truncation(client):
    calls = _calls("heads", seed=12)
    plain = client.create_session(session_id="closed-plain", **HEADS)
    session = client.create_session(session_id="closed-recovering", recover=True, **HEADS)
    want, got = _decode(plain, calls[:4]), _decode(session, calls[:4])
    _close_behind_its_back(client, session.id)
    plain.truncate(PREFILL + 1)
    session.truncate(PREFILL + 1)  # finds the session gone: rebuilt, then cut
    assert session.recoveries == 1 and session.lengths() == [PREFILL + 1] * 2
    plain_fork, fork = plain.fork("closed-plain-fork"), session.fork("closed-recovering-fork")
    want += _decode(plain, calls[4:6]) + _decode(plain_fork, calls[6:8])
    got += _decode(session, calls[4:6])
    _close_behind_its_back(client, fork.id)
    got += _decode(fork, calls[6:8])  # the fork's record: the parent's tokens up to the fork
    assert fork.recoveries == 1 and session.recoveries == 1
    _close_behind_its_back(client, session.id)
    want += _decode(plain, calls[8:])
    got += _decode(session, calls[8:])
    assert session.recoveries == 2
    _assert_same(got, want)
    for s in (plain, plain_fork, session, fork):
        s.close()


def test_a_batched_call_rebuilds_only_the_sessions_that_were_lost(client):
    calls_a, calls_b = _calls("heads", seed=13, steps=2), _calls("heads", seed=14, steps=2)
    plain = [client.create_session(session_id="batch-plain-%d" % i, **HEADS) for i in range(2)]
    rec = [client.create_session(session_id="batch-rec-%d" % i, recover=True, **HEADS) for i in range(2)]

    def batch(sessions, step):
        return [r.output for layer in range(2) for r in client.extend(
            [dict(session=s, **calls[step][layer]) for s, calls in zip(sessions, (calls_a, calls_b))], layer)]

    want = [o for step in range(3) for o in batch(plain, step)]
    got = batch(rec, 0)
    _close_behind_its_back(client, rec[1].id)
    got += batch(rec, 1) + batch(rec, 2)
    assert [s.recoveries for s in rec] == [0, 1]  # rec[0] answered ALREADY_EXISTS after NOT_FOUND: kept
    _assert_same(got, want)
    for s in plain + rec:
        s.close()


def test_a_record_past_its_bound_is_dropped_and_the_error_comes_back(client):
    session = client.create_session(session_id="bounded", recover=mhaclient.Recovery(max_record_bytes=4096), **HEADS)
    calls = _calls("heads", seed=15, steps=1)
    _decode(session, calls[:1])  # 40 tokens of k and v, 2 x 40 x 2 x 16 x 4 bytes per cache: past 4096
    assert not session.recovering
    _close_behind_its_back(client, session.id)
    with pytest.raises(grpc.RpcError) as error:
        _decode(session, calls[1:])
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert session.recoveries == 0


def test_recovery_gives_up_when_no_server_comes_back(stubs_dir, tmp_path):
    lost = start_server(tmp_path, "--threads", "1")
    try:
        with mhaclient.MhaClient(lost.target, timeout=5.0) as client:
            client.wait_ready(timeout=STARTUP_TIMEOUT_S)
            recovery = mhaclient.Recovery(attempts=2, backoff_s=0.05, reconnect_timeout_s=0.5)
            session = client.create_session(session_id="gone", recover=recovery, **HEADS)
            calls = _calls("heads", seed=16, steps=1)
            _decode(session, calls[:1])
            lost.proc.kill()
            lost.proc.wait()
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                _decode(session, calls[1:])
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - start < 10
            assert session.recoveries == 0
    finally:
        if lost.proc.poll() is None:
            lost.proc.kill()
            lost.proc.wait()
