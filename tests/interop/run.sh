#!/usr/bin/env bash
# The interop tests: Triton's own Python client against the real server's KServe v2 front door, results checked
# against PyTorch. The client runs in its own virtual environment (tests/interop/env.sh, from the Python index).
#   tests/interop/run.sh SERVER_BIN [pytest arguments]
# Environment:
#   MHA_INTEROP_REQUIRED=1   fail, not skip, when the environment cannot be made (CI sets it)
#   MHA_INTEROP_TORCH        auto (default): PyTorch's reference when tests/bench/peers-env.sh's environment is
#                            complete already, else numpy's; required: make that environment if it is missing
#                            (minutes, 2.4 GB; CI sets it)
# Exit 77 (ctest: skipped) when the Python package index cannot be reached and nothing is installed yet.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
server=$(realpath "$1")
shift
if ! python=$("$here/env.sh" | tail -1); then
  [[ ${MHA_INTEROP_REQUIRED:-0} == 1 ]] && { echo "interop: no environment, and MHA_INTEROP_REQUIRED=1" >&2; exit 1; }
  echo "interop: skipped, the Python package index cannot be reached" >&2
  exit 77
fi
peers_venv=${MHA_PEERS_VENV:-$HOME/.cache/mhaserve/peers-venv}
case ${MHA_INTEROP_TORCH:-auto} in
  required) MHA_REFERENCE_PYTHON=$("$here/../bench/peers-env.sh" | tail -1) ;;
  auto) [[ -f $peers_venv/.complete ]] && MHA_REFERENCE_PYTHON=$("$here/../bench/peers-env.sh" | tail -1) ;;
  *) echo "interop: MHA_INTEROP_TORCH must be auto or required" >&2; exit 2 ;;
esac
export MHA_SERVER_BIN=$server MHA_REFERENCE_PYTHON=${MHA_REFERENCE_PYTHON:-}
cd "$here"
exec timeout 600 "$python" -m pytest -q -p no:cacheprovider -s "$@" .
