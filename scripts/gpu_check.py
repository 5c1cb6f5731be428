"""The CUDA check in one command: native Triton kernels, Hugging Face greedy match per architecture, the
whole test suite, the GPU benchmark and the int4/LoRA kernel micro-benchmark, summarised in one JSON file
(pass/fail and figures per part).

Run through scripts/gpu_check.sh on a CUDA machine (it installs missing wheels from .whl/ and sets
HF_HUB_OFFLINE=1). The Hugging Face part also runs on CPU (`--device cpu --parts hf`), so it can be
checked where no GPU is. The summary is rewritten after every part, so a run cut short still leaves
the parts it finished. Exit status 0 only when every part that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("triton", "hf", "suite", "bench", "kernels")
# The default leaves out "triton": the suite runs the same kernel tests (its verdict requires every compiled
# CUDA kernel case to have run), and the separate pass took over 150 s of a short lease on the H100.
DEFAULT_PARTS = ("bench", "suite", "hf", "kernels")
ALONE = ("bench", "kernels")  # timed parts: with --overlap they run first, one after the other, before the suite
HD32 = "llama-hd32"  # a Llama with head_dim 32 (the tiny ones have 16), built here
FLOAT32_LOGPROB_TOL = 1e-4
NEW_TOKENS = 24
MULTI_GPU_SKIP = re.compile(r"needs \d+ CUDA devices, \d+ visible")


def _env() -> dict[str, str]:
    """The environment children run with: offline, unbuffered, and the source tree importable."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in paths:
        paths.append(REPO)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("TRITON_INTERPRET", None)  # the native kernels must be compiled
    return env


def _versions() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": pyplatform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for name in ("triton", "transformers", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


# ------------------------------------------------------------------------------------------ pytest runs


def _junit_summary(path: str) -> dict[str, Any]:
    """Counts, failures (with the first lines of their text) and skips (with reasons) from a junit file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            key = "failed" if "failure" in kinds else "errors"
            counts[key] += 1
            node = kinds.get("failure", kinds.get("error"))
            text = (node.get("message") or "") + "\n" + (node.text or "")
            failures.append({"test": name, "text": text.strip()[-1500:]})
        elif "skipped" in kinds:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": kinds["skipped"].get("message", "")})
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


def _failures_so_far(path: str) -> list[dict[str, str]]:
    """The failures tests/conftest.py's failure-log plugin appended while the run went (see failure_log.py)."""
    if not os.path.exists(path):
        return []
    found = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for chunk in f.read().split("=== ")[1:]:
            head, _, text = chunk.partition("\n")
            found.append({"test": head.strip(), "text": text.strip()[-1500:]})
    return found


def _progress_so_far(path: str) -> dict[str, Any]:
    """The running counts scripts/pytest_progress.py rewrote after each test (empty when there are none)."""
    try:
        with open(path + ".json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _pytest(args: list[str], junit: str, log: str, timeout_s: float) -> dict[str, Any]:
    # scripts/pytest_progress.py: each outcome appended to LOG.progress as it happens (failures also named in the
    # log at once), the counts in LOG.progress.json after each test: both survive a kill.
    progress = log + ".progress"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += ["-p", "pytest_progress", f"--progress-file={progress}", *args]
    failure_log = log + ".failures"
    if os.path.exists(failure_log):
        os.remove(failure_log)
    env = dict(_env(), VLLM_LITE_TEST_FAILURE_LOG=failure_log)
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):  # a fresh run, even started from a worker
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "scripts"), env["PYTHONPATH"]])
    t0 = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    res: dict[str, Any] = {
        "command": " ".join(cmd[1:]),
        "exit_code": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "log": log,
        "progress": progress,
    }
    if os.path.exists(junit):
        res.update(_junit_summary(junit))
    else:  # cut short: no junit file, but the outcomes and failures so far were logged as they happened
        counts = _progress_so_far(progress)
        res.update({k: counts[k] for k in ("passed", "failed", "errors", "skipped") if k in counts})
        res["failures"] = _failures_so_far(failure_log)
    ok = rc == 0 and res.get("failed", 1) == 0 and res.get("errors", 1) == 0
    res["status"] = "pass" if ok else ("timeout" if rc is None else "fail")
    return res


