"""The two programs as processes, as a new user meets them: what --version and --help print, exit codes of command
lines abseil cannot parse, listen addresses the server refuses with one line of its own, and how fast the server
exits on SIGTERM, idle or with a call in flight, over repeated starts and stops.
"""

import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import _e2e

VERSION_LINE = r"^{} \d+\.\d+\.\d+ \(git ([0-9a-f]{{12}}(-dirty)?|unknown), \w+ build\)\n$"


def run(binary, *args, timeout=60):
    return subprocess.run([binary, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("program", ["mha_server", "mha_client"])
def test_version_names_the_project_version_revision_and_build_type(program, cli_bin):
    binary = _e2e._server_binary() if program == "mha_server" else cli_bin
    r = run(binary, "--version")
    assert r.returncode == 0, r.stderr
    assert re.match(VERSION_LINE.format(program), r.stdout), r.stdout


def test_client_help_groups_flags_by_subcommand_without_build_paths(run_cli):
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for title in ("Every subcommand:", "call, bench, plot, heads: the request", "bench: the load test", "decode: KV-cache"):
        assert "\n" + title in r.stdout, r.stdout
    assert "  --target (default 127.0.0.1:50051)\n" in r.stdout
    assert "/" not in "".join(line for line in r.stdout.splitlines() if "Flags from" in line)
    assert "Flags from" not in r.stdout


def test_server_help_names_its_flags_file_relative_to_the_repository():
    r = run(_e2e._server_binary(), "--help")
    assert r.returncode == 0, r.stderr
    assert "\n  Flags from server/config/flags.cc:\n" in r.stdout, r.stdout[:300]


@pytest.mark.parametrize("args, message", [
    (["--bogus", "1"], "ERROR: Unknown command line flag 'bogus'"),
    (["call", "--batch", "abc"], "Illegal value 'abc' specified for flag 'batch'"),
    (["bench", "-c", "x"], "Illegal value 'x' specified for flag 'c'"),
])
def test_flags_abseil_cannot_parse_exit_2(run_cli, args, message):
    r = run_cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


@pytest.mark.parametrize("listen, message", [
    ("127.0.0.1:99999", '--listen "127.0.0.1:99999": port "99999" is not a number in [0, 65535]'),
    ("127.0.0.1:-1", '--listen "127.0.0.1:-1": port "-1" is not a number in [0, 65535]'),
    ("nonsense", '--listen "nonsense": no port'),
    (":50051", '--listen ":50051": no host'),
    ("::1:50051", "an IPv6 address needs brackets"),
    ("[::1:50051", "no ']' after the IPv6 address"),
    ("192.0.2.1:50051", "--listen 192.0.2.1:50051: 192.0.2.1 is not an address of this machine"),
])
def test_server_refuses_a_listen_address_it_cannot_serve_in_one_line(listen, message):
    r = run(_e2e._server_binary(), "--listen", listen)
    assert r.returncode == 1
    lines = (r.stdout + r.stderr).splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("flag", ["--health_listen", "--metrics_listen"])
def test_server_checks_its_other_listen_addresses_too(flag):
    r = run(_e2e._server_binary(), "--listen", "127.0.0.1:0", flag, "127.0.0.1:70000")
    assert r.returncode == 1
    assert '%s "127.0.0.1:70000": port "70000" is not a number in [0, 65535]' % flag in r.stderr + r.stdout


def test_a_port_in_use_is_reported_by_the_server_alone():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = run(_e2e._server_binary(), "--listen", "127.0.0.1:%d" % port)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 1
    assert len(lines) == 1, lines  # gRPC core's own error line would come first
    assert "--listen 127.0.0.1:%d: port %d is in use by another process" % (port, port) in lines[0]


def stop_and_time(proc, limit_s):
    """SIGTERM to our own server; seconds until it exited (it must exit 0 within limit_s)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("mha_server still running %.0f s after SIGTERM" % limit_s)
    assert code == 0
    return time.monotonic() - start


def test_sigterm_ends_an_idle_server_within_a_second_every_time(tmp_path, run_cli):
    times = []
    for i in range(5):
        (tmp_path / str(i)).mkdir()
        with _e2e.run_server(tmp_path / str(i)) as server:
            assert run_cli("health", "--target", server.target).returncode == 0
            times.append(stop_and_time(server.proc, 30))
    assert max(times) < 1.0, times


def test_sigterm_with_a_call_in_flight_ends_the_server_within_its_grace_every_time(tmp_path, cli_bin):
    # gRPC 1.51's teardown joins an executor thread that may sit in a 10 s poll: before the server skipped it, one
    # exit in five here took about 11 s (this test failed 1 run in 2 with 8 stops).
    grace_s = 1.0
    times = []
    for i in range(12):
        (tmp_path / str(i)).mkdir()
        with _e2e.run_server(tmp_path / str(i), "--shutdown_grace_s", str(grace_s)) as server:
            call = subprocess.Popen([cli_bin, "call", "--target", server.target, "--batch", "4", "--seq", "4096"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.8)
            times.append(stop_and_time(server.proc, 30))
            call.wait(timeout=60)
    assert max(times) < grace_s + 1.5, times


def test_check_says_it_runs_the_reference_before_it_does(run_cli, server):
    r = run_cli("call", "--target", server.target, "--batch", "2", "--seq", "64", "--check")
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("checking against the reference backend (plain loops)"), r.stderr
    assert "check against reference:" in r.stdout


def test_metrics_on_colon_port_follow_the_listen_host(tmp_path):
    with _e2e.run_server(tmp_path, "--metrics_listen", ":0") as server:
        stop_and_time(server.proc, 30)
    log = (tmp_path / "server.log").read_text()
    assert re.search(r"metrics at http://127\.0\.0\.1:0/metrics \(port [1-9]\d*\)", log), log


def test_the_open_file_limit_is_raised_to_the_hard_limit(tmp_path):
    # Each connection takes a descriptor; gRPC 1.51 stops accepting for good after one accept fails for want of one.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("hard limit %d leaves nothing to raise" % hard)
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([_e2e._server_binary(), "--listen", "127.0.0.1:0", "--threads", "1"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    log.close()
    try:
        deadline = time.monotonic() + _e2e.STARTUP_TIMEOUT_S
        while "listening" not in (tmp_path / "server.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        limits = open("/proc/%d/limits" % proc.pid).read()
        row = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits)
        assert row.group(1) == row.group(2), limits
    finally:
        stop_and_time(proc, 30)
