#!/usr/bin/env bash
# llama.cpp built from the sources that llama-cpp-python's source distribution vendors, in a work folder outside the
# tree (never committed), for the peers that measure against it by hand (llama_cpp_peer.sh,
# tests/models/llama_cpp_cache_quality.sh).
#   llama_cpp_build.sh WORK              downloads and unpacks the sources once; prints their folder (last line)
#   llama_cpp_build.sh WORK TARGET...    also configures WORK/build (native CPU, OpenMP) and builds the targets;
#                                        prints the folder of the binaries (last line)
set -euo pipefail
work=$1
shift
version=0.3.36
mkdir -p "$work"
cd "$work"
if [[ ! -d llama_cpp_python-$version ]]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d . -q >&2
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src=$work/llama_cpp_python-$version/vendor/llama.cpp
if (($# == 0)); then
  echo "$src"
  exit 0
fi
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=ON \
  -DLLAMA_CURL=OFF -DGGML_OPENMP=ON >/dev/null
cmake --build "$work/build" --target "$@" >/dev/null
echo "$work/build/bin"
