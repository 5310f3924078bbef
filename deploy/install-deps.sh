#!/usr/bin/env bash
# Installs the Debian bookworm packages mhaserve needs, and nothing when they are all present (idempotent).
#   deploy/install-deps.sh              build + test dependencies
#   deploy/install-deps.sh --build-only build dependencies only (container build stage)
#   deploy/install-deps.sh --container  also podman, buildah, debootstrap, runc, catatonit (deploy/container-test.sh)
#   deploy/install-deps.sh --deploy     also nginx, yamllint, python3-yaml (deploy/scale-out-test.sh,
#                                       deploy/check-k8s.sh)
# --container and --deploy add to the default set (or to --build-only's), and combine with each other.
set -euo pipefail

build_packages=(
  cmake ninja-build g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers   # oneDNN 2.6.3; its CMake config looks for OpenCL
  libspdlog-dev libfmt-dev libabsl-dev nlohmann-json3-dev prometheus-cpp-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
test_packages=(
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-pytest
  python3-venv python3-setuptools   # the Python client installed as a package (tests/python_package_test.sh)
  openssl   # throwaway certificates for the TLS tests
  clang libclang-rt-14-dev   # libFuzzer and its sanitizers (tests/fuzz/run.sh)
)
# Rootful, daemonless podman; runc because crun fails on hybrid cgroups; debootstrap makes the base image locally.
container_packages=(podman buildah debootstrap runc catatonit)
# nginx-light has the grpc and http2 modules; python3-yaml reads the manifests in deploy/check-k8s.sh.
deploy_packages=(nginx-light yamllint python3 python3-yaml)

build_only=0 container=0 deploy=0
for arg in "$@"; do
  case "$arg" in
    --build-only) build_only=1 ;;
    --container) container=1 ;;
    --deploy) deploy=1 ;;
    *) echo "install-deps: unknown option $arg (expected --build-only, --container or --deploy)" >&2; exit 2 ;;
  esac
done

packages=("${build_packages[@]}")
if [[ $build_only -eq 0 ]]; then packages+=("${test_packages[@]}"); fi
if [[ $container -eq 1 ]]; then packages+=("${container_packages[@]}"); fi
if [[ $deploy -eq 1 ]]; then packages+=("${deploy_packages[@]}"); fi

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
# The test tools (nginx above all) must not start as system services on install: a policy-rc.d that denies every
# start, only for this install and only where the machine has none of its own.
if [[ $((container + deploy)) -gt 0 && ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod 755 /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
