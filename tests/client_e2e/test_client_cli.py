"""mha_client (call, bench, plot) against the real mha_server, checked against the Python client on the same server.

- call: .npy inputs and outputs (fp32, fp16), inline weights from a .safetensors file, head config flags; results
  equal the Python client's for the same inputs. Bad files fail with exit code 1, bad flags with 2.
- bench: JSON reports whose counts add up and whose percentiles are ordered; errors are counted with their
  messages; the open loop measures latency from each call's intended send time; sweeps; several connections;
  client-side round robin over two servers.
- plot: a well-formed SVG with one panel per head whose cells carry the returned weights.
"""

import json
import re
import struct
import subprocess
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

SVG = "{http://www.w3.org/2000/svg}"
DEMO_D_MODEL = 512


def write_safetensors(path, tensors, metadata):
    """A .safetensors file: 8-byte little-endian header length, JSON header, F32 tensor bytes."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def gqa_layer(rng, d_model=32, d_kv=24, d_v=20, heads=4, kv_heads=2, head_dim=8):
    """Weights of a GQA layer with biases, in the Y = X W convention."""
    def f32(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "w_q": f32(d_model, heads * head_dim, scale=d_model ** -0.5),
        "w_k": f32(d_kv, kv_heads * head_dim, scale=d_kv ** -0.5),
        "w_v": f32(d_v, kv_heads * head_dim, scale=d_v ** -0.5),
        "w_o": f32(heads * head_dim, d_model, scale=(heads * head_dim) ** -0.5),
        "b_q": f32(heads * head_dim, scale=0.3),
        "b_k": f32(kv_heads * head_dim, scale=0.3),
        "b_v": f32(kv_heads * head_dim, scale=0.3),
        "b_o": f32(d_model, scale=0.3),
    }


def bench_json(run_cli, *args):
    result = run_cli("bench", "-O", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_report_consistent(report):
    """Counts add up, percentiles are ordered, the histogram holds every OK call, the split adds up to the mean."""
    count = report["count"]
    assert count["ok"] + count["errors"] == count["sent"]
    assert sum(s["count"] for s in report["status"]) == count["sent"]
    lat = report["latency_ms"]
    if count["ok"] > 0:
        order = [lat[k] for k in ("fastest", "p50", "p90", "p95", "p99", "p99_9", "slowest")]
        assert order == sorted(order), lat
        assert lat["fastest"] <= lat["mean"] <= lat["slowest"]
        assert sum(b["count"] for b in report["histogram"]) == count["ok"]
        assert sum(report["split_ms"].values()) == pytest.approx(lat["mean"], abs=1e-6)
    assert report["rps"] == pytest.approx(count["sent"] / report["total_s"], rel=1e-9)
    assert report["gflops"] == pytest.approx(count["ok"] * report["request"]["gflop"] / report["total_s"], rel=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# call


def test_call_npy_query_matches_python_client(tmp_path, server, client, run_cli):
    q = np.random.default_rng(1).standard_normal((2, 12, DEMO_D_MODEL)).astype(np.float32)
    np.save(tmp_path / "q.npy", q)
    r = run_cli("call", "--target", server.target, "--query", tmp_path / "q.npy", "--causal", "--key_lengths", "12,7",
                "--weights", "--output", tmp_path / "out.npy", "--weights_output", tmp_path / "w.npy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("output [2, 12, 512] fp32, backend cpu, queue ")
    assert "attention_weights [2, 8, 12, 12]" in r.stdout
    assert "wrote output [2, 12, 512] to %s" % (tmp_path / "out.npy") in r.stdout

    want = client.multi_head_attention(q, layer="demo", causal=True, key_lengths=[12, 7], return_weights=True)
    got, got_w = np.load(tmp_path / "out.npy"), np.load(tmp_path / "w.npy")
    assert got.dtype == np.float32 and got.shape == (2, 12, 512)
    assert got_w.dtype == np.float32 and got_w.shape == (2, 8, 12, 12)
    np.testing.assert_allclose(got, want.output, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_w, want.attention_weights, rtol=0, atol=1e-7)
    assert np.all(got_w[1, :, :, 7:] == 0)  # key_lengths[1] = 7 masks keys 7..11


def test_call_inline_gqa_weights_from_safetensors_match_python_client(tmp_path, server, client, run_cli):
    rng = np.random.default_rng(2)
    weights = gqa_layer(rng)
    write_safetensors(tmp_path / "gqa.safetensors", weights, {"num_heads": 4, "num_kv_heads": 2})
    q = rng.standard_normal((2, 5, 32)).astype(np.float32)
    k = rng.standard_normal((2, 7, 24)).astype(np.float32)
    v = rng.standard_normal((2, 7, 20)).astype(np.float32)
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / (name + ".npy"), array)
    r = run_cli("call", "--target", server.target, "--weights_file", tmp_path / "gqa.safetensors",
                "--query", tmp_path / "q.npy", "--key", tmp_path / "k.npy", "--value", tmp_path / "v.npy",
                "--causal", "--head_mask", "1,0,1,0.5", "--key_lengths", "7,3", "--weights",
                "--output", tmp_path / "out.npy", "--weights_output", tmp_path / "w.npy")
    assert r.returncode == 0, r.stderr
    assert "output [2, 5, 32] fp32" in r.stdout and "attention_weights [2, 4, 5, 7]" in r.stdout

    want = client.multi_head_attention(q, k, v, weights=weights, num_heads=4, num_kv_heads=2, causal=True,
                                       head_mask=[1, 0, 1, 0.5], key_lengths=[7, 3], return_weights=True)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want.output, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), want.attention_weights, rtol=0, atol=1e-7)


def test_call_fp16_npy_in_fp16_npy_out(tmp_path, server, client, run_cli):
    q = np.random.default_rng(3).uniform(-1, 1, (1, 8, DEMO_D_MODEL)).astype(np.float16)
    np.save(tmp_path / "q16.npy", q)
    r = run_cli("call", "--target", server.target, "--query", tmp_path / "q16.npy", "--output", tmp_path / "o.npy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("output [1, 8, 512] fp16")
    got = np.load(tmp_path / "o.npy")
    assert got.dtype == np.float16
    want = client.multi_head_attention(q, layer="demo")
    assert want.output.dtype == np.float16
    np.testing.assert_array_equal(got, want.output)


def test_call_bf16_output_is_written_as_float32(tmp_path, server, run_cli):
    r = run_cli("call", "--target", server.target, "--seq", "4", "--dtype", "bf16", "--output_dtype", "bf16",
                "--output", tmp_path / "o.npy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("output [1, 4, 512] bf16")
    got = np.load(tmp_path / "o.npy")
    assert got.dtype == np.float32 and got.shape == (1, 4, 512)
    assert np.all(got.view(np.uint32) & 0xFFFF == 0)  # bf16 values widened exactly


def checksum(stdout):
    return re.search(r"checksum (\S+)", stdout).group(1)


def test_call_random_inputs_follow_the_seed(server, run_cli):
    a = run_cli("call", "--target", server.target, "--seed", "7", "--batch", "2", "--seq", "8", "--kv_seq", "5")
    b = run_cli("call", "--target", server.target, "--seed", "7", "--batch", "2", "--seq", "8", "--kv_seq", "5")
    c = run_cli("call", "--target", server.target, "--seed", "8", "--batch", "2", "--seq", "8", "--kv_seq", "5")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert checksum(a.stdout) == checksum(b.stdout) != checksum(c.stdout)


@pytest.mark.parametrize("make, message", [
    (lambda p: np.save(p, np.zeros((1, 2, 512))),
     "{path}: dtype '<f8' is not supported; expected '<f4' (float32) or '<f2' (float16)"),
    (lambda p: np.save(p, np.asfortranarray(np.zeros((1, 2, 512), np.float32))),
     "{path}: Fortran-order arrays are not supported; save a C-order array (numpy.ascontiguousarray)"),
    (lambda p: np.save(p, np.zeros((2, 512), np.float32)),
     "--query {path}: shape (2, 512) must be [B, Tq, d_model] with every dim >= 1"),
    (lambda p: open(p, "wb").write(b"not numpy"), "{path}: not a .npy file (no \\x93NUMPY magic string)"),
    (lambda p: None, "NOT_FOUND: cannot open {path}"),
], ids=["float64", "fortran", "rank2", "bad_magic", "missing"])
def test_call_rejects_bad_npy_files(tmp_path, server, run_cli, make, message):
    path = str(tmp_path / "bad.npy")
    make(path)
    r = run_cli("call", "--target", server.target, "--query", path)
    assert r.returncode == 1
    assert message.format(path=path) in r.stderr


def test_call_unknown_layer_fails(server, run_cli):
    r = run_cli("call", "--target", server.target, "--layer", "nope")
    assert r.returncode == 1
    assert r.stderr == "error: NOT_FOUND: no layer named nope\n"


@pytest.mark.parametrize("args, message", [
    (["--batch", "1000000", "--seq", "1000000"],
     "the random query [--batch, --seq, d_model] [1000000, 1000000, 512] would be 512000000000000 elements of 4 "
     "bytes, over the 2047 MiB one gRPC message can carry"),
    (["--batch", "4294967296", "--seq", "4294967296"],
     "the random query [--batch, --seq, d_model].shape [4294967296, 4294967296, 512] has too many elements"),
    (["--batch", "1", "--seq", "8", "--kv_seq", "3000000000"],
     "the random key [--batch, --kv_seq, d_kv_in] [1, 3000000000, 512] would be 1536000000000 elements"),
], ids=["too_big", "overflowing", "key_too_big"])
def test_call_refuses_inputs_too_big_to_send_before_allocating(server, run_cli, args, message):
    r = run_cli("call", "--target", server.target, *args)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: INVALID_ARGUMENT: " + message), r.stderr


@pytest.mark.parametrize("args, message", [
    (["call", "--layer", "demo", "--weights_file", "w.safetensors"], "give either --layer or --weights_file, not both"),
    (["call", "--query", "q.npy", "--batch", "2"],
     "--batch and --seq shape the random query; they cannot be combined with --query"),
    (["call", "--key", "k.npy", "--kv_seq", "4"], "--kv_seq shapes the random key; it cannot be combined with --key"),
    (["call", "--value", "v.npy"], "--value needs --key"),
    (["call", "--dtype", "fp64"], "--dtype must be fp32, fp16 or bf16; got 'fp64'"),
    (["call", "--backend", "gpu"], "--backend must be auto, cpu, reference or cuda; got 'gpu'"),
    (["call", "--key_lengths", "3,x"], "--key_lengths: 'x' is not a non-negative integer"),
    (["call", "--head_mask", "1,nan"], "--head_mask: 'nan' is not a finite number"),
    (["call", "--seq", "-1"], "--seq must be >= 0; got -1"),
    (["call", "--lb", "random"], "--lb must be pick_first or round_robin; got 'random'"),
    (["call", "--timeout_s", "0"], "--timeout_s must be a positive number; got 0"),
    (["bench", "-O", "xml"], "-O must be pretty, json or csv; got 'xml'"),
    (["bench", "-c", "0"], "bench: concurrency must be in [1, 1024]; got 0"),
    (["bench", "--rps", "-5"], "bench: rps must be a finite number >= 0; got -5"),
    (["bench", "--connections", "0"], "--connections must be in [1, 256]; got 0"),
    (["bench", "--concurrency_range", "1:64"],
     "--concurrency_range '1:64' must be start:end:step or start:end:xFACTOR with 1 <= start <= end <= 1024, "
     "e.g. 1:64:x2"),
    (["bench", "--rps", "10", "--concurrency_range", "1:4:x2"],
     "--concurrency_range sweeps the closed loop; drop --rps"),
    (["plot"], "plot needs --output FILE.svg"),
    (["plot", "--output", "x.svg", "--tokens", "a,b,c", "--seq", "4"], "--tokens has 3 labels but --seq is 4"),
])
def test_usage_errors_exit_2_before_sending(run_cli, args, message):
    # The target is unreachable on purpose: a usage error must be found before any connection is attempted.
    r = run_cli(*args, "--target", "127.0.0.1:1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("usage error: " + message + "\n"), r.stderr


def test_unknown_subcommand_and_missing_subcommand_exit_2(run_cli):
    r = run_cli("frobnicate")
    assert r.returncode == 2
    assert "unknown command 'frobnicate'; expected health, info, call, bench, plot, heads, decode or load" in r.stderr
    assert run_cli().returncode == 2


# ---------------------------------------------------------------------------------------------------------------
# bench


def default_bench_request_bytes(client):
    """The serialized size of mha_client bench's default request: the demo layer and a random [1, 16, 512] fp32
    query, every other field at its default."""
    from mha.v1 import attention_pb2  # the client fixture generated the stubs
    request = attention_pb2.MultiHeadAttentionRequest(layer="demo")
    request.query.shape.extend([1, 16, DEMO_D_MODEL])
    request.query.dtype = attention_pb2.FP32
    request.query.data = bytes(16 * DEMO_D_MODEL * 4)
    return request.ByteSize()


def test_bench_closed_loop_json_report_adds_up(server, client, run_cli):
    report = bench_json(run_cli, "--target", server.target, "-c", "2", "-z", "2s", "--warmup", "5")
    assert_report_consistent(report)
    assert report["mode"] == "closed" and report["concurrency"] == 2 and report["warmup"] == 5
    assert report["count"]["errors"] == 0 and report["count"]["sent"] >= 10
    assert report["status"] == [{"code": "OK", "count": report["count"]["sent"], "messages": []}]
    assert 1.9 <= report["total_s"] < 10
    assert report["request"] == {"batch": 1, "query_len": 16, "key_len": 16, "d_model": 512, "d_kv_in": 512,
                                 "d_v_in": 512, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "causal": False,
                                 "gflop": pytest.approx(0.034078720), "bytes": default_bench_request_bytes(client)}
    assert report["split_ms"]["server_compute"] > 0


def test_bench_health_baseline_measures_health_round_trips(server, run_cli):
    report = bench_json(run_cli, "--target", server.target, "-n", "5", "--health_baseline", "20")
    health = report["health_rtt_ms"]
    assert health["calls"] == 20
    assert 0 < health["fastest"] <= health["p50"] <= health["p90"] <= health["p99"]
    # A health check does no attention work, so it is the floor of any call on the same connection.
    assert health["p50"] <= report["latency_ms"]["p50"]
    assert "health_rtt_ms" not in bench_json(run_cli, "--target", server.target, "-n", "2")


def test_bench_counts_errors_with_their_messages(server, run_cli):
    report = bench_json(run_cli, "--target", server.target, "--heads", "3", "-n", "10", "-c", "2")
    assert_report_consistent(report)
    assert report["count"] == {"sent": 10, "ok": 0, "errors": 10}
    assert report["status"] == [{"code": "INVALID_ARGUMENT", "count": 10, "messages": [
        {"message": "heads.num_heads is 3, which disagrees with layer 'demo' (8); leave it 0 to use that value", "count": 10}]}]


def test_bench_through_the_kserve_front_door(server, run_cli):
    """--protocol kserve sends the same call as KServe v2's ModelInfer on the layer's model: the server computes it
    (its timings come back in the response's parameters), and the report says which door was measured."""
    report = bench_json(run_cli, "--target", server.target, "--protocol", "kserve", "--seq", "8", "-n", "10")
    assert_report_consistent(report)
    assert report["protocol"] == "kserve" and report["count"]["ok"] == 10
    assert report["split_ms"]["server_compute"] > 0
    assert bench_json(run_cli, "--target", server.target, "-n", "2")["protocol"] == "native"
    refused = run_cli("bench", "--target", server.target, "--protocol", "kserve", "--shared_memory", "-n", "1")
    assert refused.returncode != 0 and "--protocol kserve sends its tensors in the message" in refused.stderr
    wrong = run_cli("bench", "--target", server.target, "--protocol", "http", "-n", "1")
    assert wrong.returncode != 0 and "--protocol must be native or kserve; got 'http'" in wrong.stderr


def test_bench_pretty_report_and_progress_line(server, run_cli):
    r = run_cli("bench", "--target", server.target, "-z", "1s", "-c", "3", "--progress", "--seq", "8")
    assert r.returncode == 0, r.stderr
    sent = int(re.search(r"Count: +(\d+) \(ok \1, errors 0\)", r.stdout).group(1))
    for part in ("Summary: closed loop, concurrency 3, 1 connection", "Requests/sec:", "GFLOP/s", "p99.9",
                 "Histogram (ms):", "client serialize", "server compute", "[OK] %d" % sent):
        assert part in r.stdout
    # Not a terminal, so one progress line a second (the first after a quarter of a second).
    assert re.search(r"^\[bench c=3\] \d+ calls done, \d+ in flight, 0 errors, ", r.stderr, re.M), r.stderr


def big_request_compute_s(client):
    """Server compute time of one B=8, T=512 demo-layer call, seconds."""
    x = np.zeros((8, 512, DEMO_D_MODEL), np.float32)
    return min(client.multi_head_attention(x, layer="demo").compute_us for _ in range(2)) * 1e-6


def test_bench_open_loop_counts_time_held_back_by_the_client(server, client, run_cli):
    """With one call in flight at most, calls due faster than the server answers wait in the client; their latency
    still runs from the intended send time, so it grows far beyond the compute time of any single call."""
    compute = big_request_compute_s(client)
    rps = 4.0 / compute  # four times what the server can sustain
    report = bench_json(run_cli, "--target", server.target, "--batch", "8", "--seq", "512", "--rps", "%.3f" % rps,
                        "-n", "12", "--max_in_flight", "1")
    assert_report_consistent(report)
    assert report["mode"] == "open" and report["count"]["ok"] == 12
    split, lat = report["split_ms"], report["latency_ms"]
    assert report["in_flight_waits"] >= 6
    assert split["server_queue"] < 0.5 * split["server_compute"]  # the server never had a backlog...
    assert split["send_delay"] > split["server_compute"]           # ...the client did, and it is counted
    assert lat["p99"] > 3 * split["server_compute"], (lat, split)
    assert lat["p50"] > 1.5 * split["server_compute"], (lat, split)


def test_bench_open_loop_shows_server_queueing(server, client, run_cli):
    """Without a client-side cap the calls go out on time and queue in the server; latency grows the same way."""
    compute = big_request_compute_s(client)
    rps = 4.0 / compute
    report = bench_json(run_cli, "--target", server.target, "--batch", "8", "--seq", "512", "--rps", "%.3f" % rps,
                        "-n", "12")
    assert_report_consistent(report)
    split, lat = report["split_ms"], report["latency_ms"]
    assert report["count"]["ok"] == 12 and report["in_flight_waits"] == 0
    assert split["send_delay"] < 0.5 * split["server_compute"]
    assert split["server_queue"] > split["server_compute"]
    assert lat["p99"] > 3 * split["server_compute"], (lat, split)


def test_bench_concurrency_sweep_csv(server, run_cli):
    r = run_cli("bench", "--target", server.target, "--concurrency_range", "1:4:x2", "-n", "12", "-O", "csv",
                "--seq", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().split("\n")
    header = lines[0].split(",")
    assert header[:7] == ["mode", "concurrency", "target_rps", "connections", "sent", "ok", "errors"]
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert [row["concurrency"] for row in rows] == ["1", "2", "4"]
    assert all(row["sent"] == "12" and row["ok"] == "12" for row in rows)
    for row in rows:
        p = [float(row[k]) for k in ("fastest_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "p99_9_ms", "slowest_ms")]
        assert p == sorted(p)


def established_connections(port):
    """Client-side TCP connections to 127.0.0.1:port in state ESTABLISHED, from /proc/net/tcp and tcp6 (where
    127.0.0.1 appears IPv4-mapped)."""
    remotes = {"0100007F:%04X" % port, "0000000000000000FFFF00000100007F:%04X" % port}
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and fields[2] in remotes:
                    n += 1
    return n


def test_bench_spreads_calls_over_connections(server, cli_bin):
    before = established_connections(server.port)
    proc = subprocess.Popen([cli_bin, "bench", "--target", server.target, "--connections", "3", "-c", "6", "-z", "3s",
                             "--seq", "8", "-O", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + 2.5
        while seen < 3 and time.monotonic() < deadline and proc.poll() is None:
            seen = max(seen, established_connections(server.port) - before)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert_report_consistent(report)
    assert report["connections"] == 3 and report["count"]["errors"] == 0
    # Three dedicated channels plus the one that looked the layer up.
    assert seen >= 3, seen


def calls_logged(log_path):
    with open(log_path, errors="replace") as f:
        return sum(1 for line in f if "rpc=MultiHeadAttention" in line)


def test_round_robin_spreads_calls_over_two_servers(server, second_server, run_cli):
    before = calls_logged(server.log_path), calls_logged(second_server.log_path)
    target = "ipv4:127.0.0.1:%d,127.0.0.1:%d" % (server.port, second_server.port)
    report = bench_json(run_cli, "--target", target, "--lb", "round_robin", "-n", "40", "-c", "2", "--seq", "8")
    assert report["count"] == {"sent": 40, "ok": 40, "errors": 0}
    deadline = time.monotonic() + 5
    while True:  # the servers log each call as it completes; allow the last lines to land
        got = calls_logged(server.log_path) - before[0], calls_logged(second_server.log_path) - before[1]
        if sum(got) >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(got) == 40
    assert got[0] >= 10 and got[1] >= 10, got

    # pick_first (the default) sends everything to the first address: once the first server has logged all ten
    # calls (each is logged before it is answered), the second has logged none.
    before = calls_logged(server.log_path), calls_logged(second_server.log_path)
    report = bench_json(run_cli, "--target", target, "-n", "10", "--seq", "8")
    assert report["count"]["ok"] == 10
    deadline = time.monotonic() + 5
    while calls_logged(server.log_path) - before[0] < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls_logged(server.log_path) - before[0] == 10
    assert calls_logged(second_server.log_path) == before[1]


# ---------------------------------------------------------------------------------------------------------------
# plot


def test_plot_writes_one_panel_per_head_with_the_returned_weights(tmp_path, server, client, run_cli):
    rng = np.random.default_rng(4)
    weights = gqa_layer(rng, d_model=16, d_kv=16, d_v=16, heads=4, kv_heads=2, head_dim=4)
    write_safetensors(tmp_path / "gqa.safetensors", weights, {"num_heads": 4, "num_kv_heads": 2})
    tokens = ["the", "cat", "sat", "on", "the", "<mat>"]
    q = rng.standard_normal((1, len(tokens), 16)).astype(np.float32)
    np.save(tmp_path / "q.npy", q)
    svg_path = tmp_path / "heads.svg"
    r = run_cli("plot", "--target", server.target, "--weights_file", tmp_path / "gqa.safetensors",
                "--query", tmp_path / "q.npy", "--tokens", ",".join(tokens), "--causal", "--output", svg_path,
                "--weights_output", tmp_path / "w.npy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote %s: 4 heads in 2 KV groups, Tq 6 x Tk 6, batch item 0" % svg_path)

    want = client.multi_head_attention(q, weights=weights, num_heads=4, num_kv_heads=2, causal=True,
                                       return_weights=True).attention_weights
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), want, rtol=0, atol=1e-7)

    root = ET.parse(svg_path).getroot()  # raises on malformed XML
    assert root.tag == SVG + "svg"
    panels = root.findall(SVG + "g[@class='head']")
    assert len(panels) == 4
    for h, panel in enumerate(panels):
        assert panel.get("data-head") == str(h) and panel.get("data-kv-group") == str(h // 2)
        assert panel.find(SVG + "text[@class='title']").text == "head %d / KV group %d" % (h, h // 2)
        cells = panel.findall(SVG + "rect[@class='cell']")
        assert len(cells) == 36
        assert [t.text for t in panel.findall(SVG + "text[@class='query-label']")] == tokens
        assert [t.text for t in panel.findall(SVG + "text[@class='key-label']")] == tokens
        for cell in cells:  # each cell's tooltip carries the weight the server returned for it
            qi, ki = int(cell.get("data-q")), int(cell.get("data-k"))
            label, value = cell.find(SVG + "title").text.rsplit(": ", 1)
            assert label == "%s -> %s" % (tokens[qi], tokens[ki])
            assert float(value) == pytest.approx(float(want[0, h, qi, ki]), abs=6e-5)
        # Causal: keys after the query are masked, so they get weight 0 and the bottom colour.
        masked = [c for c in cells if int(c.get("data-k")) > int(c.get("data-q"))]
        assert len(masked) == 15 and all(c.get("fill") == "#440154" for c in masked)


def test_plot_demo_layer_random_query(tmp_path, server, run_cli):
    r = run_cli("plot", "--target", server.target, "--seq", "10", "--columns", "4", "--output", tmp_path / "d.svg")
    assert r.returncode == 0, r.stderr
    root = ET.parse(tmp_path / "d.svg").getroot()
    panels = root.findall(SVG + "g[@class='head']")
    assert len(panels) == 8
    assert [p.find(SVG + "text[@class='title']").text for p in panels] == [
        "head %d" % i for i in range(8)]  # MHA: each head its own KV head, so no groups are named
    assert all(len(p.findall(SVG + "rect[@class='cell']")) == 100 for p in panels)
    assert [t.text for t in panels[0].findall(SVG + "text[@class='query-label']")] == [str(i) for i in range(10)]
