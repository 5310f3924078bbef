"""What a client without a token can reach or make the server hold before any check of ours runs (issue #38), one
finding per test, bounded to loopback and seconds.
- Compressed requests: gRPC inflates a message before any handler sees it, so the server refuses compression
  unless --accept_compressed, and then --max_message_mb bounds the inflated size.
- Reflection: never on the health-only port, and not served where tokens are required.
- Error messages: cut at 2 KiB, however much of a request they would echo.
- Metrics: idle TCP connections hold a scrape for at most civetweb's 2 s request timeout.
"""

import socket
import time
import urllib.request

import grpc
import numpy as np
import pytest

from conftest import run_server


def peak_rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/%d/status" % pid)


def zeros_request(mib):
    """A MultiHeadAttention request on the demo layer whose query is `mib` MiB of zeros (gzip makes it ~1000x
    smaller)."""
    from mha.v1 import attention_pb2 as pb
    tokens = mib * (1 << 20) // (4 * 512)
    request = pb.MultiHeadAttentionRequest(layer="demo")
    request.query.shape.extend([1, tokens, 512])
    request.query.dtype = pb.FP32
    request.query.data = bytes(tokens * 512 * 4)
    return request


def call_gzip(target, request):
    from mha.v1 import attention_pb2_grpc as pbg
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30),
                                                ("grpc.max_receive_message_length", 1 << 30)]) as channel:
        return pbg.AttentionStub(channel).MultiHeadAttention(request, compression=grpc.Compression.Gzip, timeout=60)


def test_a_compressed_request_is_refused_before_it_is_inflated(tmp_path, stubs_dir):
    # A server of its own: its peak RSS is the warm-up's, which 128 MiB inflated would pass by far.
    with run_server(tmp_path) as s:
        before = peak_rss_mib(s.proc.pid)
        with pytest.raises(grpc.RpcError) as error:
            call_gzip(s.target, zeros_request(128))   # 128 MiB inflated, about 130 KiB sent
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "gzip" in error.value.details()
        assert peak_rss_mib(s.proc.pid) - before < 32   # the 128 MiB were never made


def test_accept_compressed_computes_and_bounds_the_inflated_size(tmp_path, stubs_dir):
    with run_server(tmp_path, "--accept_compressed", "--max_message_mb", "16") as s:
        response = call_gzip(s.target, zeros_request(1))
        assert list(response.output.shape) == [1, 512, 512]
        out = np.frombuffer(response.output.data, dtype=np.float32)
        assert np.all(np.isfinite(out))
        with pytest.raises(grpc.RpcError) as error:
            call_gzip(s.target, zeros_request(32))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in error.value.details()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reflection_code(target, metadata=()):
    """The status of a reflection call listing the services (grpc.reflection.v1alpha, the version gRPC 1.51 serves),
    made without the reflection package: the request is field 7, list_services, empty."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                     request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            replies = list(call(iter([b"\x3a\x00"]), timeout=10, metadata=metadata))
            return grpc.StatusCode.OK if replies else None
        except grpc.RpcError as e:
            return e.code()


def test_reflection_is_served_where_no_token_is_needed(server):
    assert reflection_code(server.target) == grpc.StatusCode.OK


def test_the_health_only_port_serves_health_alone(tmp_path):
    port = free_port()
    with run_server(tmp_path, "--health_listen", "127.0.0.1:%d" % port) as s:
        health = "127.0.0.1:%d" % port
        assert reflection_code(health) == grpc.StatusCode.UNIMPLEMENTED
        assert reflection_code(s.target) == grpc.StatusCode.OK


def test_with_tokens_required_reflection_is_not_served(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("compute-token-0123456789\n")
    with run_server(tmp_path, "--auth_tokens_file", str(tokens)) as s:
        assert reflection_code(s.target) == grpc.StatusCode.UNIMPLEMENTED
        assert reflection_code(s.target, [("authorization", "Bearer compute-token-0123456789")]) == \
            grpc.StatusCode.UNIMPLEMENTED


def test_an_error_about_a_huge_shape_is_a_short_invalid_argument(server, stubs_dir):
    # A rank-1,000,000 query: the message naming its shape made 3-15 MB, over the client's 8 KiB trailer limit.
    from mha.v1 import attention_pb2 as pb, attention_pb2_grpc as pbg
    request = pb.MultiHeadAttentionRequest(layer="demo")
    request.query.shape.extend([1] * 1000000)
    request.query.dtype = pb.FP32
    request.query.data = bytes(4)
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as error:
            pbg.AttentionStub(channel).MultiHeadAttention(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert error.value.details().startswith("query")
    assert len(error.value.details()) <= 2100


def scrape_seconds(port):
    start = time.monotonic()
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=40).read().decode()
    assert "mha_requests_total" in text or "mha_queue_depth" in text
    return time.monotonic() - start


@pytest.mark.parametrize("idle", [4, 12])
def test_idle_connections_hold_a_metrics_scrape_for_at_most_two_seconds(tmp_path, idle):
    port = free_port()
    with run_server(tmp_path, "--metrics_listen", "127.0.0.1:%d" % port):
        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
        try:
            time.sleep(0.2)
            assert scrape_seconds(port) < 4.0
        finally:
            for s in sockets:
                s.close()

