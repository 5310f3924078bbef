"""mha_client decode --shards across three real servers on loopback: each logical session's context is cut into
three contiguous parts, one per server; every step asks all three (append=false on the first two) and merges the
outputs by their lse. The merged output must match the unsharded reference over the whole context, each server must
have stored about a third of it (its own mha_session_tokens_appended_total), and every session is closed after the
run. Bad combinations are usage errors."""

import contextlib
import json
import re
import time
import urllib.request

import pytest

from conftest import _e2e

CONTEXT, STEPS = 8192, 2


def _metrics_port(log_path):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as log:
            found = re.search(r"metrics at \S+ \(port (\d+)\)", log.read())
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    pytest.fail("no metrics port in %s" % log_path)


def _tokens_appended(metrics_port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics_port, timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^mha_session_tokens_appended_total(?:\{\})? (\S+)$", text, re.M)
    assert found, text
    return float(found.group(1))


@pytest.fixture
def three_servers(tmp_path):
    """Three mha_servers (one compute thread each, metrics on a free port), stopped by SIGTERM after the test."""
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(3):
            work = tmp_path / ("server%d" % i)
            work.mkdir()
            servers.append(stack.enter_context(
                _e2e.run_server(work, "--threads", "1", "--metrics_listen", "127.0.0.1:0")))
        yield servers


def test_three_shards_merge_to_the_whole_context_and_split_it_in_thirds(three_servers, run_cli):
    targets = ",".join(s.target for s in three_servers)
    result = run_cli("decode", "--shards", "3", "--target", targets, "--context", CONTEXT, "--steps", STEPS,
                     "--sessions", "1", "--check", "--rope_theta", "0", "--heads", "4", "--kv_heads", "2",
                     "--head_dim", "32", "--cache_dtype", "fp32", "-O", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["shards"] == 3
    assert report["errors"] == 0
    assert report["check"]["tolerance"] == 1e-4  # fp32 cache and wire
    assert report["check"]["max_error"] <= report["check"]["tolerance"], report["check"]
    # Contiguous thirds (2730, 2731, 2731); the last shard also appends the steps' tokens.
    assert report["shard_lengths"] == [2730, 2731, 2731 + STEPS]
    assert report["prefill_tokens"] == CONTEXT
    # What each server says it stored: about a third of the context (append=false steps store nothing).
    appended = [_tokens_appended(_metrics_port(s.log_path)) for s in three_servers]
    assert appended == [2730, 2731, 2731 + STEPS]
    for tokens in appended:
        assert abs(tokens - CONTEXT / 3) <= STEPS + 1
    # And every shard's session was closed.
    for s in three_servers:
        info = run_cli("info", "--target", s.target)
        assert info.returncode == 0, info.stderr
        assert "sessions: 0 open" in info.stdout, info.stdout


def test_the_pretty_report_says_shards(three_servers, run_cli):
    targets = ",".join(s.target for s in three_servers[:2])  # 3 shards on 2 servers: shard 2 on server 0
    result = run_cli("decode", "--shards", "3", "--target", targets, "--context", "300", "--steps", "2",
                     "--rope_theta", "0", "--heads", "4", "--kv_heads", "2", "--head_dim", "32", "--check")
    assert result.returncode == 0, result.stderr
    assert "shards    3, session 0's cache holds 100 + 100 + 102 tokens" in result.stdout, result.stdout
    assert "OK" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--session_layers", "demo", "--rope_theta", "0"], "--session_layers"),
    (["--heads", "4", "--kv_heads", "2", "--head_dim", "32"], "--rope_theta 0"),
    (["--rope_theta", "0", "--stateless"], "--stateless"),
    (["--rope_theta", "0", "--lb", "round_robin"], "--lb"),
    (["--rope_theta", "0", "--context", "2"], "--context"),
])
def test_shards_usage_errors_exit_2(run_cli, args, message):
    result = run_cli("decode", "--shards", "3", "--target", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_more_servers_than_shards_is_a_usage_error(run_cli):
    result = run_cli("decode", "--shards", "2", "--target", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
                     "--rope_theta", "0")
    assert result.returncode == 2
    assert "at most one per shard" in result.stderr
