"""A mha_server of the benchmark scripts: on a free loopback port (read back through --port_file), stopped by its PID
with SIGTERM when the block ends."""

import contextlib
import os
import signal
import subprocess
import time


@contextlib.contextmanager
def local_server(server_bin, work, *args):
    """Starts `server_bin` with `args` (its port file in directory `work`) and yields its "127.0.0.1:PORT" target."""
    port_file = os.path.join(work, "port")
    if os.path.exists(port_file):
        os.remove(port_file)
    server = subprocess.Popen([server_bin, "--listen", "127.0.0.1:0", "--port_file", port_file, *args])
    try:
        for _ in range(200):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            time.sleep(0.05)
        yield "127.0.0.1:" + open(port_file).read().strip()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
