#!/usr/bin/env bash
# Runs README's container lines as written (base image, build, removal of the build stage's image, run on
# 127.0.0.1:50051 and a checked call), then runs the image for real on free loopback ports: health (the image's own
# HEALTHCHECK, which must find the port the server bound), info, demo-layer calls checked against the reference
# backend from a second container, then SIGTERM during a long call (it must finish, and the container must exit 0), once
# under podman's --init and once with the server itself as PID 1 on a read-only root without capabilities (as the
# Kubernetes Deployment runs it). Then the cuda variant, built with docs/DEPLOY.md's lines as written (the
# toolkit at /usr/local/cuda-13.0 mounted for the build): on this machine, without a GPU, its server must report
# the CUDA backend compiled in but unavailable, with the driver's reason, and serve on the CPU; cuBLAS must load by
# its soname. Containers are removed; the images stay cached.
#
#   deploy/container-test.sh                     both variants
#   MHA_CONTAINER_CUDA=0 deploy/container-test.sh  the cpu image only (CI builds both)
#
# State lives in build/containers/ (override with MHA_CONTAINER_DIR): storage.conf, the overlay graphroot and the
# debootstrapped base image localhost/debian:bookworm, made once (about a minute) and reused. Every container
# uses --network=host (podman's default bridge would rewrite the host's firewall) and binds 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
t_start=$(date +%s)
step() { echo "container-test: [$(($(date +%s) - t_start)) s] $*"; }

deploy/install-deps.sh --container

state=${MHA_CONTAINER_DIR:-$root/build/containers}
mkdir -p "$state"
state=$(cd "$state" && pwd)
# Both variants' layers (the cuda build copies cuBLAS in) need a few GiB; a full disk fails deep inside podman with
# "no space left on device", so say it first.
need_gib=${MHA_CONTAINER_FREE_GIB:-4}
free_gib=$(df --output=avail -B1G "$state" | tail -1 | tr -d ' ')
[[ $free_gib -ge $need_gib ]] || {
  echo "container-test: FAILED: ${free_gib} GiB free under $state; the two images' builds need ${need_gib} GiB" \
    "(old checkouts' build/containers/ hold about 4 GiB each)" >&2
  exit 1
}
# The run root (locks, mount state; on tmpfs, so that a reboot clears it) is this storage's own: two checkouts'
# storages must not share one.
cat >"$state/storage.conf" <<EOF
# Written by deploy/container-test.sh.
[storage]
driver = "overlay"
graphroot = "$state/storage"
runroot = "/run/mhaserve-containers-$(printf %s "$state" | sha256sum | cut -c1-12)"
EOF
export CONTAINERS_CONF=$root/deploy/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$state/storage.conf

