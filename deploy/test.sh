#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (C++ GoogleTest and the Python end-to-end
# tests against the real server) through ctest, one test per core at a time (tests that need the machine to
# themselves are marked RUN_SERIAL). Arguments go to ctest (e.g. -R flags_doc, -j1).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
deploy/build.sh
cd build
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"
