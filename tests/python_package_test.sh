#!/usr/bin/env bash
# The Python client as a pip package: builds it from a copy of client/python and proto/ into a fresh virtual
# environment (Debian's grpcio, protobuf and numpy through --system-site-packages; nothing from the network), then
# makes a call with it against the real server.
# Usage: python_package_test.sh REPO_ROOT MHA_SERVER
set -euo pipefail
repo=$(realpath "$1")
server=$(realpath "$2")
source "$(dirname "$0")/server_lib.sh"

mkdir -p "$work/src/client"
cp -r "$repo/client/python" "$work/src/client/python"
cp -r "$repo/proto" "$work/src/proto"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
(cd "$work" && "$work/venv/bin/pip" install -q --no-build-isolation --no-deps --no-index "$work/src/client/python")

start_server "$server" --log_level warn
cd "$work"  # not the checkout: the installed package must be what is imported
"$work/venv/bin/python" - "$target" <<'PY'
import sys
import numpy as np
import importlib.util
import mhaclient
assert "/venv/" in mhaclient.__file__, mhaclient.__file__
# The transformers integration ships in the package (it imports torch and transformers only when used).
spec = importlib.util.find_spec("mhaclient_transformers")
assert spec is not None and "/venv/" in spec.origin, spec
with mhaclient.MhaClient(sys.argv[1]) as c:
    r = c.multi_head_attention(np.ones((1, 4, 512), np.float32), layer="demo")
    assert r.output.shape == (1, 4, 512), r.output.shape
    assert c.health() == "SERVING"
print("python package: installed mhaclient called the server")
PY
stop_server
