#!/usr/bin/env bash
# Makes (once) the virtual environment the interop tests run in: the real third-party clients of the KServe v2
# protocol (tritonclient's gRPC client, with its grpcio, protobuf and ml_dtypes), numpy and pytest, at pinned
# versions from the Python package index. Neither the product nor the rest of the suite uses it.
#   tests/interop/env.sh    prints the path of the venv's Python (its last line); exits 3 when the index cannot be
#                           reached and no complete environment exists
# Idempotent: a complete environment at these versions is reused (well under a second). Environment:
#   MHA_INTEROP_VENV   where (default ~/.cache/mhaserve/interop-venv, outside the source tree, shared by worktrees)
set -euo pipefail

venv=${MHA_INTEROP_VENV:-$HOME/.cache/mhaserve/interop-venv}
packages=("tritonclient[grpc]==2.73.0" numpy==2.4.6 pytest==9.2.0)
versions="${packages[*]}"

if [[ -x $venv/bin/python && "$(cat "$venv/.complete" 2>/dev/null)" == "$versions" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
rm -rf "$venv"
if ! /usr/bin/python3 -m venv "$venv" >&2; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >&2
  /usr/bin/python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-cache-dir "${packages[@]}" >&2; then
  rm -rf "$venv"
  echo "interop-env: cannot install ${versions} from the Python package index" >&2
  exit 3
fi
echo "$versions" >"$venv/.complete"
echo "$venv/bin/python"
