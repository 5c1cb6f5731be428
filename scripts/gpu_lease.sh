#!/usr/bin/env bash
# One short GPU lease, every part returning what it measured even when cut short:
#     bash scripts/gpu_lease.sh [BUDGET_S]      # default 420 s for the whole command
# 1. the wheels the GPU image lacks, from .whl/ (carry it: bash scripts/gpu_wheels.sh fetches them), into a
#    private folder on PYTHONPATH; the tree installed editable (the console script the suite checks);
# 2. benchmarks/gpu.py --shapes llama-1b at the engine's defaults: --time-limit $BENCH_S (default 170) is a hard
#    wall, FIGURES lines on stderr as each part ends, $OUT/bench.json rewritten after every part;
# 3. the whole suite in the time left (less 10 s): each failure named as it happens ($OUT/suite.progress,
#    "FAILED nodeid" lines in $OUT/suite.log, tracebacks in $OUT/suite.failures), counts in
#    $OUT/suite.progress.json after every test.
# Everything goes under $OUT (./lease_out without it); stdout ends with a short summary of both.
# Knobs (environment): BENCH_S, BENCH_SHAPES (llama-1b), BENCH_ARGS (extra gpu.py arguments, e.g.
# "--compare-async --skip-compare-profile"), SUITE_WORKERS (12), SUITE_TESTS (tests), SUITE_ARGS (extra pytest
# arguments), SKIP_BENCH=1, SKIP_SUITE=1. On CPU (a dry run of this script):
#     OUT=/tmp/l BENCH_SHAPES=tiny BENCH_ARGS="--device cpu --smoke" SUITE_WORKERS=2 \
#       SUITE_TESTS=tests/test_pytest_progress.py bash scripts/gpu_lease.sh 150
set -u
budget=${1:-420}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/lease_out}
mkdir -p "$out"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
left() { echo $((budget - SECONDS)); }
say() { echo "== [${SECONDS}s] $*"; }

# 1. wheels and the editable install
if ! "$py" -c "import msgspec, zmq, fastapi, uvicorn, httpx, openai, xgrammar, llguidance" >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if ((${#wheels[@]})); then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lease_site \
      "${wheels[@]}" >"$out/install.log" 2>&1 || say "wheel install failed: $out/install.log"
    export PYTHONPATH=/tmp/lease_site
  else
    say "no .whl/*.whl here (carry .whl): msgspec/pyzmq/... are missing"
  fi
fi
export PYTHONPATH="$root/scripts:$root${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "from importlib.metadata import entry_points as e; assert any(x.name == 'vllm-lite' for x in e(group='console_scripts'))" >/dev/null 2>&1; then
  "$py" -m pip install -q --no-deps --no-index --no-build-isolation -e . >>"$out/install.log" 2>&1 ||
    say "editable install failed (tests/test_cli.py will say so): $out/install.log"
fi
{ nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; lscpu | grep "Model name"; nproc; } \
  >"$out/host.txt" 2>&1
say "setup done; $(left)s left; $(head -2 "$out/host.txt" | tail -1)"

# 2. the benchmark: its own hard wall, `timeout` only as a last resort (SIGTERM also makes it print)
if [[ -z ${SKIP_BENCH:-} ]]; then
  bench_s=${BENCH_S:-170}
  (($(left) - 20 < bench_s)) && bench_s=$(($(left) - 20))
  if ((bench_s < 30)); then
    say "bench skipped: ${bench_s}s is too little"
  else
    say "bench: gpu.py --shapes ${BENCH_SHAPES:-llama-1b} --time-limit $bench_s ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    timeout -k 15 $((bench_s + 10)) "$py" benchmarks/gpu.py --shapes "${BENCH_SHAPES:-llama-1b}" \
      --time-limit "$bench_s" --out-json "$out/bench.json" ${BENCH_ARGS:-} >"$out/bench.out" 2>"$out/bench.log"
    say "bench rc=$?"
    grep -E "FIGURES|stopping|hard wall|FAILED|Error" "$out/bench.log" | cut -c1-400 | tail -40
  fi
fi

# 3. the suite, failures named as they happen
if [[ -z ${SKIP_SUITE:-} ]]; then
  suite_s=$(($(left) - 10))
  if ((suite_s < 20)); then
    say "suite skipped: ${suite_s}s is too little"
  else
    say "suite: ${suite_s}s, ${SUITE_WORKERS:-12} workers, ${SUITE_TESTS:-tests} ${SUITE_ARGS:-}"
    # shellcheck disable=SC2086
    VLLM_LITE_TEST_FAILURE_LOG="$out/suite.failures" timeout -k 10 "$suite_s" "$py" -m pytest -q -rfE \
      -p no:cacheprovider -p pytest_progress --progress-file "$out/suite.progress" --junitxml="$out/suite.xml" \
      -n "${SUITE_WORKERS:-12}" --dist worksteal ${SUITE_ARGS:-} ${SUITE_TESTS:-tests} >"$out/suite.log" 2>&1
    say "suite rc=$? (124: cut at the budget)"
    tail -n 3 "$out/suite.log" | cut -c1-300
  fi
fi

# The summary: the benchmark's headline figures and the suite's counts and failures, from the files that
# survive a kill (bench.json, suite.progress.json).
"$py" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
b = load("bench.json")
if b is not None:
    print(f"bench: partial={b.get('partial')} stopped={b.get('stopped')} elapsed={b.get('elapsed_s')}s errors={b.get('errors')}")
    for name, e in (b.get("shapes") or {}).items():
        keys = ("vllm_lite_tokens_per_s", "batch1_ms_per_token", "batch1_ttft_ms", "time_to_ready_s",
                "gpu_busy_fraction", "gpu_busy_fraction_batch1", "gpu_busy_fraction_multiprocess",
                "gpu_busy_fraction_multiprocess_unprofiled_window",
                "hf_tokens_per_s", "ratio_vs_hf")
        print(f"  {name}: " + ", ".join(f"{k}={e[k]}" for k in keys if k in e))
        for k in ("decode_step", "decode_step_batch1_inprocess", "prefill_step"):
            st = e.get(k) or {}
            print(f"  {name} {k}: ms={st.get('measured_ms', st.get('step_ms_median'))} busy={st.get('busy_fraction')} host={(st.get('host') or {}).get('host_ms')}")
        for k in ("compare_async", "part_seconds", "errors"):
            if e.get(k):
                v = {x: y for x, y in e[k].items() if "inprocess" not in x} if isinstance(e[k], dict) else e[k]
                print(f"  {name} {k}: {json.dumps(v)[:1500]}")
s = load("suite.progress.json")
if s is not None:
    print(f"suite: finished={s['finished']} exit={s['exitstatus']} {s['elapsed_s']}s passed={s['passed']} "
          f"failed={s['failed']} errors={s['errors']} skipped={s['skipped']} last={s['last_test']}")
    for t in s["failed_tests"] + s["error_tests"]:
        print(f"  FAILED {t}")
EOF
say "done; files in $out"
