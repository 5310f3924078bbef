#!/usr/bin/env bash
# The GPU check of the CUDA backend, prepared here and run in one call on a GPU machine (docs/GPU.md).
#
#   tests/gpu/device-check.sh --bundle       here: build with CUDA (build/), pack the binaries and the shared
#                                            libraries they need (not glibc, not cuBLAS) into .gpu-bundle/
#   tests/gpu/device-check.sh [OUT]          there (or here, where it stops at the GPU step): run everything from
#                                            $MHA_GPU_BIN, else .gpu-bundle/, else build/bin; write at most 8 files
#                                            into OUT (else $OUT)
#
# The GPU machine has CUDA 13, PyTorch's cuBLAS wheels and compute-sanitizer, but not this project's Debian
# libraries: the bundle carries them (about 20 MiB compressed; the device tool carries at most 64 MiB).
# Files written: 1-versions.txt, 2-conformance.txt, 3-memcheck.txt, 4-flash-bench.txt, 5-end-to-end.txt,
# 6-paged-bench.txt, summary.txt. Exit status 0 when every step that ran passed, 2 when there is no GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle_dir="$root/.gpu-bundle"
binaries=(mha_server mha_client backend_conformance_test cuda_backend_test flash_bench paged_bench)

if [[ "${1:-}" == "--bundle" ]]; then
  set -e
  build="${BUILD_DIR:-$root/build}"
  cmake -S "$root" -B "$build" -DMHA_WITH_CUDA=ON >/dev/null
  cmake --build "$build" -j"$(nproc)" --target "${binaries[@]}"
  rm -rf "$bundle_dir" && mkdir -p "$bundle_dir/stage/bin" "$bundle_dir/stage/lib"
  for b in "${binaries[@]}"; do cp "$build/bin/$b" "$bundle_dir/stage/bin/"; done
  # Every shared library but glibc's (the GPU machine's own glibc is as new or newer) and the driver's.
  for b in "${binaries[@]}"; do ldd "$build/bin/$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libcuda)\.so' |
    while read -r lib; do cp -L "$lib" "$bundle_dir/stage/lib/"; done
  git -C "$root" rev-parse HEAD >"$bundle_dir/stage/REVISION" 2>/dev/null || true
  tar -C "$bundle_dir/stage" -cJf "$bundle_dir/bundle.tar.xz" .
  rm -rf "$bundle_dir/stage"
  ls -la "$bundle_dir/bundle.tar.xz"
  echo "carry .gpu-bundle and run: bash tests/gpu/device-check.sh"
  exit 0
fi

out="${1:-${OUT:-$root/gpu-check-out}}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
failed=0

if [[ -n "${MHA_GPU_BIN:-}" ]]; then
  bin="$MHA_GPU_BIN"  # ctest's gpu_device_check: this build's binaries, whatever bundle lies around
  note "binaries: $bin"
elif [[ -f "$bundle_dir/bundle.tar.xz" ]]; then
  run_dir=$(mktemp -d)
  tar -C "$run_dir" -xJf "$bundle_dir/bundle.tar.xz"
  bin="$run_dir/bin"
  export LD_LIBRARY_PATH="$run_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "bundle: revision $(cat "$run_dir/REVISION" 2>/dev/null || echo unknown)"
else
  bin="$root/build/bin"
  note "no .gpu-bundle: running $bin"
fi
# cuBLAS is dlopen()ed: the toolkit's, else the one PyTorch's wheels carry (CUDA 13's nvidia-cublas wheel puts it in
# nvidia/cu13/lib, with no nvidia.cublas module; CUDA 12's had nvidia/cublas/lib), else any found on the disk.
cublas_dir=
wheel_dirs='import nvidia, os; print(*[os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")])'
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib $(env -u LD_LIBRARY_PATH python3 -c "$wheel_dirs" 2>/dev/null); do
  [[ -e "$dir/libcublas.so.13" ]] && cublas_dir=$dir && break
done
if [[ -z "$cublas_dir" ]]; then
  found=$(timeout 30 find / \( -path /proc -o -path /sys \) -prune -o -name libcublas.so.13 -print -quit 2>/dev/null)
  [[ -n "$found" ]] && cublas_dir=$(dirname "$found")
fi
if [[ -e "$cublas_dir/libcublas.so.13" ]]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$cublas_dir"
  note "cuBLAS: $cublas_dir"
else
  note "cuBLAS: libcublas.so.13 not found"
fi

# 1. Versions.
{
  echo "## nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  echo "## nvcc"; (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -2
  echo "## CPU"; grep -m1 'model name' /proc/cpuinfo; nproc
} >"$out/1-versions.txt" 2>&1

