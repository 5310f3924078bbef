"""The Python client against a server with mutual TLS and bearer tokens (certificates made here with openssl)."""

import subprocess

import grpc
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
