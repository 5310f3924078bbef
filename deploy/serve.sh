#!/usr/bin/env bash
# Quick start: installs what is missing, builds, and runs mha_server in the foreground with the built-in "demo"
# layer on 127.0.0.1:50051. Arguments are passed to mha_server (e.g. --listen 0.0.0.0:50051 --layers_dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
exec build/bin/mha_server "$@"
