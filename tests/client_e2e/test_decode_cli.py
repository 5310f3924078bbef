"""mha_client decode and client/python/decode_example.py against the real server: the workload runs, its report
adds up, --check agrees with the references, bad flags are usage errors, and the example's decoder matches its own
full recomputation at every step."""

import json
import os
import subprocess
import sys

import pytest


def decode(run_cli, server, *args):
    result = run_cli("decode", "--target", server.target, "-O", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", [[], ["--per_session", "-c", "2"], ["--stateless"]])
def test_decode_head_sessions_report_adds_up_and_checks(server, run_cli, mode):
    report = decode(run_cli, server, "--sessions", "3", "--context", "70", "--steps", "5", "--heads", "8",
                    "--kv_heads", "2", "--head_dim", "32", "--num_layers", "2", "--check", *mode)
    assert report["decode_tokens"] == 15
    assert report["errors"] == 0
    assert report["check"]["max_error"] <= report["check"]["tolerance"]
    assert report["heads"] == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 32, "caches": 2}
    # Each step reads every cached token of every session and layer: sum over steps of (70 + s + 1) tokens.
    kv_token_bytes = 2 * 2 * 32 * (4 if "--stateless" in mode else 2)  # wire fp32 when stateless, else a bf16 cache
    assert report["kv_bytes_read"] == 3 * 2 * sum(70 + s + 1 for s in range(5)) * kv_token_bytes
    assert report["prefill_tokens"] == (0 if "--stateless" in mode else 3 * 70 * 2)


def test_decode_layer_sessions_check_against_a_stateless_call(server, run_cli):
    report = decode(run_cli, server, "--session_layers", "demo,demo", "--sessions", "2", "--context", "40",
                    "--steps", "3", "--cache_dtype", "fp32", "--check")
    assert report["d_model"] == 512
    assert report["check"]["max_error"] <= 1e-4


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_through_an_8_bit_cache_checks_and_counts_its_scales(server, run_cli, dtype):
    report = decode(run_cli, server, "--sessions", "2", "--context", "64", "--steps", "3", "--heads", "8",
                    "--kv_heads", "2", "--head_dim", "32", "--cache_dtype", dtype, "--check")
    assert report["cache_dtype"] == dtype
    assert report["check"]["max_error"] <= report["check"]["tolerance"]
    # Per token and KV head: 32 key and 32 value codes, a value scale, and the key scales' share of a 32-token block.
    per_token = 2 * (32 + 32 + 2 + 2 * 32 / 32)
    assert report["kv_bytes_read"] == pytest.approx(2 * sum(64 + s + 1 for s in range(3)) * per_token)  # 2 sessions


def test_decode_with_a_shared_prefix_attaches_its_full_blocks_and_checks(server, run_cli):
    report = decode(run_cli, server, "--sessions", "3", "--context", "100", "--shared_prefix", "70", "--steps", "3",
                    "--heads", "8", "--kv_heads", "2", "--head_dim", "32", "--num_layers", "2", "--seed", "53",
                    "--check")
    shared = report["shared_prefix"]
    # Blocks of 32: 70 shared tokens are 2 full blocks, which the second and third sessions attach.
    assert shared["block_tokens"] == 32
    assert shared["attached_tokens"] == 2 * 64
    assert report["prefill_tokens"] == (100 + 2 * (100 - 64)) * 2  # per layer
    assert shared["pool_prefix_bytes"] >= 64 * 2 * (2 * 2 * 32 * 2)  # 64 tokens of 2 layers, bf16 K and V, indexed
    assert report["errors"] == 0
    assert report["check"]["max_error"] <= report["check"]["tolerance"]


def test_decode_pretty_report_names_what_it_measured(server, run_cli):
    result = run_cli("decode", "--target", server.target, "--sessions", "2", "--context", "32", "--steps", "2")
    assert result.returncode == 0, result.stderr
    for piece in ["tokens/s", "per step", "KV read", "cache bf16"]:
        assert piece in result.stdout


@pytest.mark.parametrize("mode", [[], ["--per_session", "-c", "2"]])
def test_decode_both_transports_time_every_other_step_each_way(server, run_cli, mode):
    report = decode(run_cli, server, "--sessions", "2", "--context", "40", "--steps", "6", "--heads", "4",
                    "--kv_heads", "2", "--head_dim", "16", "--transport", "both", "--check", *mode)
    steps = 6 if mode else 3  # per session and step when each session is its own call, else one call per step
    assert report["transport"]["stream"]["steps"] == steps and report["transport"]["unary"]["steps"] == steps
    assert 0 < report["server_step_ms"]["p50"] <= report["step_ms"]["max"]
    assert report["check"]["max_error"] <= report["check"]["tolerance"]
    unary = decode(run_cli, server, "--sessions", "2", "--context", "40", "--steps", "2", "--heads", "4",
                   "--kv_heads", "2", "--head_dim", "16", "--transport", "unary", *mode)
    assert unary["transport"]["stream"]["steps"] == 0 and unary["transport"]["unary"]["steps"] == (4 if mode else 2)


@pytest.mark.parametrize("args,message", [
    (["--sessions", "0"], "--sessions"),
    (["--heads", "8", "--kv_heads", "3"], "--kv_heads"),
    (["--cache_dtype", "int4"], "cache_dtype"),
    (["-O", "csv"], "-O"),
    (["--transport", "udp"], "--transport must be stream, unary or both"),
])
def test_decode_usage_errors_exit_2(server, run_cli, args, message):
    result = run_cli("decode", "--target", server.target, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_decode_example_matches_its_full_recomputation(server, stubs_dir):
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([stubs_dir, os.path.join(repo, "client", "python")]))
    proc = subprocess.run([sys.executable, os.path.join(repo, "client", "python", "decode_example.py"),
                           "--target", server.target, "--tokens", "12"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> OK" in proc.stdout
    assert "holds [18, 18] tokens per layer" in proc.stdout