image=localhost/mhaserve:0.1.0  # what README's lines build
cuda_image=localhost/mhaserve:0.1.0-cuda  # what docs/DEPLOY.md's cuda lines build
work=$(mktemp -d)
run_name=mhaserve-ct-$$
podman_pid=""
cleanup() {
  if podman container exists "$run_name" 2>/dev/null; then podman rm -f -t 0 "$run_name" >/dev/null || true; fi
  if [[ -n "$podman_pid" ]] && kill -0 "$podman_pid" 2>/dev/null; then kill -KILL "$podman_pid" || true; fi
  if podman container exists mhaserve 2>/dev/null; then podman rm -f -t 0 mhaserve >/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# doc_lines FILE MARKER: the shell lines between "<!-- MARKER -->" and "<!-- /MARKER -->" in FILE, code fences
# left out, a line ending in a backslash joined with the next.
doc_lines() {
  awk -v begin="<!-- $2 -->" -v end="<!-- /$2 -->" '$0 == begin { on = 1; next } $0 == end { on = 0 }
    on && !/^```/ { if (sub(/\\$/, "")) { joined = joined $0; next } print joined $0; joined = "" }' "$1"
}
# run_doc_line WHERE LINE: evals one documented line; its output is shown only when it fails.
run_doc_line() {
  step "$1: $2"
  eval "$2" >"$work/line.log" 2>&1 || { tail -60 "$work/line.log"; echo "container-test: FAILED: $2"; exit 1; }
}

# --- README's container lines, as written: base image, build, build stage's image removed, then the run line -------
# The lines export CONTAINERS_CONF themselves; the storage stays this script's (CONTAINERS_STORAGE_CONF above).
t_build=$(date +%s)
mapfile -t readme_lines < <(doc_lines README.md container-lines)
[[ ${#readme_lines[@]} -ge 4 ]] || { echo "container-test: no container lines in README.md"; exit 1; }
run_line=""
for line in "${readme_lines[@]}"; do
  if [[ $line == "podman run "* ]]; then run_line=$line; continue; fi
  run_doc_line README "$line"
done
[[ -n "$run_line" ]] || { echo "container-test: README has no podman run line"; exit 1; }
build_s=$(($(date +%s) - t_build))
size_mb=$(( $(podman image inspect --format '{{.Size}}' "$image") / 1000000 ))
step "built $image: ${size_mb} MB in ${build_s} s (base image and build, README's lines)"
# check_built IMAGE VARIANT: the image carries the health check and its variant's label, and the build left no
# build-stage image behind.
check_built() {
  if ! podman image inspect --format '{{json .Config.Healthcheck}}' "$1" | grep -q 'mha_client health'; then
    echo "container-test: FAILED: $1 has no mha_client health HEALTHCHECK"; exit 1
  fi
  local variant
  variant=$(podman image inspect --format '{{index .Config.Labels "mhaserve.variant"}}' "$1")
  [[ $variant == "$2" ]] || { echo "container-test: FAILED: $1 is labelled mhaserve.variant=$variant, not $2"; exit 1; }
  if [[ -n "$(podman images -q --filter dangling=true --filter label=mhaserve.stage=build)" ]]; then
    echo "container-test: FAILED: the build left its build stage's image behind"; exit 1
  fi
}
check_built "$image" cpu

# --- run ------------------------------------------------------------------------------------------------------
fail() { echo "container-test: FAILED: $*"; if [[ -s "$work/server.log" ]]; then cat "$work/server.log"; fi; exit 1; }
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# A second container calling the server over loopback, as another service would.
client() { podman run --rm --network=host --no-healthcheck --entrypoint /usr/local/bin/mha_client "$image" "$@"; }

# await_healthy NAME: until `podman healthcheck run NAME` (the image's own HEALTHCHECK) reports healthy. (The
# healthcheck timer podman would start needs systemd, absent here: podman logs that.)
await_healthy() {
  for _ in $(seq 120); do
    if podman healthcheck run "$1" >/dev/null 2>&1; then return 0; fi
    kill -0 "$podman_pid" 2>/dev/null || break
    sleep 0.5
  done
  fail "the container did not become healthy"
}

# start_server PODMAN_RUN_FLAGS...: runs the image in the background on a free loopback port, not the default one
# (sets port and podman_pid), and waits until the image's own health check, which must find that port, passes.
start_server() {
  port=$(free_port)
  metrics_port=$(free_port)
  podman run --rm --network=host --name "$run_name" "$@" \
    "$image" --listen "127.0.0.1:$port" --metrics_listen "127.0.0.1:$metrics_port" --threads 2 \
    >"$work/server.log" 2>&1 &
  podman_pid=$!
  await_healthy "$run_name"
}

# stop_during_long_call STOP_COMMAND...: a long call from the client container (about 4 s on the reference
# backend's plain loops, which performance work leaves alone), STOP_COMMAND a second after its connection is up,
# then: the call succeeded, the container exited 0, and the call was logged as OK after the server received
# SIGTERM (it was in flight and drained, not refused).
stop_during_long_call() {
  client call --target "127.0.0.1:$port" --backend reference --batch 4 --seq 512 --timeout_s 120 \
    >"$work/long.out" 2>&1 &
  local client_pid=$!
  for _ in $(seq 200); do
    [[ -n "$(ss -tnH state established "( dport = :$port )")" ]] && break
    sleep 0.1
  done
  sleep 1
  "$@" >/dev/null
  local client_status=0 server_status=0
  wait "$client_pid" || client_status=$?
  wait "$podman_pid" || server_status=$?
  podman_pid=""
  cat "$work/long.out"
  [[ $client_status -eq 0 ]] || fail "the in-flight call failed"
  [[ $server_status -eq 0 ]] || fail "the container exited $server_status after SIGTERM"
  awk '/received SIGTERM/ { term = 1 } term && /query\[4, 512, 512\].*status=OK/ { drained = 1 }
       /stopped/ { stopped = 1 } END { exit !(drained && stopped) }' "$work/server.log" ||
    fail "no call drained after SIGTERM in the log"
  if podman container exists "$run_name"; then fail "the container was not removed"; fi
}

step "README: $run_line"
eval "$run_line" >"$work/server.log" 2>&1 &
podman_pid=$!
await_healthy mhaserve
client call --target 127.0.0.1:50051 --batch 1 --seq 16 --check || fail "a call to README's container"
podman stop -t 30 mhaserve >/dev/null
wait "$podman_pid" || fail "README's container exited $? after podman stop"
podman_pid=""

step "run 1: podman run --init; health, info and checked calls from a second container"
start_server --init
[[ $(podman exec "$run_name" id -u) == 10001 ]] || fail "the server does not run as uid 10001"
client health --target "127.0.0.1:$port" --timeout_s 5
client info --target "127.0.0.1:$port" >"$work/info.txt" || fail "info"
grep -q "layer demo" "$work/info.txt" || fail "info lists no demo layer"
grep -Eq '^ +backend cuda +unavailable .*not compiled' "$work/info.txt" ||
  fail "the cpu image's server does not report cuda as not compiled in: $(grep 'backend cuda' "$work/info.txt")"
client call --target "127.0.0.1:$port" --batch 2 --seq 64 --causal --check
client call --target "127.0.0.1:$port" --batch 1 --seq 16 --dtype fp16 --weights --check
/usr/bin/python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(
    'http://127.0.0.1:$metrics_port/metrics', timeout=5).read().decode())" >"$work/metrics.txt" ||
  fail "no /metrics on port $metrics_port"
grep -q 'mha_requests_total{backend="cpu",code="OK",rpc="MultiHeadAttention"} 2' "$work/metrics.txt" ||
  fail "/metrics does not count the two checked cpu calls"
step "run 1: SIGTERM (through podman's init) during a call"
stop_during_long_call podman kill --signal TERM "$run_name"

# As the Kubernetes Deployment runs it: read-only root, no capabilities, no privilege escalation.
step "run 2: mha_server as PID 1 (no --init), read-only, no capabilities; podman stop during a call"
start_server --read-only --cap-drop=all --security-opt=no-new-privileges
[[ $(podman exec "$run_name" cat /proc/1/comm) == mha_server ]] || fail "PID 1 is not mha_server"
podman exec "$run_name" /bin/sleep 0 || fail "no /bin/sleep for the Kubernetes preStop hook"
stop_during_long_call podman stop -t 40 "$run_name"

cpu_s=$(($(date +%s) - t_start))
if [[ ${MHA_CONTAINER_CUDA:-1} == 0 ]]; then
  step "passed (cpu image only, MHA_CONTAINER_CUDA=0): image ${size_mb} MB, base image and build ${build_s} s," \
    "total ${cpu_s} s"
  exit 0
fi

# --- the cuda variant: docs/DEPLOY.md's lines, as written, then run without a GPU ----------------------------------
t_cuda=$(date +%s)
[[ -x /usr/local/cuda-13.0/bin/nvcc ]] ||
  { echo "container-test: FAILED: the cuda variant needs the CUDA 13 toolkit at /usr/local/cuda-13.0" \
      "(MHA_CONTAINER_CUDA=0 skips it)"; exit 1; }
mapfile -t cuda_lines < <(doc_lines docs/DEPLOY.md cuda-container-lines)
[[ ${#cuda_lines[@]} -ge 2 ]] || { echo "container-test: no cuda-container-lines in docs/DEPLOY.md"; exit 1; }
for line in "${cuda_lines[@]}"; do run_doc_line DEPLOY.md "$line"; done
cuda_build_s=$(($(date +%s) - t_cuda))
cuda_size_mb=$(( $(podman image inspect --format '{{.Size}}' "$cuda_image") / 1000000 ))
check_built "$cuda_image" cuda
step "built $cuda_image: ${cuda_size_mb} MB in ${cuda_build_s} s (docs/DEPLOY.md's lines)"

image=$cuda_image  # client() and start_server() run this image from here on
# The loader finds cuBLAS by the soname the server dlopens, and it loads (as uid 10001): LD_PRELOAD searches as
# dlopen does, and warns when it cannot load the library.
preload=$(podman run --rm --no-healthcheck --entrypoint /bin/sh "$image" \
  -c 'LD_PRELOAD=libcublas.so.13 /bin/true' 2>&1) || fail "LD_PRELOAD=libcublas.so.13 /bin/true failed: $preload"
[[ -z $preload ]] || fail "cuBLAS does not load in $image: $preload"

# As Kubernetes runs it, with no GPU passed in (none here, and none wanted: the check must read the same on a
# machine with one): the server starts, reports cuda compiled in but unavailable with the driver's reason, and
# serves on the CPU; a call that asks for cuda gets UNAVAILABLE.
step "run 3 ($image): no GPU; read-only, no capabilities"
start_server --read-only --cap-drop=all --security-opt=no-new-privileges
client info --target "127.0.0.1:$port" >"$work/info.txt" || fail "info"
cat "$work/info.txt"
cuda_line=$(grep -E '^ +backend cuda ' "$work/info.txt") || fail "info lists no cuda backend"
[[ $cuda_line =~ ^\ +backend\ cuda\ +unavailable\ +(.+)$ ]] || fail "cuda is not reported unavailable: $cuda_line"
cuda_reason=${BASH_REMATCH[1]}
[[ $cuda_reason != *"not compiled"* ]] || fail "the cuda image's server has no CUDA backend: $cuda_reason"
grep -Eq '^version .*, default backend cpu, instance [^ ]+$' "$work/info.txt" || fail "the default backend is not cpu without a GPU"
client call --target "127.0.0.1:$port" --batch 2 --seq 64 --check >"$work/call.out" || fail "a checked call"
cat "$work/call.out"
grep -q ', backend cpu,' "$work/call.out" || fail "the call did not run on the cpu backend"
cuda_call_status=0
client call --target "127.0.0.1:$port" --backend cuda --batch 1 --seq 16 >"$work/call.out" 2>&1 || cuda_call_status=$?
cat "$work/call.out"
if [[ $cuda_call_status -eq 0 ]] || ! grep -q UNAVAILABLE "$work/call.out"; then
  fail "a call asking for cuda did not get UNAVAILABLE"
fi
podman stop -t 30 "$run_name" >/dev/null
wait "$podman_pid" || fail "the container exited $? after podman stop"
podman_pid=""
cuda_s=$(($(date +%s) - t_cuda))

total_s=$(($(date +%s) - t_start))
step "passed: cpu image ${size_mb} MB (base image and build ${build_s} s, all cpu checks ${cpu_s} s);" \
  "cuda image ${cuda_size_mb} MB (build ${cuda_build_s} s, all cuda checks ${cuda_s} s); total ${total_s} s"