def part_triton(args: argparse.Namespace) -> dict[str, Any]:
    """The Triton kernel tests (attention; LoRA and int4): full matrices compiled on CUDA, plus the interpreter."""
    res = _pytest(
        ["tests/test_triton_kernels.py", "tests/test_triton_lora_int4.py"],
        os.path.join(args.out, "triton.xml"),
        os.path.join(args.out, "triton.log"),
        args.part_timeout,
    )
    native = [s for s in res.get("skips", []) if "compiled_kernel_on_cuda" in s["test"]]
    if args.device == "cuda" and native:
        res["status"] = "fail"
        res["note"] = f"{len(native)} native CUDA kernel cases were skipped"
    return res


def part_suite(args: argparse.Namespace) -> dict[str, Any]:
    """The whole test suite; skips are listed with their reasons (only multi-GPU ones are expected on 1 GPU)."""
    # worksteal: an idle worker takes queued tests from a busy one, so a few slow server tests queued late on
    # one worker do not set the wall time (load's fixed split left the H200 run 280 s for ~165 s of work).
    extra = ["-n", str(args.suite_workers), "--dist", "worksteal"] if args.suite_workers else []
    res = _pytest(
        ["tests", *extra, *args.suite_args],
        os.path.join(args.out, "suite.xml"),
        os.path.join(args.out, "suite.log"),
        args.suite_timeout,
    )
    res["skip_reasons"] = sorted({s["reason"] for s in res.get("skips", [])})
    junit = os.path.join(args.out, "suite.xml")
    if os.path.exists(junit):
        res["native_cuda_kernel_cases"] = _native_kernel_cases(junit)
    if args.device == "cuda":
        # On one GPU the only acceptable skips are the multi-GPU ones, and every compiled-kernel case must run.
        unexpected = [r for r in res["skip_reasons"] if not MULTI_GPU_SKIP.match(r)]
        native = res.get("native_cuda_kernel_cases", {})
        if unexpected or native.get("skipped") or not native.get("passed"):
            res["status"] = "fail" if res["status"] == "pass" else res["status"]
            res["note"] = f"unexpected skips: {unexpected}; native CUDA kernel cases: {native}"
    return res


def _native_kernel_cases(junit: str) -> dict[str, int]:
    """How the compiled-on-CUDA Triton kernel cases (test_compiled_*cuda*) ended: they must all run on a GPU."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name") or ""
        if not (name.startswith("test_compiled") and "cuda" in name):
            continue
        tags = {child.tag for child in case}
        key = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        counts[key] += 1
    return counts


def part_bench(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/gpu.py when it exists: its last JSON line is the figures. Its own --time-limit ends it 15 s
    before --part-timeout, and --out-json keeps its figures so far should it be killed anyway."""
    out_json = os.path.join(args.out, "bench.json")
    limit = max(30, int(args.part_timeout) - 15)
    return _bench_script(args, "gpu.py", "bench.log", ["--time-limit", str(limit), "--out-json", out_json], out_json)


