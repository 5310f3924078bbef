#!/usr/bin/env bash
# The model checks that run as tests (tests/models/test_*.py: transformers' own code as the oracle) against the real
# server, in tests/models/env.sh's environment (transformers over the benchmark peers' PyTorch).
#   tests/models/run.sh SERVER_BIN [pytest arguments]
# Environment:
#   MHA_INTEROP_TORCH   auto (default): run when the environment is complete already, else skip (exit 77, ctest's
#                       skipped); required: make it if it is missing (minutes, 2.4 GB with PyTorch; CI sets it)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
server=$(realpath "$1")
shift
venv=${MHA_MODELS_VENV:-$HOME/.cache/mhaserve/models-venv}
case ${MHA_INTEROP_TORCH:-auto} in
  required) ;;
  auto)
    if [[ ! -f $venv/.complete ]]; then
      echo "models: skipped, no environment yet (tests/models/env.sh makes it; MHA_INTEROP_TORCH=required here)" >&2
      exit 77
    fi ;;
  *) echo "models: MHA_INTEROP_TORCH must be auto or required" >&2; exit 2 ;;
esac
python=$("$here/env.sh" | tail -1)
export MHA_SERVER_BIN=$server
cd "$here"
exec timeout 600 "$python" -m pytest -q -p no:cacheprovider "$@" test_*.py
