"""The Python client's Extends over ExtendStream: a session's steps share one stream and answer as unary calls do,
a stream carries one session's steps (for proxies that route by session), a failed step costs only its stream, a
client holds at most its cap of streams, a server without the method is asked by unary calls, and a client on the
same host reaches the server's --listen_unix socket.
"""

import os
import re
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

import mhaclient
from conftest import STARTUP_TIMEOUT_S, run_server

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def qkv(n, seed):
    rng = np.random.default_rng(seed)
    return dict(q=rng.standard_normal((n, 4, 16), dtype=np.float32),
                k=rng.standard_normal((n, 2, 16), dtype=np.float32),
                v=rng.standard_normal((n, 2, 16), dtype=np.float32))


def stream_steps(log_path, session_id):
    with open(log_path, errors="replace") as log:
        return sum(1 for line in log if re.search(r"rpc=ExtendStream .*session=%s " % session_id, line))


def test_a_sessions_steps_go_over_one_stream_and_answer_as_unary_calls(stubs_dir, server):
    with mhaclient.MhaClient(server.target) as streamed, \
            mhaclient.MhaClient(server.target, max_extend_streams=0) as unary:
        a, b = streamed.create_session(**HEADS), unary.create_session(**HEADS)
        for i, n in enumerate([9, 1, 1, 4, 1]):
            got, want = a.extend(**qkv(n, i)), b.extend(**qkv(n, i))
            assert got.length == want.length
            np.testing.assert_array_equal(got.output, want.output)
        assert streamed._streams._opened == 1
        assert stream_steps(server.log_path, a.id) == 5
        assert stream_steps(server.log_path, b.id) == 0


def test_a_stream_carries_one_sessions_steps(stubs_dir, server):
    # A routing proxy sends a whole stream where its mha-session-id hashes: another session's step must not ride it.
    with mhaclient.MhaClient(server.target) as client:
        sessions = [client.create_session(**HEADS) for _ in range(3)]
        for step in range(4):
            for session in sessions:
                session.extend(**qkv(1, step))
        assert client._streams._opened == 3
    carried = {}
    with open(server.log_path, errors="replace") as log:
        for line in log:
            m = re.search(r"rid=(\S+)\.\d+ rpc=ExtendStream .*session=(\S+) ", line)
            if m and m.group(2) in {s.id for s in sessions}:
                carried.setdefault(m.group(1), set()).add(m.group(2))
    assert len(carried) == 3 and all(len(ids) == 1 for ids in carried.values()), carried


def test_a_failed_step_ends_only_its_stream(stubs_dir, server):
    with mhaclient.MhaClient(server.target) as client:
        session = client.create_session(**HEADS)
        session.extend(**qkv(2, 1))
        with pytest.raises(grpc.RpcError) as error:
            client.extend([dict(session="no-such-session", **qkv(1, 2))])
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-session" in error.value.details()
        assert session.extend(**qkv(1, 3)).length == 3


def test_a_client_holds_at_most_its_cap_of_streams(stubs_dir, server):
    with mhaclient.MhaClient(server.target, max_extend_streams=3) as client:
        sessions = [client.create_session(**HEADS) for _ in range(6)]

        def decode(session):
            for step in range(20):
                assert session.extend(**qkv(1, step)).length == step + 1

        with futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(decode, sessions))
        assert client._streams._opened <= 3
        assert threading.active_count() < 20  # no thread left behind per session


def test_a_server_without_extend_stream_is_asked_by_unary_calls(stubs_dir):
    from mha.v1 import attention_pb2

    calls = []

    def extend(request, context):
        calls.append(request.items[0].session_id)
        return attention_pb2.ExtendResponse(results=[attention_pb2.ExtendResult(length=7)])

    handler = grpc.method_handlers_generic_handler("mha.v1.Attention", {
        "Extend": grpc.unary_unary_rpc_method_handler(
            extend, request_deserializer=attention_pb2.ExtendRequest.FromString,
            response_serializer=attention_pb2.ExtendResponse.SerializeToString)})
    fake = grpc.server(futures.ThreadPoolExecutor(2))
    fake.add_generic_rpc_handlers((handler,))
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    try:
        with mhaclient.MhaClient("127.0.0.1:%d" % port) as client:
            for _ in range(2):
                assert client.extend([dict(session="s", **qkv(1, 0))])[0].length == 7
            assert calls == ["s", "s"]
            assert not client._streams.streaming
    finally:
        fake.stop(0)


