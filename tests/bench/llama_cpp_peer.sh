#!/usr/bin/env bash
# The decode peer for the 8-bit caches (docs/PERFORMANCE.md, "8-bit caches"): llama.cpp's own CPU flash attention
# (ggml's FLASH_ATTN_EXT, timed by its test-backend-ops perf mode) with f16 and q8_0 caches, on decode_bench's
# single-session shapes: one token of 32 query heads over 8 KV heads of d_k 128, 8192 and 16384 cached tokens.
# Built from the llama.cpp sources that llama-cpp-python's source distribution vendors, in a work folder outside
# the tree (never committed); the shapes are added to test-backend-ops' perf cases there. By hand:
#   tests/bench/llama_cpp_peer.sh [work folder, default ~/.cache/mhaserve/llama-cpp]
# Prints test-backend-ops' lines for those cases (its time per run, and its GB/s, which count the tensors' bytes)
# and the bytes each case's K and V hold, for a bytes-per-second comparison with decode_bench's.
set -euo pipefail
work=${1:-$HOME/.cache/mhaserve/llama-cpp}
version=0.3.36
python=$(command -v python3)
mkdir -p "$work"
cd "$work"
if [[ ! -d llama_cpp_python-$version ]]; then
  "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d . -q
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src=$work/llama_cpp_python-$version/vendor/llama.cpp
cases=$src/tests/test-backend-ops.cpp
if ! grep -q "mhaserve decode shapes" "$cases"; then
  # After the Qwen3-VL case, at the start of make_test_cases_perf's attention cases.
  anchor='    // Qwen3-VL-8B https://github.com/ggml-org/llama.cpp/issues/17012'
  shapes='    // mhaserve decode shapes: 1 token, 8 KV heads x 4 query heads each, d_k 128.\n'
  shapes+='    for (int64_t kv : {8192, 16384}) {\n'
  shapes+='      for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_Q8_0}) {\n'
  shapes+='        test_cases.emplace_back(new test_flash_attn_ext(128, 128, 8, {4, 1}, kv, 1, true, false, 0, 0,\n'
  shapes+='                                                        GGML_PREC_F32, t, t));\n'
  shapes+='      }\n'
  shapes+='    }\n'
  grep -qF "$anchor" "$cases"
  sed -i "s|^$anchor|$shapes$anchor|" "$cases"
fi
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=ON \
  -DLLAMA_CURL=OFF -DGGML_OPENMP=ON >/dev/null
cmake --build "$work/build" --target test-backend-ops >/dev/null
"$work/build/bin/test-backend-ops" perf -o FLASH_ATTN_EXT -b CPU -p 'hsk=128,hsv=128,nh=8,nr23=\[4,1\],kv=(8192|16384),nb=1,' |
  grep -E "FLASH_ATTN_EXT|Backend"
# K and V of one cache: 8 KV heads x 128 x kv tokens each; f16 2 bytes an element, q8_0 34 bytes per 32.
for kv in 8192 16384; do
  echo "kv=$kv: f16 K+V $((2 * 8 * 128 * kv * 2 / 1048576)) MiB, q8_0 K+V $((2 * 8 * 128 * kv / 32 * 34 / 1048576)) MiB"
done