# 2. The GPU step: is there one?
gpu_reason=$("$bin/flash_bench" --probe 2>&1 | head -1)
if ! nvidia-smi -L >/dev/null 2>&1; then
  note "GPU: none present (${gpu_reason}); the GPU steps below are skipped and the GPU run is still owed"
  "$bin/cuda_backend_test" >"$out/2-conformance.txt" 2>&1 || failed=1
  note "cuda_backend_test (host side, no GPU): $(tail -1 "$out/2-conformance.txt")"
  # The benchmark's binary is there and starts (it must say why there is no GPU, exit 2).
  "$bin/paged_bench" --probe >"$out/6-paged-bench.txt" 2>&1
  status=$?
  note "paged_bench --probe (no GPU): exit $status, $(head -1 "$out/6-paged-bench.txt")"
  [[ $status -eq 2 ]] || failed=1
  exit $((failed ? 1 : 2))
fi
note "GPU: $(nvidia-smi -L | head -1)"

# The GPU steps in order of priority (conformance, the sessions' decode benchmark, end to end, memcheck, flash_bench),
# their timeouts adding up to 520 s so that the whole check fits one device call of at most 600 s with room to spare
# (bundle unpacking, cuBLAS search); the summary's last line says how long each took.
step_seconds=
# 2. Conformance: every case of the suite and the contract tests on the CUDA backend, against the reference; the
# sessions' cases (SessionConformanceTest, PagedStatsTest: paged calls on the GPU's paged kernels) among them.
started=$SECONDS
json_dir=$(mktemp -d)
{
  timeout 90 "$bin/backend_conformance_test" --gtest_filter='*cuda*:BackendRegistry.*' --gtest_brief=1 \
    --gtest_output="json:$json_dir/conformance.json"
  echo "exit $?"
  timeout 30 "$bin/cuda_backend_test" --gtest_brief=1
  echo "exit $?"
} >"$out/2-conformance.txt" 2>&1
grep -q "^exit [^0]" "$out/2-conformance.txt" && failed=1
note "conformance: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/2-conformance.txt" | tr '\n' ' ')"
# The sessions' cases: how many ran, were skipped (the backend refused the paged call) or failed. On a GPU they
# must run: all of them skipped means the sessions were not computed on it.
sessions=$(python3 - "$json_dir/conformance.json" <<'PY' 2>&1
import json, sys
count = {"ran": 0, "skipped": 0, "failed": 0}
for suite in json.load(open(sys.argv[1]))["testsuites"]:
    for test in suite["testsuite"]:
        if not test["classname"].endswith(("SessionConformanceTest", "PagedStatsTest")):
            continue
        if test.get("result") == "SKIPPED":
            count["skipped"] += 1
        else:
            count["ran"] += 1
            count["failed"] += bool(test.get("failures"))
print("{ran} ran, {failed} failed, {skipped} skipped".format(**count))
PY
)
note "conformance, sessions (SessionConformanceTest, PagedStatsTest on cuda): $sessions"
[[ "$sessions" =~ ^0\ ran ]] && failed=1
rm -rf "$json_dir"
step_seconds+="conformance $((SECONDS - started)) s, "

# 6. The sessions' decode step: KV cache bytes read per second by the paged kernels at 1, 32 and 256 sessions of
# T = 1024 .. 32768 (H = 32, Hkv = 8, d_k = 128, bf16 cache in 32-token blocks), against the device-to-device copy
# bandwidth of the same run (bytes read plus written); the kernels' output checked against the host; one whole
# CudaBackend::PagedAttention call per size over blocks in its managed-memory arena.
started=$SECONDS
timeout 120 "$bin/paged_bench" >"$out/6-paged-bench.txt" 2>&1 || failed=1
grep -q MISMATCH "$out/6-paged-bench.txt" && failed=1
note "paged_bench: $(grep -c '^| [0-9]' "$out/6-paged-bench.txt") rows; $(grep -m1 '^copy D2D' "$out/6-paged-bench.txt")"
note "paged_bench: $(grep -m1 '^decode at 32+' "$out/6-paged-bench.txt" || tail -1 "$out/6-paged-bench.txt")"
step_seconds+="paged_bench $((SECONDS - started)) s, "
# 6b. In one file (the device tool brings back 8): the 8-bit caches against bf16 in one run, at three sizes of 32+
# sessions, tokens/s per size (target >= 1.7x); then cascade decode, 64 and 128 sessions sharing an 8192-token prefix
# with 256 tokens each of their own, against the same sessions sharing nothing (target >= 8x at 64 x (8192 + 256)).
started=$SECONDS
timeout 40 "$bin/paged_bench" --cache_dtype bf16,int8,fp8_e4m3 --shape 32:4096 --shape 32:16384 \
  --shape 256:4096 --reps 10 --copy_mib 1024 >"$out/6b-paged-bench-8bit-cascade.txt" 2>&1 || failed=1
