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
#
#   deploy/scale-out-test.sh [MHA_SERVER MHA_CLIENT]     (default: build/bin/, built if missing)
#   env: MHA_SCALE_REQUESTS (calls per phase, default 150), MHA_SCALE_CONCURRENCY (default 6)
#
# Loopback only; nginx runs in the foreground as this script's child with its own prefix, pid and logs in a temp
# folder; only the processes started here are stopped.
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

work=$(mktemp -d)
chmod 755 "$work"  # nginx's workers (nobody when started as root) use the temp folders inside
server_pids=() nginx_pid=""
cleanup() {
  if [[ -n "$nginx_pid" ]] && kill -0 "$nginx_pid" 2>/dev/null; then
    kill -TERM "$nginx_pid"
    wait "$nginx_pid" || true
  fi
  for pid in "${server_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "scale-out: FAILED: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -20 "$f"; done; exit 1; }

# --- 3 replicas -------------------------------------------------------------------------------------------------
ports=()
for i in $(seq "$replicas"); do
  # One compute thread each: three replicas share this machine's cores.
  # Every call logged (--log_max_calls_per_s 0): the checks count each replica's call lines.
  "$server" --listen 127.0.0.1:0 --port_file "$work/r$i.port" --threads 1 --log_max_calls_per_s 0 >"$work/r$i.log" 2>&1 &
  server_pids+=($!)
done
for i in $(seq "$replicas"); do
  for _ in $(seq 100); do [[ -s "$work/r$i.port" ]] && break; sleep 0.1; done
  [[ -s "$work/r$i.port" ]] || fail "replica $i did not start"
  ports+=("$(cat "$work/r$i.port")")
done
echo "scale-out: replicas on 127.0.0.1:${ports[*]}"

# --- nginx in front ---------------------------------------------------------------------------------------------
nginx_port=$(/usr/bin/python3 -c \
  'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
upstreams=""
for p in "${ports[@]}"; do upstreams+="    server 127.0.0.1:$p;\n"; done
sed -e "s#@PREFIX@#$work#g" -e "s#@LISTEN@#127.0.0.1:$nginx_port#g" -e "s#^@UPSTREAMS@\$#${upstreams%\\n}#" \
  deploy/nginx/mha-grpc.conf.template >"$work/nginx.conf"
"$nginx" -t -q -p "$work" -e "$work/nginx-start.log" -c "$work/nginx.conf" || fail "nginx -t"
"$nginx" -p "$work" -e "$work/nginx-start.log" -c "$work/nginx.conf" -g 'daemon off;' &
nginx_pid=$!
for _ in $(seq 50); do
  "$client" health --target "127.0.0.1:$nginx_port" --timeout_s 1 >/dev/null 2>&1 && break
  kill -0 "$nginx_pid" 2>/dev/null || fail "nginx exited"
  sleep 0.2
done
"$client" health --target "127.0.0.1:$nginx_port" --timeout_s 5 >/dev/null || fail "no health through nginx"

# ok_counts: the number of successful MultiHeadAttention calls in each replica's log, space-separated.
ok_counts() {
  local counts=()
  for i in $(seq "$replicas"); do
    counts+=("$(grep -c 'rpc=MultiHeadAttention .*status=OK' "$work/r$i.log" || true)")
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
  if grep -h 'rpc=' "$work"/r*.log | grep -v 'status=OK' | grep -q .; then
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

# --- sessions through nginx, routed by their id ------------------------------------------------------------------
stubs=$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, "client/python"); import mhaclient_stubs as m; print(m.generate_stubs(sys.argv[1]))' "$work/stubs")
affinity() {
  PYTHONPATH="$root/client/python:$stubs" timeout 60 /usr/bin/python3 deploy/session_affinity.py "127.0.0.1:$nginx_port" 30 "$@"
}
affinity decode >"$work/affinity-decode.json" || fail "sessions: a call failed (see $work/affinity-decode.json)"
# homes.txt: one "id replica" line per session, from the replicas' logs; fails if a session's calls reached two.
/usr/bin/python3 - "$work" "$replicas" >"$work/homes.txt" <<'EOF' || fail "sessions: $(cat "$work/homes.txt")"
import re, sys
work, replicas = sys.argv[1], int(sys.argv[2])
seen = {}
for r in range(1, replicas + 1):
    for sid in set(re.findall(r"session=(affinity-\d+)", open(f"{work}/r{r}.log").read())):
        seen.setdefault(sid, []).append(r)
split = {s: rs for s, rs in seen.items() if len(rs) > 1}
if len(seen) != 30 or split:
    print(f"{len(seen)} sessions seen; on more than one replica: {split}")
    sys.exit(1)
for sid, (r,) in sorted(seen.items()):
    print(sid, r)
EOF
echo "scale-out: sessions: 30 decoding through nginx, per replica: $(for r in $(seq "$replicas"); do grep -c " $r\$" "$work/homes.txt"; done | tr '\n' ' ')"
# Replica 1 is lost: only its sessions may fail.
kill -KILL "${server_pids[0]}"
wait "${server_pids[0]}" 2>/dev/null || true
server_pids=("${server_pids[@]:1}")
affinity step >"$work/affinity-step.json" || fail "sessions: the step after the loss did not run"
/usr/bin/python3 - "$work" <<'EOF' || fail "sessions: after replica 1 was killed: $(cat "$work/affinity-step.json")"
import json, sys
work = sys.argv[1]
lost = {line.split()[0] for line in open(f"{work}/homes.txt") if line.split()[1] == "1"}
step = json.load(open(f"{work}/affinity-step.json"))
failed = {sid for ids in step["failed"].values() for sid in ids}
print(f"scale-out: sessions: replica 1 killed: {len(lost)} of its sessions failed "
      f"({', '.join(sorted(step['failed']))}), the other {step['ok']} went on")
sys.exit(0 if failed == lost and step["ok"] == 30 - len(lost)
         and set(step["failed"]) <= {"NOT_FOUND", "UNAVAILABLE"} else 1)
EOF

# --- stop: nginx, then each replica drains and exits 0 -----------------------------------------------------------
kill -QUIT "$nginx_pid"
wait "$nginx_pid" || fail "nginx exited with $?"
nginx_pid=""
for pid in "${server_pids[@]}"; do
  kill -TERM "$pid"
  status=0
  wait "$pid" || status=$?
  [[ $status -eq 0 ]] || fail "a replica exited with $status after SIGTERM"
done
server_pids=()
echo "scale-out: passed"
