"""Fixtures for the end-to-end tests: Python stubs, the real mha_server binary on a loopback port, a client.

Environment:
  MHA_SERVER_BIN  server binary (default <repo>/build/bin/mha_server; a relative path is tried against the working
                  directory, then against the repository root).
  MHA_PY_STUBS    folder that already holds the generated stubs (mha/v1, grpc_health/v1); otherwise they are
                  generated into a temporary folder with mhaclient.generate_stubs.
"""

import collections
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CLIENT_DIR = os.path.join(REPO_ROOT, "client", "python")
if CLIENT_DIR not in sys.path:
    sys.path.insert(0, CLIENT_DIR)

import mhaclient  # noqa: E402

STARTUP_TIMEOUT_S = 20.0
SHUTDOWN_TIMEOUT_S = 20.0

Server = collections.namedtuple("Server", ["proc", "port", "target", "log_path"])


def _server_binary():
    path = os.environ.get("MHA_SERVER_BIN") or os.path.join("build", "bin", "mha_server")
    candidates = [path] if os.path.isabs(path) else [os.path.abspath(path), os.path.join(REPO_ROOT, path)]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("mha_server binary not found (tried %s); build it or set MHA_SERVER_BIN" % ", ".join(candidates))


def _log_tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "<no log>"


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


@contextlib.contextmanager
def run_server(work, *args, nofile=None):
    """The real mha_server on a free loopback port with extra flags `args`, its log in `work`; yields a Server and
    checks that SIGTERM ends it with exit code 0. `nofile` sets its open-file limit (soft and hard)."""
    binary = _server_binary()
    port_file = work / "port"
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", "--port_file", str(port_file), "--threads", "2", *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    try:
        port = None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("mha_server exited with %s during startup:\n%s" % (proc.returncode, _log_tail(log_path)))
            try:
                text = port_file.read_text().strip()
                port = int(text) if text else None
            except (OSError, ValueError):
                port = None
            if port:
                break
            time.sleep(0.05)
        if not port:
            pytest.fail("mha_server wrote no port file within %.0f s:\n%s" % (STARTUP_TIMEOUT_S, _log_tail(log_path)))
        yield Server(proc, port, "127.0.0.1:%d" % port, str(log_path))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail("mha_server did not stop within %.0f s of SIGTERM:\n%s"
                            % (SHUTDOWN_TIMEOUT_S, _log_tail(log_path)))
    assert proc.returncode == 0, "mha_server exited with %s after SIGTERM:\n%s" % (
        proc.returncode, _log_tail(log_path))


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
