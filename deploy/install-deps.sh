#!/usr/bin/env bash
# Installs the Debian bookworm packages mhaserve needs, and nothing when they are all present (idempotent).
#   deploy/install-deps.sh              build + test dependencies
#   deploy/install-deps.sh --build-only build dependencies only (container build stage)
set -euo pipefail

build_packages=(
  cmake ninja-build g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers   # oneDNN 2.6.3; its CMake config looks for OpenCL
  libspdlog-dev libfmt-dev libabsl-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
test_packages=(
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-pytest
)

packages=("${build_packages[@]}")
if [[ "${1:-}" != "--build-only" ]]; then
  packages+=("${test_packages[@]}")
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
