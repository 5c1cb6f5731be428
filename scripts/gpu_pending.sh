#!/usr/bin/env bash
# Every CUDA check the tree still owes, in one GPU lease call (the eleventh session built them after its lease):
#     bash scripts/gpu_pending.sh [BUDGET_S]        # carry .whl (bash scripts/gpu_wheels.sh); default 560 s
#     bash scripts/gpu_pending.sh suite [BUDGET_S]  # the whole suite (second call), failures named as they happen
# Parts, in order, each under its own time limit (later parts get what is left), each log written as it ends;
# the tests first (they check code that is the default on CUDA), then the timed parts one at a time:
#   tests     the CUDA tests of the changed code (async runner and its stream/event changes, CUDA graphs, the
#             Triton kernels without specialisation on step-varying ints, LoRA 4 warps, the fixed test premises)
#   async     scripts/async_gpu_check.py: tokens identical sync vs async (graphs and eager), no host sync inside an
#             async launch (torch.cuda.set_sync_debug_mode("error")), tok/s sync vs async
#   async_b1  scripts/async_b1_phases.py: batch-1 ms/token sync / async (the eleventh session's H100: 0.504 sync
#             against 0.743 async before the async host-work cuts)
#   lora      scripts/lora_fused_gpu.sh engine: lora_auto_over_base with the fused kernel at 4 warps (0.909 at 8)
#   bench     benchmarks/gpu.py --shapes llama-1b --skip-hf (issue 14: GPU busy at batch 256, now also over an
#             unprofiled window; batch-1 TTFT, 310 ms before the Triton specialisation change)
# Everything lands in $OUT (else ./pending_out): summary.txt (each part's rc, seconds and key lines) and
# logs.tgz (every log, rewritten after each part), two files, within a lease's 8-file limit.
set -u
mode=main
if [[ ${1:-} == suite ]]; then
  mode=suite
  shift
fi
budget=${1:-560}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/pending_out}
logs=$(mktemp -d)
mkdir -p "$out"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
if ! "$py" -c "import msgspec, zmq, fastapi, uvicorn, httpx, openai" >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pending_site \
    "${wheels[@]}" >"$logs/install.log" 2>&1
  export PYTHONPATH=/tmp/pending_site GPU_CHECK_SITE=/tmp/pending_site
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" -m pip install -q --no-deps --no-index --no-build-isolation -e . >>"$logs/install.log" 2>&1
summary="$out/summary.txt"
{ nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"; } >"$summary" 2>&1

part() {  # name, time limit (s), command...: skipped when the budget cannot hold it
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS - 5))
  ((left < 20)) && { echo "== $name skipped (${left}s left)" >>"$summary"; return; }
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s" >>"$summary"
  tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
}

if [[ $mode == suite ]]; then
  # -v: each result on its own line as it ends, so a run stopped by its limit still names its failures.
  part suite $((budget - 25)) "$py" -m pytest -v -p no:cacheprovider -n 15 --dist worksteal -rfE tests/
  grep -E "FAILED|ERROR" "$logs/suite.log" | grep -v "^E " | cut -c1-250 | sort -u | head -40 >>"$summary"
  grep -c PASSED "$logs/suite.log" | sed 's/^/passed: /' >>"$summary"
  tar czf "$out/logs.tgz" -C "$logs" .
  cat "$summary"
  exit 0
fi
part tests 130 "$py" -m pytest -q -p no:cacheprovider -n 8 -rfE tests/test_async_runner.py tests/test_async_e2e.py \
  tests/test_cuda_graphs.py tests/test_cuda_graphs_spec_lora.py tests/test_triton_kernels.py tests/test_moe.py \
  tests/test_lora_triton_bgmv.py tests/test_gc_heap.py tests/test_frontend_gc_heap.py \
  tests/test_spec_decode_bench_smoke.py tests/test_spec_decode_greedy_lists.py tests/test_profiler_api.py \
  tests/test_input_batch.py tests/test_step_op_budget.py tests/test_vllm_engine_flags.py
tail -n 3 "$logs/tests.log" >>"$summary"
part async 90 "$py" scripts/async_gpu_check.py
tail -n 1 "$logs/async.log" | cut -c1-1200 >>"$summary"
part async_b1 70 "$py" scripts/async_b1_phases.py --rounds 2 --rounds-of-engines 1
grep -E "^(sync|async|async_2execs) " "$logs/async_b1.log" | cut -c1-200 >>"$summary"
OUT="$logs/lora" part lora 100 bash scripts/lora_fused_gpu.sh engine
grep -h -E "lora_auto_over_base" "$logs"/lora/*.json 2>/dev/null | grep -o '"median_output_tok_per_s.*"target_ratio[^,]*' >>"$summary"
part bench 170 "$py" benchmarks/gpu.py --shapes llama-1b --skip-hf --time-limit 150 --out-json "$logs/bench.json"
grep -E "FIGURES" "$logs/bench.log" | cut -c1-400 | tail -n 12 >>"$summary"
tar czf "$out/logs.tgz" -C "$logs" .
cat "$summary"
