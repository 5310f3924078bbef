# Sourced by the shell tests: a scratch folder and the real mha_server on a free loopback port, both cleaned up on
# exit (only the server this script started, by its PID).
#   source tests/server_lib.sh   then   start_server MHA_SERVER [FLAGS...]   sets server_pid and target
#   stop_server                  SIGTERM, and fails unless the server exits 0
work=$(mktemp -d)
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then kill -KILL "$server_pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT

start_server() {
  local binary=$1
  shift
  rm -f "$work/port"
  "$binary" --listen 127.0.0.1:0 --port_file "$work/port" --threads 2 "$@" >"$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 100); do [[ -s "$work/port" ]] && break; sleep 0.1; done
  [[ -s "$work/port" ]] || { echo "server did not start"; cat "$work/server.log"; exit 1; }
  target="127.0.0.1:$(cat "$work/port")"
}

stop_server() {
  kill -TERM "$server_pid"
  local status=0
  wait "$server_pid" || status=$?
  server_pid=""
  [[ $status -eq 0 ]] || { echo "server exited with $status after SIGTERM"; cat "$work/server.log"; exit 1; }
}
