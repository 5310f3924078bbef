#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (C++ GoogleTest and the Python end-to-end
# tests against the real server) through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
cd build
ctest --output-on-failure --timeout 900 "$@"
