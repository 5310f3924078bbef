#!/usr/bin/env bash
# Installs the Debian bookworm packages mhaserve needs, and nothing when they are all present (idempotent).
#   deploy/install-deps.sh              build + test dependencies
#   deploy/install-deps.sh --build-only build dependencies only (container build stage)
#   deploy/install-deps.sh --container  also podman, buildah, debootstrap, runc, catatonit (deploy/container-test.sh)
#   deploy/install-deps.sh --deploy     also nginx, yamllint, python3-yaml (deploy/scale-out-test.sh,
#                                       deploy/check-k8s.sh)
# --container and --deploy add to the default set (or to --build-only's), and combine with each other.
#   --log FILE: apt's output goes to FILE instead of the terminal, which gets one line per step.
# Packages already installed are not upgraded (apt-get --no-upgrade), except where a new package needs a newer
# version of one: then the script names them before it installs.
set -euo pipefail

build_packages=(
  cmake ninja-build g++ pkg-config ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers   # oneDNN 2.6.3; its CMake config looks for OpenCL
  libspdlog-dev libfmt-dev libabsl-dev nlohmann-json3-dev prometheus-cpp-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
test_packages=(
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch python3-pytest python3-h2
  python3-venv python3-setuptools   # the Python client installed as a package (tests/python_package_test.sh)
  openssl   # throwaway certificates for the TLS tests
  clang libclang-rt-14-dev   # libFuzzer and its sanitizers (tests/fuzz/run.sh)
)
# Rootful, daemonless podman; runc because crun fails on hybrid cgroups; debootstrap makes the base image locally.
container_packages=(podman buildah debootstrap runc catatonit)
# nginx-light has the grpc and http2 modules; python3-yaml reads the manifests in deploy/check-k8s.sh.
deploy_packages=(nginx-light yamllint python3 python3-yaml python3-venv python3-grpcio python3-h2)

build_only=0 container=0 deploy=0 log=/dev/stdout
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-only) build_only=1 ;;
    --container) container=1 ;;
    --deploy) deploy=1 ;;
    --log) log=$2; shift ;;
    *) echo "install-deps: unknown option $1 (expected --build-only, --container, --deploy or --log FILE)" >&2
       exit 2 ;;
  esac
  shift
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
export DEBIAN_FRONTEND=noninteractive
# run WHAT COMMAND...: the command's output to the log; on failure the log's end, and exit 1.
run() {
  local what=$1
  shift
  if ! "$@" >>"$log" 2>&1; then
    echo "install-deps: $what failed" >&2
    [[ $log != /dev/stdout ]] && { echo "the last lines of $log:" >&2; tail -n 30 "$log" >&2; }
    exit 1
  fi
}
# The test tools (nginx above all) must not start as system services on install: a policy-rc.d that denies every
# start, only for this install and only where the machine has none of its own.
if [[ $((container + deploy)) -gt 0 && ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod 755 /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
echo "install-deps: ${#missing[@]} of ${#packages[@]} packages missing; updating the package lists"
run "apt-get update" $SUDO apt-get update -qq
install=(apt-get install -y -qq --no-install-recommends --no-upgrade "${missing[@]}")
# A dry run says what apt will do: "Inst NAME [OLD] (NEW ...)" is an upgrade of an installed package.
plan=$(apt-get -s "${install[@]:1}" 2>>"$log" || true)
total=$(grep -c '^Inst ' <<<"$plan" || true)
upgrades=$(awk '/^Inst [^ ]+ \[/ {print $2}' <<<"$plan" | tr '\n' ' ')
echo "install-deps: installing ${missing[*]} ($total packages with their dependencies)"
if [[ -n $upgrades ]]; then
  echo "install-deps: apt must also upgrade installed packages that these need in newer versions: $upgrades"
fi
run "apt-get install" $SUDO "${install[@]}"
echo "install-deps: installed"