def test_a_client_on_the_same_host_reaches_the_unix_socket(stubs_dir, tmp_path):
    socket = str(tmp_path / "mha.sock")
    with run_server(tmp_path, "--listen_unix", socket) as s:
        with mhaclient.MhaClient("unix:" + socket) as local, mhaclient.MhaClient(s.target) as remote:
            local.wait_ready(timeout=STARTUP_TIMEOUT_S)
            session = local.create_session(**HEADS)
            session.extend(**qkv(3, 0))
            assert [info["session_id"] for info in remote.list_sessions()] == [session.id]
            assert os.stat(socket).st_mode & 0o170000 == 0o140000  # a socket


def test_a_stream_that_ended_while_idle_does_not_fail_the_next_step(stubs_dir, tmp_path):
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    with run_server(tmp_path / "first") as first:
        port = first.port
        client = mhaclient.MhaClient(first.target)
        client.create_session(session_id="same-id", **HEADS).extend(**qkv(4, 0))
    with client, run_server(tmp_path / "again", listen="127.0.0.1:%d" % port):
        client.wait_ready(timeout=STARTUP_TIMEOUT_S)
        session = client.create_session(session_id="same-id", **HEADS)
        assert session.extend(**qkv(4, 1)).length == 4  # not the ended stream's UNAVAILABLE


def test_bytes_that_do_not_parse_end_the_stream_and_the_server_serves_on(stubs_dir, server):
    with grpc.insecure_channel(server.target) as channel:
        raw = channel.stream_stream("/mha.v1.Attention/ExtendStream", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.RpcError) as error:
            list(raw(iter([b"\xff\xff\xff\xff not a message"]), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not parse as mha.v1.ExtendRequest" in error.value.details()
    with mhaclient.MhaClient(server.target) as client:
        assert client.create_session(**HEADS).extend(**qkv(2, 0)).length == 2


def test_a_client_that_writes_ahead_and_never_reads_is_held_back(stubs_dir, server):
    # Each answer carries the weights over an 8192-token cache (128 KiB): answers the client does not read fill the
    # transport's windows, the server's write waits, and it takes no further step meanwhile (the steps the client
    # sent wait in gRPC's transport, within its flow-control window and --grpc_memory_mb).
    with mhaclient.MhaClient(server.target) as client:
        session = client.create_session(**HEADS)
        session.extend(**qkv(8192, 0))
        pb = client._pb
        step = pb.ExtendRequest(return_attention_weights=True, items=[pb.ExtendItem(
            session_id=session.id, append=False, q=mhaclient.to_tensor(qkv(1, 1)["q"]))])
        call = client._stub.ExtendStream(iter([step] * 400), timeout=30)
        time.sleep(3)
        with open(server.log_path, errors="replace") as log:
            answered = sum(1 for line in log if "rpc=ExtendStream" in line and session.id in line)
        call.cancel()
        assert answered < 200, answered  # bounded by the windows' bytes, not by what the client sent
        assert session.extend(**qkv(1, 2)).length == 8193  # the session serves on


def test_a_step_that_raises_anything_gives_its_streams_place_back(stubs_dir, server, monkeypatch):
    with mhaclient.MhaClient(server.target, max_extend_streams=1) as client:
        session = client.create_session(**HEADS)
        session.extend(**qkv(2, 0))

        def interrupted(self, req):
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(mhaclient._ExtendStream, "step", interrupted)
            with pytest.raises(KeyboardInterrupt):
                session.extend(**qkv(1, 1))
        assert client._streams._opened == 0
        assert session.extend(**qkv(1, 2)).length == 3
        assert client._streams._opened == 1
