"""The real mha_server as a process for the Python tests (tests/python, tests/interop): on a free loopback port,
its log kept, stopped with SIGTERM. Standard library and pytest only, so that any test environment can import it.

Environment:
  MHA_SERVER_BIN  server binary (default <repo>/build/bin/mha_server; a relative path is tried against the working
                  directory, then against the repository root).
"""

import collections
import contextlib
import os
import resource
import signal
import subprocess
import time

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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



def start_server(work, *args, listen="127.0.0.1:0", nofile=None):
    """Starts the real mha_server listening on `listen` (a free loopback port by default) with extra flags `args`,
    its log in `work`, and returns a Server once it has written its port file. Stopping it is the caller's: by its
    PID, server.proc. If it exits or writes no port file in time, it is ended and the test fails."""
    binary = _server_binary()
    port_file = work / "port"
    log_path = work / "server.log"
    if port_file.exists():
        port_file.unlink()  # a restart in the same folder: the new process writes it again
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary, "--listen", listen, "--port_file", str(port_file), "--threads", "2", *args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
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
            return Server(proc, port, "127.0.0.1:%d" % port, str(log_path))
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    pytest.fail("mha_server wrote no port file within %.0f s:\n%s" % (STARTUP_TIMEOUT_S, _log_tail(log_path)))


@contextlib.contextmanager
def run_server(work, *args, listen="127.0.0.1:0", nofile=None):
    """start_server as a context: yields the Server and checks that SIGTERM ends it with exit code 0. `nofile` sets
    its open-file limit (soft and hard)."""
    server = start_server(work, *args, listen=listen, nofile=nofile)
    proc, log_path = server.proc, server.log_path
    try:
        yield server
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
