#!/usr/bin/env bash
# The real binaries with transport security and tokens: mha_server with TLS, mutual TLS and a tokens file;
# mha_client with the matching flags; SIGHUP reloading the tokens; and startup errors that end the process with
# exit code 1 and one line naming the flag (never a crash). Certificates are made here with openssl.
# Usage: security_cli_test.sh MHA_SERVER MHA_CLIENT
set -euo pipefail
server=$(realpath "$1")
client=$(realpath "$2")
source "$(dirname "$0")/server_lib.sh"
source "$(dirname "$0")/test_certs.sh"
fail() { echo "FAIL: $*"; [[ -f $work/server.log ]] && tail -20 "$work/server.log"; exit 1; }

# A CA, a server certificate for 127.0.0.1, and a client certificate. The servers keep their private copies of the
# TLS files in a TMPDIR of this test's own.
cd "$work"
export TMPDIR=$work/tmp
mkdir -p "$TMPDIR"
make_test_certs "$work" pem server client
printf 'compute-token-0123456789\nadmin-token-0123456789ab admin\n' >tokens
echo compute-token-0123456789 >compute.token
echo fresh-token-0123456789ab >fresh.token

# Startup errors: exit code 1 and a "cannot start" line naming the flag.
expect_start_error() {  # expected-substring flags...
  local want=$1 status=0
  shift
  "$server" --listen 127.0.0.1:0 "$@" >start.log 2>&1 || status=$?
  [[ $status -eq 1 ]] || fail "mha_server $* exited with $status, expected 1"
  grep -q "cannot start.*$want" start.log || fail "mha_server $*: no 'cannot start ... $want' in: $(cat start.log)"
}
expect_start_error "--backend" --backend=bogus
expect_start_error "--layers_dir" --layers_dir=/nonexistent
expect_start_error "--tls_key" --tls_cert=server.pem --tls_key=client.key
expect_start_error "--tls_cert" --tls_cert=/nonexistent.pem --tls_key=server.key
expect_start_error "--auth_tokens_file" --auth_tokens_file=/nonexistent
expect_start_error "--listen 1.2.3.4:1: 1.2.3.4 is not an address of this machine" --listen=1.2.3.4:1

start_server "$server" --tls_cert server.pem --tls_key server.key --tls_client_ca ca.pem --auth_tokens_file tokens
tls=(--target "$target" --tls_ca ca.pem --tls_cert client.pem --tls_key client.key)

# A second server on the same port fails to start instead of sharing it.
expect_start_error "--listen $target: port ${target##*:} is in use by another process" --listen="$target"

"$client" health "${tls[@]}" --timeout_s 5 || fail "health over mutual TLS"
"$client" call "${tls[@]}" --token_file compute.token --batch 2 --seq 8 --check >/dev/null || fail "call with a token"
if "$client" call "${tls[@]}" --seq 8 2>err; then fail "a call without a token succeeded"; fi
grep -q UNAUTHENTICATED err || fail "no UNAUTHENTICATED: $(cat err)"
if "$client" health --target "$target" --timeout_s 3 2>/dev/null; then fail "a plaintext client was served"; fi

# SIGHUP re-reads the tokens.
printf 'fresh-token-0123456789ab\n' >tokens
kill -HUP "$server_pid"
for _ in $(seq 50); do grep -q "reloaded 1 bearer tokens" server.log && break; sleep 0.1; done
"$client" call "${tls[@]}" --token_file fresh.token --seq 8 >/dev/null || fail "the new token after SIGHUP"
if "$client" call "${tls[@]}" --token_file compute.token --seq 8 2>/dev/null; then fail "the old token still works"; fi
! grep -q "compute-token-0123456789\|fresh-token-0123456789ab" server.log || fail "a token appears in the log"

stop_server

# The private copies of the key: gone after a stop (the server ends without destructors), and what a killed server
# left is removed by the next start.
[[ -z "$(ls -d "$TMPDIR"/mha-tls-* 2>/dev/null)" ]] || fail "key copies left after SIGTERM: $(ls -d "$TMPDIR"/mha-tls-*)"
start_server "$server" --tls_cert server.pem --tls_key server.key
kill -KILL "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=""
[[ -n "$(ls -d "$TMPDIR"/mha-tls-* 2>/dev/null)" ]] || fail "a killed server left no copies: the check tests nothing"
start_server "$server" --tls_cert server.pem --tls_key server.key
[[ $(ls -d "$TMPDIR"/mha-tls-* | wc -l) -eq 1 ]] || fail "a killed server's copies survived the next start"
stop_server
[[ -z "$(ls -d "$TMPDIR"/mha-tls-* 2>/dev/null)" ]] || fail "key copies left after SIGTERM"
echo "security cli: passed"
