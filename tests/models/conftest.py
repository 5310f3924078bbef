"""The model checks' server: the mha_server under test (MHA_SERVER_BIN) on a free loopback port, one per module,
and a client of it (the Python client, with stubs generated for this environment's protobuf)."""

import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import mhaclient  # noqa: E402
from local_server import local_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    """(target, MhaClient) of a server that lives as long as the module's tests."""
    with tempfile.TemporaryDirectory() as work, local_server(os.environ["MHA_SERVER_BIN"], work) as target:
        sys.path.insert(0, mhaclient.generate_stubs(os.path.join(work, "stubs")))
        client = mhaclient.MhaClient(target, timeout=60.0)
        client.wait_ready(timeout=30)
        yield target, client
        client.close()


@pytest.fixture(scope="module")
def client(server):
    return server[1]
