#!/usr/bin/env bash
# Issue 19 on CUDA, the fused BGMV LoRA launch (vllm_lite/lora/triton_ops.py, _bgmv_fused_kernel), in one short run:
#   1. tests: tests/test_lora_triton_bgmv.py's compiled CUDA tests (both paths against the float64 reference at
#      the 100M Qwen2's shapes and a 4096 model, and inside a captured CUDA graph);
#   2. micro: benchmarks/kernels_int4_lora.py --lora-fused (the fused launch against the two launches, the four
#      projections at 1-256 tokens, in CUDA graphs; its JSON suggests FUSED_MAX_TOKENS and the best tiles);
#   3. engine: benchmarks/lora_throughput.py --device cuda --quick (LoRA over base; target 0.80).
# Optional: engine_two, the same engine benchmark with triton_ops.FUSED_MAX_TOKENS = 0 (every step in two
# launches, as before the fused kernel): an A/B against step 3 in a second process; engine_tuned, the engine
# benchmark with the way micro found fastest for a 16-token layer (its tiles as FUSED_BLOCK_N / FUSED_BLOCK_K /
# FUSED_NUM_WARPS and its suggested FUSED_MAX_TOKENS; "two": FUSED_MAX_TOKENS = 0), set in-process (needs micro).
# Each step under its own time limit; logs and each step's JSON line in $OUT (else /tmp/lora_fused_gpu/), and a
# summary line per step on stdout. Steps: all three by default, or name them: bash scripts/lora_fused_gpu.sh micro
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
out=${OUT:-/tmp/lora_fused_gpu}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# The engine's dependencies from .whl/ where the image lacks them (as scripts/gpu_check.sh does).
if ! "$py" -c "import msgspec, zmq" >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if ((${#wheels[@]})); then
    site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  grep '^{' "$out/$name.log" | tail -n 1 >"$out/$name.json" || true
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 4 "$out/$name.log"
}

steps=${*:-tests micro engine}
for s in $steps; do
  case $s in
    tests) step tests 150 "$py" -m pytest -q -p no:cacheprovider tests/test_lora_triton_bgmv.py -k cuda ;;
    micro) step micro 150 "$py" benchmarks/kernels_int4_lora.py --lora-fused ;;
    engine) step engine 240 "$py" benchmarks/lora_throughput.py --device cuda --quick ;;
    engine_two)
      step engine_two 240 "$py" -c "import runpy, vllm_lite.lora.triton_ops as t; t.FUSED_MAX_TOKENS = 0
runpy.run_path('benchmarks/lora_throughput.py', run_name='__main__')" --device cuda --quick ;;
    engine_tuned)
      step engine_tuned 240 "$py" -c "
import json, runpy, sys
import vllm_lite.lora.triton_ops as t
r = json.load(open(sys.argv.pop(1)))['lora_fused']
best = r['best_way_layer']['16']
if best == 'two':
    t.FUSED_MAX_TOKENS = 0
else:
    kw = r['variants'][best]
    t.FUSED_BLOCK_N = kw.get('block_n', t.FUSED_BLOCK_N)
    t.FUSED_BLOCK_K = kw.get('block_k', t.FUSED_BLOCK_K)
    t.FUSED_NUM_WARPS = kw.get('num_warps', t.FUSED_NUM_WARPS)
    t.FUSED_MAX_TOKENS = max(16, r['suggested_fused_max_tokens_by_variant'][best])
print('engine_tuned:', best, dict(FUSED_MAX_TOKENS=t.FUSED_MAX_TOKENS, FUSED_BLOCK_N=t.FUSED_BLOCK_N,
      FUSED_BLOCK_K=t.FUSED_BLOCK_K, FUSED_NUM_WARPS=t.FUSED_NUM_WARPS), flush=True)
runpy.run_path('benchmarks/lora_throughput.py', run_name='__main__')
" "$out/micro.json" --device cuda --quick ;;
    *) echo "unknown step $s (tests, micro, engine, engine_two, engine_tuned)" >&2; exit 2 ;;
  esac
done
if [[ -s $out/micro.json ]]; then
  "$py" - "$out/micro.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["lora_fused"]
print("micro: layer us per way and token count (4 projections):")
for t, ways in r["layer_us"].items():
    print(f"  T={t}: " + ", ".join(f"{k} {v}" for k, v in ways.items()))
print("fused/two:", r["fused_over_two_layer"], "best:", r["best_way_layer"])
print("suggested FUSED_MAX_TOKENS:", r["suggested_fused_max_tokens"], "by variant:", r["suggested_fused_max_tokens_by_variant"])
EOF
fi
