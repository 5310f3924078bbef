"""The Python client against a server with mutual TLS and bearer tokens (certificates made here with openssl)."""

import socket
import ssl
import subprocess
import time

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest

import mhaclient
from conftest import run_server

COMPUTE_TOKEN = "compute-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789ab"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.pem")
    for name in ("server", "client"):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
            "-keyout", name + ".key", "-out", name + ".csr")
        run("x509", "-req", "-days", "2", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-extfile", "san.ext", "-out", name + ".pem")
    (d / "tokens").write_text("%s\n%s admin\n" % (COMPUTE_TOKEN, ADMIN_TOKEN))
    return d


@pytest.fixture(scope="module")
def secure_server(pki, tmp_path_factory, stubs_dir):
    with run_server(tmp_path_factory.mktemp("secure"), "--tls_cert", str(pki / "server.pem"), "--tls_key",
                    str(pki / "server.key"), "--tls_client_ca", str(pki / "ca.pem"), "--auth_tokens_file",
                    str(pki / "tokens")) as s:
        yield s


def connect(server, pki, token):
    return mhaclient.MhaClient(server.target, timeout=10.0, tls_ca=str(pki / "ca.pem"),
                               tls_cert=str(pki / "client.pem"), tls_key=(pki / "client.key").read_bytes(),
                               token=token)


def test_mutual_tls_with_a_token_computes(secure_server, pki):
    with connect(secure_server, pki, COMPUTE_TOKEN) as c:
        r = c.multi_head_attention(np.ones((1, 4, 512), np.float32), layer="demo")
        assert r.output.shape == (1, 4, 512)
        assert c.health() == "SERVING"


def test_no_token_is_unauthenticated(secure_server, pki):
    with connect(secure_server, pki, None) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.list_layers()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in err.value.details()
        assert c.health() == "SERVING"  # health needs no token
        assert c.health() == "SERVING"  # health needs no token


def test_compute_token_may_not_unload(secure_server, pki):
    with connect(secure_server, pki, COMPUTE_TOKEN) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.unload_layer("demo")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_admin_token_reaches_layer_management(secure_server, pki):
    with connect(secure_server, pki, ADMIN_TOKEN) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.unload_layer("demo")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # allowed in, refused for the built-in layer


def unfinished_call_over_tls(server, pki, headers, mib):
    """Opens one MultiHeadAttention call over mutual TLS with `headers` added, sends the first 64 KiB of a message
    that says `mib` MiB and waits up to 5 s for the server's answer: its grpc-status, "waiting" if none came (the
    server waits for the rest), "reset" or "closed" if the stream or the connection ended without one."""
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    context.set_alpn_protocols(["h2"])
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", server.port), timeout=5),
                               server_hostname="localhost")
    with sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":scheme", "https"), (":authority", "localhost"),
                              (":path", "/mha.v1.Attention/MultiHeadAttention"), ("content-type", "application/grpc"),
                              ("te", "trailers"), *headers])
        start = b"\x00" + (mib << 20).to_bytes(4, "big") + bytes(65530)
        for offset in range(0, len(start), 16384):
            conn.send_data(1, start[offset:offset + 16384])
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                received = sock.recv(1 << 16)
            except socket.timeout:
                return "waiting"
            if not received:
                return "closed"
            for event in conn.receive_data(received):
                fields = dict(getattr(event, "headers", []) or [])
                if "grpc-status" in fields:
                    return int(fields["grpc-status"])
                if isinstance(event, h2.events.StreamReset):
                    return "reset"
            sock.sendall(conn.data_to_send())
    return "waiting"


def test_a_call_without_a_token_is_refused_before_its_message_arrives(secure_server, pki):
    # TokenGate answers on the metadata: UNAUTHENTICATED (16) while 16 MiB of message are still to come. Without
    # it the handler, and so the token check, waited for the whole message: no answer at all.
    assert unfinished_call_over_tls(secure_server, pki, [], 16) == 16
    assert unfinished_call_over_tls(secure_server, pki, [("authorization", "Bearer not-a-token-0123456789")], 16) == 16
    # A valid token passes the gate: the server waits for the rest of the message.
    assert unfinished_call_over_tls(secure_server, pki, [("authorization", "Bearer " + COMPUTE_TOKEN)], 16) == "waiting"
