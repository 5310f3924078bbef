#!/usr/bin/env bash
# Makes (once) the virtual environment the benchmark's peers run in: PyTorch 2 (CPU use only), ONNX Runtime,
# OpenVINO, onnx (to build ONNX graphs) and numpy, at pinned versions, from the Python package index. It belongs to
# the benchmark alone: neither the product nor its test suite uses it, and the system Python is not touched.
#   tests/bench/peers-env.sh        prints the path of the Python to run the peers with (its last line)
# Idempotent: a complete environment at these versions is reused (about 2 s). Environment:
#   MHA_PEERS_VENV   where (default ~/.cache/mhaserve/peers-venv, outside the source tree, shared by worktrees)
#   MHA_PEERS_CUDA   "system" (default: try the CUDA toolkit below first) or "wheels" (PyPI's CUDA wheels only)
#
# PyPI's Linux torch wheels link the CUDA 13 libraries even when only the CPU is used (libtorch_cuda.so is a
# DT_NEEDED of libtorch.so), and `pip install torch` pulls them as nvidia-* wheels plus triton: 5.3 GB. Without
# them torch does not import. The lighter way, tried first: torch without dependencies, its pure-Python
# requirements, and only the four CUDA wheels whose libraries the CUDA 13 toolkit of this project's machines
# (/usr/local/cuda/lib) lacks or has too old a version of (cuFile, cuSPARSELt, NVSHMEM, NCCL); `peers-python` then
# runs Python with that folder on LD_LIBRARY_PATH. If torch does not import that way (no toolkit, another CUDA
# version), every CUDA wheel torch asks for is installed instead, still without triton (1 GB; only
# torch.compile on a GPU uses it). docs/DESIGN.md says why the environment is made so.
set -euo pipefail

venv=${MHA_PEERS_VENV:-$HOME/.cache/mhaserve/peers-venv}
cuda_mode=${MHA_PEERS_CUDA:-system}
system_cuda=/usr/local/cuda/lib
torch_pkg=torch==2.15.0
others=(numpy==2.4.6 onnx==1.23.2 onnxruntime==1.32.0 openvino==2026.4.1)
versions="$torch_pkg ${others[*]}"
launcher="$venv/bin/peers-python"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q install --no-cache-dir)
# One maker at a time: ctest runs the suites that need this environment side by side.
mkdir -p "$(dirname "$venv")"
exec 9>>"$venv.lock"
flock 9

# pip install, quiet; pip's complaint that torch's CUDA and triton requirements are missing is expected here.
pip_install() {
  "${pip[@]}" "$@" 2>&1 | { grep -v -e "dependency resolver does not" -e "^torch .* requires " || true; } >&2
  return "${PIPESTATUS[0]}"
}

# A tiny scaled_dot_product_attention: torch imports (its CUDA libraries resolve) and computes on the CPU.
check() {
  "$launcher" -c 'import torch, onnxruntime, openvino
q = torch.ones(1, 1, 4, 8)
assert torch.nn.functional.scaled_dot_product_attention(q, q, q).shape == q.shape' 2>&1 | tail -3
  return "${PIPESTATUS[0]}"
}

write_launcher() {  # $1: extra library folder, or empty
  {
    echo '#!/bin/sh'
    echo '# Written by tests/bench/peers-env.sh: the venv'\''s Python, with the CUDA libraries torch links found.'
    [[ -n $1 ]] && echo "export LD_LIBRARY_PATH=$1\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "exec \"$venv/bin/python\" \"\$@\""
  } >"$launcher"
  chmod +x "$launcher"
}

# Requirements of the installed torch wheel: "pure" (no CUDA, no triton) or "cuda" (the CUDA wheels, no triton).
torch_requirements() {
  "$venv/bin/python" - "$1" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("torch"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "triton":
        continue
    cuda = req.name.startswith(("nvidia-", "cuda-"))
    if cuda == (sys.argv[1] == "cuda"):
        print(line.split(";")[0].strip())
EOF
}

if [[ -x $launcher && "$(cat "$venv/.complete" 2>/dev/null)" == "$versions" ]] && check >/dev/null; then
  echo "$launcher"
  exit 0
fi

start=$(date +%s)
if [[ ! -x $venv/bin/python ]]; then
  if ! /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >&2
  fi
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv "$venv"
fi
rm -f "$venv/.complete"
echo "peers-env: installing ${others[*]} $torch_pkg into $venv" >&2
pip_install "${others[@]}" packaging
pip_install --no-deps "$torch_pkg"
mapfile -t pure < <(torch_requirements pure)
pip_install "${pure[@]}"

ok=""
if [[ $cuda_mode == system && -e $system_cuda/libcudart.so.13 ]]; then
  # The four CUDA wheels the toolkit cannot stand in for, at the versions torch pins (cuFile through the
  # cuda-toolkit meta-package's extra).
  mapfile -t cuda < <(torch_requirements cuda)
  light=()
  for req in "${cuda[@]}"; do
    case $req in
      nvidia-cusparselt-*|nvidia-nccl-*|nvidia-nvshmem-*) light+=("$req") ;;
      cuda-toolkit*) light+=("cuda-toolkit[cufile]==${req##*==}") ;;
    esac
  done
  pip_install "${light[@]}"
  write_launcher "$system_cuda"
  if check >&2; then ok=system; else echo "peers-env: torch does not load against $system_cuda" >&2; fi
fi
if [[ -z $ok ]]; then
  mapfile -t cuda < <(torch_requirements cuda)
  pip_install "${cuda[@]}"
  write_launcher ""
  check >&2 || { echo "peers-env: torch does not import in $venv" >&2; exit 1; }
  ok=wheels
fi
echo "$versions" >"$venv/.complete"
echo "peers-env: ready in $(($(date +%s) - start)) s, CUDA libraries from $ok, $(du -sh "$venv" | cut -f1)" >&2
echo "$launcher"