timeout 40 "$bin/paged_bench" --shared_prefix 8192 --shape 64:8448 --shape 128:8448 --reps 10 --copy_mib 1024 \
  >>"$out/6b-paged-bench-8bit-cascade.txt" 2>&1 || failed=1
grep -q MISMATCH "$out/6b-paged-bench-8bit-cascade.txt" && failed=1
note "paged_bench 8-bit: $(grep -E '^(int8|fp8_e4m3) decode' "$out/6b-paged-bench-8bit-cascade.txt" | tr '\n' ' ')"
note "paged_bench cascade: $(grep -E '^cascade ' "$out/6b-paged-bench-8bit-cascade.txt" | tr '\n' ' ')"
step_seconds+="paged_bench 8-bit and cascade $((SECONDS - started)) s, "

# 5. The whole layer through the gRPC server: CUDA against the CPU backend, fp16 on the wire, B=8 T=512 d=512; and
# sessions on the CUDA backend (mha_client decode --check, head sessions with bf16, int8 and fp8_e4m3 caches, layer
# sessions with bf16), the KV cache in
# CUDA managed memory by the server's log. The summary repeats the steps' count, the cache's place and tokens/s.
started=$SECONDS
timeout 100 bash "$root/tests/gpu/end-to-end.sh" "$bin/mha_server" "$bin/mha_client" >"$out/5-end-to-end.txt" 2>&1
status=$?
((status == 0)) || failed=1
if ((status == 124)); then
  note "end to end: stopped after 100 s ($(grep -c '^exit 0$' "$out/5-end-to-end.txt") steps had passed)"
else
  note "$(tail -1 "$out/5-end-to-end.txt")"
fi
note "end to end, sessions: $(grep -m1 -o 'KV cache: .*' "$out/5-end-to-end.txt" || echo 'no KV cache line');" \
  "decode heads $(grep -A4 '^## decode --backend cuda head' "$out/5-end-to-end.txt" | grep -m1 -o '[0-9.]* tokens/s' || echo '-')," \
  "layer $(grep -A4 '^## decode --backend cuda --session_layers' "$out/5-end-to-end.txt" | grep -m1 -o '[0-9.]* tokens/s' || echo '-')"
step_seconds+="end to end $((SECONDS - started)) s, "

# 3. compute-sanitizer memcheck on five small cases, three sessions' among them (a bf16 cache in 32-token blocks, the
# paged kernels' append and split paths; a 2000-token cache split over the keys without append, with statistics;
# an int8 cache at head_dim 81), beside an fp32 MHA call and a bf16 GQA causal masked one (the tensor-core kernel).
# It may be refused under some virtualisation; then say so. Run after the steps above: a memory error (exit 3) or a
# test failing under it (exit 1) fails the check; a timeout here (exit 124) or a refusal is noted, not failed.
started=$SECONDS
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [[ -n "$sanitizer" ]]; then
  timeout 40 "$sanitizer" --tool memcheck --error-exitcode 3 "$bin/backend_conformance_test" \
    --gtest_filter='*mha_self_cuda:*gqa_causal_mask_bf16_to_bf16_cuda:*session_heads_decode_cache_bf16_block32_dk128_cuda:*decode_split_cache_without_append_cuda:*session_heads_decode_dk81_mha_cache_int8_cuda' \
    --gtest_brief=1 >"$out/3-memcheck.txt" 2>&1
  status=$?
  note "memcheck: exit $status ($(grep -m1 -E 'ERROR SUMMARY' "$out/3-memcheck.txt" || echo 'no summary');" \
    "$(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/3-memcheck.txt" | tr '\n' ' '))"
  [[ $status -eq 3 || $status -eq 1 ]] && failed=1
else
  note "memcheck: compute-sanitizer not found" | tee "$out/3-memcheck.txt"
fi
step_seconds+="memcheck $((SECONDS - started)) s, "

# 4. The fused kernel's TFLOP/s next to the cuBLAS bf16 GEMM rate, and a session's prefill through the paged
# kernels' dense path (last: the steps above come first).
started=$SECONDS
timeout 60 "$bin/flash_bench" >"$out/4-flash-bench.txt" 2>&1 || failed=1
grep -q MISMATCH "$out/4-flash-bench.txt" && failed=1
note "flash_bench: $(grep -c '^| [0-9]' "$out/4-flash-bench.txt") rows; $(grep -m1 GEMM "$out/4-flash-bench.txt")"
# The sessions' prefill through the dense path at T = 4096, d_k = 128 (#57's target: >= 40% of the GEMM rate).
note "flash_bench paged prefill 4096/128: $(grep -m1 '^| 4096 | 128 | [0-9.]* | ' "$out/4-flash-bench.txt" || echo '-')"
step_seconds+="flash_bench $((SECONDS - started)) s"

note "steps took: $step_seconds (total $SECONDS s)"
exit $failed
