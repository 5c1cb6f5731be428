#!/usr/bin/env bash
# The CUDA check in one command, from anywhere: native Triton kernel tests (attention, LoRA SGMV/BGMV, int4
# AWQ/GPTQ), Hugging Face greedy match on every architecture (float32 in-process and multiprocess, bfloat16
# figures), the whole suite, the GPU benchmark and the int4/LoRA kernel micro-benchmark
# (benchmarks/kernels_int4_lora.py), summarised in ONE JSON file: $OUT/gpu_check.json when $OUT is set,
# else ./gpu_check.json.
#
#     bash scripts/gpu_check.sh                          # everything
#     bash scripts/gpu_check.sh --parts triton,hf        # a subset (triton, hf, suite, bench, kernels)
#     bash scripts/gpu_check.sh --parts triton,kernels   # only the Triton kernels: tests and micro-benchmark
#     bash scripts/gpu_check.sh --device cpu --parts hf  # the HF match on CPU
#
# Cut short, it still says what it found: the suite's outcomes are appended as they happen to
# $OUT/suite.log.progress (scripts/pytest_progress.py; counts in suite.log.progress.json, tracebacks in
# suite.log.failures), the benchmark's figures to $OUT/bench.json after each part. For one short lease, see
# scripts/gpu_lease.sh (the benchmark's defaults, then the suite, in a budget).
#
# No network: HF_HUB_OFFLINE=1, checkpoints are built locally. Where msgspec/pyzmq/fastapi/uvicorn are
# missing (the GPU image), wheels are installed from .whl/ (fetch them on a machine with the package
# index: `bash scripts/gpu_wheels.sh`) into a private folder on PYTHONPATH. Where the `vllm-lite` console
# script is not installed, the source tree is installed editable (no dependencies, no network).
# The package itself is used from this source tree. Options go on to scripts/gpu_check.py (--help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

need_wheels() { ! "$py" -c "import msgspec, zmq, fastapi, uvicorn, httpx, openai, xgrammar, llguidance" >/dev/null 2>&1; }
if need_wheels; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if ((${#wheels[@]} == 0)); then
    echo "gpu_check: msgspec/pyzmq/fastapi/uvicorn are missing and .whl/ holds no wheels;" >&2
    echo "           fetch them where the package index is reachable: bash scripts/gpu_wheels.sh" >&2
    exit 2
  fi
  site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if need_wheels; then
    echo "gpu_check: the wheels in .whl/ did not provide msgspec/pyzmq/fastapi/uvicorn/httpx/openai/xgrammar/llguidance" >&2
    exit 2
  fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The suite checks the console script's entry point: install the tree editable when it is missing.
if ! "$py" -c "from importlib.metadata import entry_points as e; assert any(x.name == 'vllm-lite' for x in e(group='console_scripts'))" >/dev/null 2>&1; then
  "$py" -m pip install -q --no-deps --no-index --no-build-isolation -e "$root" ||
    echo "gpu_check: could not install the vllm-lite console script; tests/test_cli.py will say so" >&2
fi
exec "$py" scripts/gpu_check.py "$@"
