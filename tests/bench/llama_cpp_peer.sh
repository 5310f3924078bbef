#!/usr/bin/env bash
# The decode peer for the 8-bit caches (docs/PERFORMANCE.md, "8-bit caches"): llama.cpp's own CPU flash attention
# (ggml's FLASH_ATTN_EXT, timed by its test-backend-ops perf mode) with f16 and q8_0 caches, on decode_bench's
# single-session shapes: one token of 32 query heads over 8 KV heads of d_k 128, 8192 and 16384 cached tokens.
# Built by llama_cpp_build.sh (the sources llama-cpp-python's source distribution vendors, outside the tree); the
# shapes are added to test-backend-ops' perf cases there. By hand:
#   tests/bench/llama_cpp_peer.sh [work folder, default ~/.cache/mhaserve/llama-cpp]
# Prints test-backend-ops' lines for those cases (its time per run, and its GB/s, which count the tensors' bytes)
# and the bytes each case's K and V hold, for a bytes-per-second comparison with decode_bench's.
set -euo pipefail
work=${1:-$HOME/.cache/mhaserve/llama-cpp}
here=$(cd "$(dirname "$0")" && pwd)
src=$("$here/llama_cpp_build.sh" "$work" | tail -1)
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
bin=$("$here/llama_cpp_build.sh" "$work" test-backend-ops | tail -1)
"$bin/test-backend-ops" perf -o FLASH_ATTN_EXT -b CPU -p 'hsk=128,hsv=128,nh=8,nr23=\[4,1\],kv=(8192|16384),nb=1,' |
  grep -E "FLASH_ATTN_EXT|Backend"
# K and V of one cache: 8 KV heads x 128 x kv tokens each; f16 2 bytes an element, q8_0 34 bytes per 32.
for kv in 8192 16384; do
  echo "kv=$kv: f16 K+V $((2 * 8 * 128 * kv * 2 / 1048576)) MiB, q8_0 K+V $((2 * 8 * 128 * kv / 32 * 34 / 1048576)) MiB"
done
