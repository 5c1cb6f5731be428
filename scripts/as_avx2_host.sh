#!/usr/bin/env bash
# Run a command as if on an AVX2-only x86 host (Zen 3: no AVX-512, no native bf16), e.g. the test suite:
#   bash scripts/as_avx2_host.sh python -m pytest -q
# The kernels are built for -march=znver3 into their own cache, .avx2-host-cache/ (git-ignored).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
export PYTHONPATH="$here/as_avx2_host:$root${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_LITE_CACHE_DIR="${VLLM_LITE_CACHE_DIR:-$root/.avx2-host-cache}"
exec "$@"
