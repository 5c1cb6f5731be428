#!/usr/bin/env bash
# Installs vllm-lite and everything it needs on a fresh machine (CPU torch first, never a CUDA build by accident).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev,triton]"
