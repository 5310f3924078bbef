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
import signal
import subprocess
import time

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
    """Another mha_server on a free loopback port, stopped (SIGTERM to its own PID) after the test."""
    binary = _e2e._server_binary()
    port_file = tmp_path / "port2"
    log_path = tmp_path / "server2.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port_file", str(port_file), "--threads", "1",
                                 "--log_max_calls_per_s", "0"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _e2e.STARTUP_TIMEOUT_S
        port = None
        while time.monotonic() < deadline and not port:
            if proc.poll() is not None:
                pytest.fail("second mha_server exited during startup:\n" + _e2e._log_tail(log_path))
            try:
                port = int(port_file.read_text().strip() or 0)
            except (OSError, ValueError):
                port = None
            time.sleep(0.05)
        if not port:
            pytest.fail("second mha_server wrote no port file:\n" + _e2e._log_tail(log_path))
        yield _e2e.Server(proc, port, "127.0.0.1:%d" % port, str(log_path))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_e2e.SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
