"""mha_client decode --recover against a real server that is killed (SIGKILL, by its PID) and restarted on the same
port mid-run: every session is rebuilt from its record on the new server, every step completes, the report counts
the recoveries and --check still passes. --recover with --stateless or --shards is a usage error."""

import json
import subprocess
import time

import pytest

from conftest import CLI_TIMEOUT_S, _e2e

STEPS = 1500
SESSIONS = 3


def _extend_calls(log_path):
    with open(log_path, errors="replace") as log:
        return sum(1 for line in log if "rpc=Extend " in line or "rpc=ExtendStream " in line)


@pytest.mark.parametrize("mode", [[], ["--per_session", "-c", "2"]], ids=["batched", "per_session"])
def test_decode_recovers_every_session_from_a_restarted_server_and_checks(cli_bin, tmp_path, mode):
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    first = _e2e.start_server(tmp_path / "first", "--threads", "1", "--log_max_calls_per_s", "0")
    decode = None
    try:
        decode = subprocess.Popen(
            [cli_bin, "decode", "--target", first.target, "--recover", "--check", "--sessions", str(SESSIONS),
             "--context", "64", "--steps", str(STEPS), "--heads", "4", "--kv_heads", "2", "--head_dim", "16",
             "--num_layers", "2", "-O", "json", *mode],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Past the prefill (a call per session and layer) and some steps, the server dies.
        deadline = time.monotonic() + 60
        while _extend_calls(first.log_path) < 2 * SESSIONS + 40:
            assert decode.poll() is None, "decode ended before the server was killed:\n" + decode.stderr.read()
            assert time.monotonic() < deadline, "decode made too few calls in 60 s"
            time.sleep(0.01)
        first.proc.kill()
        first.proc.wait()
        with _e2e.run_server(tmp_path / "again", "--threads", "1", "--log_max_calls_per_s", "0",
                             listen=first.target) as again:
            stdout, stderr = decode.communicate(timeout=CLI_TIMEOUT_S)
            rebuilt = open(again.log_path, errors="replace").read().count("rpc=CreateSession ")
    finally:
        for proc in (decode, first.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert decode.returncode == 0, stderr
    report = json.loads(stdout)
    assert report["recover"] is True
    assert report["recoveries"] >= 1
    assert rebuilt == report["recoveries"]  # each rebuild is one CreateSession on the new server
    assert report["errors"] == 0
    assert report["decode_tokens"] == SESSIONS * STEPS
    assert report["check"]["max_error"] <= report["check"]["tolerance"]


def test_decode_pretty_report_counts_the_recoveries(server, run_cli):
    result = run_cli("decode", "--target", server.target, "--recover", "--sessions", "2", "--context", "16",
                     "--steps", "2", "--heads", "4", "--kv_heads", "2", "--head_dim", "16")
    assert result.returncode == 0, result.stderr
    assert "recovered 0 session(s)" in result.stdout


@pytest.mark.parametrize("other", [["--stateless"], ["--shards", "2", "--rope_theta", "0"]])
def test_decode_recover_with_stateless_or_shards_is_a_usage_error(server, run_cli, other):
    result = run_cli("decode", "--target", server.target, "--recover", *other)
    assert result.returncode == 2
    assert "--recover" in result.stderr and other[0] in result.stderr
