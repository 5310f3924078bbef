"""Fixtures for the end-to-end tests: Python stubs, the real mha_server binary on a loopback port, a client.

Environment:
  MHA_SERVER_BIN  server binary (default <repo>/build/bin/mha_server; a relative path is tried against the working
                  directory, then against the repository root).
  MHA_PY_STUBS    folder that already holds the generated stubs (mha/v1, grpc_health/v1); otherwise they are
                  generated into a temporary folder with mhaclient.generate_stubs.
"""

import os
import sys

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CLIENT_DIR = os.path.join(REPO_ROOT, "client", "python")
for _dir in (CLIENT_DIR, os.path.join(REPO_ROOT, "tests")):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

import mhaclient  # noqa: E402

# The tests import run_server (start_server for one they kill) from here; tests/client_e2e reaches the rest through
# this module.
from server_process import STARTUP_TIMEOUT_S, _server_binary, run_server, start_server  # noqa: E402,F401


@pytest.fixture(scope="session")
def stubs_dir(tmp_path_factory):
    given = os.environ.get("MHA_PY_STUBS")
    if given and os.path.isdir(given):
        out = os.path.abspath(given)
    else:
        out = mhaclient.generate_stubs(str(tmp_path_factory.mktemp("stubs")))
    if out not in sys.path:
        sys.path.insert(0, out)
    return out


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # Every call logged (no --log_max_calls_per_s budget): tests count the call lines of this shared server.
    with run_server(tmp_path_factory.mktemp("server"), "--max_shared_memory_regions", "4",
                    "--log_max_calls_per_s", "0") as s:
        yield s


@pytest.fixture(scope="session")
def client(stubs_dir, server):
    c = mhaclient.MhaClient(server.target, timeout=30.0)
    c.wait_ready(timeout=STARTUP_TIMEOUT_S)
    yield c
    c.close()
