#!/usr/bin/env bash
# Quick start: installs the Debian packages that are missing, builds the server and the client (not the tests:
# deploy/test.sh builds those), and runs mha_server in the foreground with the built-in "demo" layer on
# 127.0.0.1:50051. Arguments are passed to mha_server (e.g. --listen 0.0.0.0:50051 --layers_dir DIR).
# One line per step on the terminal; apt's, cmake's and the compiler's output go to build/serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
log=$PWD/build/serve.log
: >"$log"
if [[ ! -x build/bin/mha_server ]]; then
  echo "serve: a first run builds for about 2.5 minutes on 2 cores, after installing any missing packages;" \
    "details in $log"
fi
deploy/install-deps.sh --log "$log"
deploy/build.sh --log "$log" --target mha_server --target mha_client
echo "serve: starting build/bin/mha_server $* (Ctrl-C stops it)"
exec build/bin/mha_server "$@"
