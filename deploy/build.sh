#!/usr/bin/env bash
# Configures (once) and builds mhaserve in build/ (Release). Extra arguments go to the first cmake configure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build build