def part_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/kernels_int4_lora.py: the int4 and LoRA Triton kernels against their torch paths."""
    return _bench_script(args, "kernels_int4_lora.py", "kernels.log")


def _bench_script(
    args: argparse.Namespace,
    name: str,
    log_name: str,
    extra: Optional[list[str]] = None,
    out_json: Optional[str] = None,
) -> dict[str, Any]:
    """Run benchmarks/<name> when it exists; its last JSON line is the figures (cut short: `out_json`'s)."""
    script = os.path.join(REPO, "benchmarks", name)
    if not os.path.exists(script):
        return {"status": "absent", "note": f"benchmarks/{name} does not exist yet"}
    t0 = time.monotonic()
    log = os.path.join(args.out, log_name)
    try:
        proc = subprocess.run(
            [sys.executable, script, *(extra or [])],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=args.part_timeout,
        )
    except subprocess.TimeoutExpired:
        res: dict[str, Any] = {"status": "timeout", "seconds": round(time.monotonic() - t0, 1)}
        if out_json and os.path.exists(out_json):
            with open(out_json) as f:
                res["figures"] = json.load(f)  # the run's last saved state ("partial": true)
        return res
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    figures = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                figures = json.loads(line)
                break
            except ValueError:
                pass
    ok = proc.returncode == 0 and figures is not None
    return {
        "status": "pass" if ok else "fail",
        "exit_code": proc.returncode,
        "figures": figures,
        "seconds": round(time.monotonic() - t0, 1),
        "log": log,
    }


# ------------------------------------------------------------------------------------- Hugging Face match


def _checkpoint(name: str, scratch: str) -> str:
    from vllm_lite.testing.checkpoints import build_checkpoint, get_checkpoint

    if name == HD32:
        path = os.path.join(scratch, HD32)
        if not os.path.exists(os.path.join(path, "config.json")):
            build_checkpoint("llama", path, config_overrides={"head_dim": 32})
        return path
    return get_checkpoint(name)


def _ours(path: str, prompts: list[list[int]], dtype: str, device: str, multiprocess: bool):
    from vllm_lite import LLM, SamplingParams
    from vllm_lite.testing.hf_oracle import GreedyRun

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(model=path, dtype=dtype, device=device, multiprocess=multiprocess, max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = []
    for out in outs:
        c = out.outputs[0]
        runs.append(GreedyRun(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]))
    return runs


def _agreement(ours, oracle) -> dict[str, Any]:
    from vllm_lite.testing.hf_oracle import compare_greedy

    per = [compare_greedy(o, h, FLOAT32_LOGPROB_TOL) for o, h in zip(ours, oracle)]
    total = sum(a.tokens for a in per)
    return {
        "exact": all(a.diverged_at is None for a in per),
        "ties": sum(a.tie for a in per),
        "mismatches": sum(a.diverged_at is not None and not a.tie for a in per),
        "token_agreement": round(sum(a.matched_prefix for a in per) / max(total, 1), 4),
        "max_logprob_err": max((a.max_logprob_err for a in per), default=0.0),
        "diverged_at": [a.diverged_at for a in per],
    }


def _check_model(name: str, device: str, scratch: str) -> dict[str, Any]:
    import torch

    from vllm_lite.testing.hf_oracle import greedy_prompts, hf_greedy, load_hf_model

    path = _checkpoint(name, scratch)
    hf = load_hf_model(path, torch.float32, device)
    from transformers import AutoTokenizer

    prompts = greedy_prompts(AutoTokenizer.from_pretrained(path))
    oracle = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf
    res: dict[str, Any] = {}
    for mode, mp in (("inproc", False), ("multiprocess", True)):
        a = _agreement(_ours(path, prompts, "float32", device, mp), oracle)
        a["pass"] = a["mismatches"] == 0 and a["max_logprob_err"] <= FLOAT32_LOGPROB_TOL
        res[f"float32_{mode}"] = a
    bf16 = _agreement(_ours(path, prompts, "bfloat16", device, False), oracle)
    bf16.pop("exact")
    res["bfloat16_vs_hf_float32"] = bf16  # figures only: bf16 rounding moves near-ties
    res["pass"] = res["float32_inproc"]["pass"] and res["float32_multiprocess"]["pass"]
    return res


def split_round_robin(names: list[str], workers: int) -> list[list[str]]:
    """``names`` dealt into at most ``workers`` non-empty groups, in turn (neighbours go to different groups)."""
    groups = [names[i :: max(1, workers)] for i in range(max(1, workers))]
    return [g for g in groups if g]


def _hf_parallel(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The HF part split over child interpreters (each its own CUDA context), merged in ``names`` order: one
    short lease cannot wait for 16 architectures one after the other."""
    procs = []
    for i, group in enumerate(split_round_robin(names, args.hf_workers)):
        summary = f"hf_{i}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--parts", "hf", "--hf-workers", "1"]
        cmd += ["--out", args.out, "--summary", summary, "--archs", *group]
        log = open(os.path.join(args.out, f"hf_{i}.log"), "w")
        procs.append((group, summary, log, subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=log)))
    models: dict[str, Any] = {}
    for group, summary, log, proc in procs:
        proc.wait()
        log.close()
        try:
            with open(os.path.join(args.out, summary)) as f:
                got = json.load(f)["parts"]["hf"].get("models", {})
        except (OSError, ValueError, KeyError):
            got = {}
        for name in group:
            models[name] = got.get(name) or {"pass": False, "error": f"worker exited {proc.returncode} without it"}
    return {name: models[name] for name in names}


def part_hf(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy tokens and chosen-token logprobs of our engine vs Hugging Face, float32, every architecture."""
    from vllm_lite.testing.checkpoints import ARCHS

    os.environ["HF_HUB_OFFLINE"] = "1"
    names = args.archs or [*ARCHS, HD32]
    if args.hf_workers > 1 and len(names) > 1:
        merged = _hf_parallel(args, names)
        return {
            "status": "pass" if all(m["pass"] for m in merged.values()) else "fail",
            "device": args.device,
            "new_tokens": NEW_TOKENS,
            "float32_logprob_tol": FLOAT32_LOGPROB_TOL,
            "workers": args.hf_workers,
            "models": merged,
        }
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for name in names:
            t0 = time.monotonic()
            try:
                models[name] = _check_model(name, args.device, scratch)
            except Exception:  # noqa: BLE001 - one architecture's crash is that architecture's result
                models[name] = {"pass": False, "error": traceback.format_exc(limit=-8)}
            models[name]["seconds"] = round(time.monotonic() - t0, 1)
            print(f"hf {name}: {'pass' if models[name]['pass'] else 'FAIL'}", flush=True)
    return {
        "status": "pass" if all(m["pass"] for m in models.values()) else "fail",
        "device": args.device,
        "new_tokens": NEW_TOKENS,
        "float32_logprob_tol": FLOAT32_LOGPROB_TOL,
        "models": models,
    }


# ------------------------------------------------------------------------------------------------ main

RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "triton": part_triton,
    "hf": part_hf,
    "suite": part_suite,
    "bench": part_bench,
    "kernels": part_kernels,
}


def _write(path: str, summary: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (the HF part only)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--archs", nargs="*", default=None, help=f"HF part: architectures (default: all and {HD32})")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for the summary and logs ($OUT)")
    p.add_argument("--summary", default="gpu_check.json", help="summary file name inside --out")
    p.add_argument("--part-timeout", type=float, default=900.0, help="seconds for the triton and bench parts")
    p.add_argument("--suite-timeout", type=float, default=3600.0, help="seconds for the whole suite")
    p.add_argument(
        "--suite-workers",
        type=int,
        default=None,
        help="pytest-xdist workers for the suite (0: none; default on CUDA: cores - 3, at most 12; else 0)",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the suite beside the other parts, after the benchmark (default: on with CUDA)",
    )
    p.add_argument(
        "--hf-workers",
        type=int,
        default=None,
        help="HF part: architectures checked in this many child interpreters at once (default on CUDA 4, else 1)",
    )
    p.add_argument("--suite-args", nargs=argparse.REMAINDER, default=[], help="extra pytest arguments (last)")
    args = p.parse_args(argv)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.suite_workers is None:
        args.suite_workers = min(12, max(0, (os.cpu_count() or 1) - 3)) if args.device == "cuda" else 0
    if args.hf_workers is None:
        args.hf_workers = 4 if args.device == "cuda" else 1
    if args.overlap is None:
        args.overlap = args.device == "cuda"
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.summary)
    summary: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": args.device,
        "versions": _versions(),
        "parts": {},
    }
    lock = threading.Lock()

    def run_part(name: str) -> None:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            result = RUNNERS[name](args)
        except Exception:  # noqa: BLE001 - the summary records a crashed part instead of losing the rest
            result = {"status": "error", "error": traceback.format_exc(limit=-8)}
        result.setdefault("seconds", round(time.monotonic() - t0, 1))
        with lock:
            summary["parts"][name] = result
            summary["ok"] = all(r["status"] in ("pass", "absent") for r in summary["parts"].values())
            _write(path, summary)
        print(f"== {name}: {result['status']} ({result['seconds']} s)", flush=True)

    if args.overlap and "suite" in parts:
        # One lease is short: the benchmarks first, alone (their timings stay clean: beside the suite's CUDA
        # contexts the GPU time-slices, and CUDA events count the others' slices); then the suite (mostly CPU
        # work in xdist workers) beside the remaining parts.
        first = [p for p in parts if p in ALONE]
        rest = [p for p in parts if p not in (*ALONE, "suite")]
        for name in first:
            run_part(name)
        suite = threading.Thread(target=run_part, args=("suite",))
        suite.start()
        for name in rest:
            run_part(name)
        suite.join()
    else:
        for name in parts:
            run_part(name)
    print(f"summary: {path}", flush=True)
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
