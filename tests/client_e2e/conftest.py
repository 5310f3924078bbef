"""Fixtures for the mha_client end-to-end tests: the real mha_server and mha_client binaries on loopback.

The server, stubs and Python client fixtures are the ones of tests/python/conftest.py (loaded from there, not
copied). Added here: the mha_client binary, a helper that runs it, and a second server for round-robin tests.

Environment:
  MHA_SERVER_BIN  server binary (see tests/python/conftest.py)
  MHA_CLIENT_BIN  client binary (default <repo>/build/bin/mha_client)
"""

import collections
import importlib.util
import os
import subprocess

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("mha_e2e_conftest", os.path.join(_HERE, "..", "python", "conftest.py"))
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)

# Re-exported fixtures: one server per test session, shared by every test here.
stubs_dir = _e2e.stubs_dir
server = _e2e.server
client = _e2e.client

REPO_ROOT = _e2e.REPO_ROOT
CLI_TIMEOUT_S = 120

Result = collections.namedtuple("Result", ["returncode", "stdout", "stderr"])


@pytest.fixture(scope="session")
def cli_bin():
    path = os.environ.get("MHA_CLIENT_BIN") or os.path.join(REPO_ROOT, "build", "bin", "mha_client")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail("mha_client binary not found at %s; build it or set MHA_CLIENT_BIN" % path)
    return path


@pytest.fixture(scope="session")
def run_cli(cli_bin):
    """run_cli(*args) runs mha_client with args (strings) and returns Result(returncode, stdout, stderr)."""

    def run(*args):
        proc = subprocess.run([cli_bin] + [str(a) for a in args], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_S)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture
def second_server(tmp_path):
    """Another mha_server on a free loopback port (one compute thread, every call logged), stopped by SIGTERM to its
    own PID after the test."""
    with _e2e.run_server(tmp_path, "--threads", "1", "--log_max_calls_per_s", "0") as s:
        yield s
