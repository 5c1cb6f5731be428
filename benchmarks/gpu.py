"""CUDA speed (issue #14): vllm-lite against Hugging Face `generate` on random-weight checkpoints built here.

Per shape (llama architecture, vocab 8000; "qwen2-100m" is the CI bench shape):
  llama-1b     TinyLlama shape: 22 layers, hidden 2048, intermediate 5632, 32/4 heads
  qwen2-100m   the ~100M Qwen2 shape of benchmarks/throughput.py (vllm_lite.testing.checkpoints, "100m")
  llama-8b-8l  llama-8b cut to 8 layers: hidden 4096, intermediate 14336, 32/8 heads
  llama-8b     the full 32 layers
  tiny         a toy shape for the CPU smoke run
a "full" run measures, all in this one invocation:
  - vllm-lite output tok/s: 256 prompts of 128-512 random token ids (seeded), 128 new tokens each, ignore_eos,
    temperature 0, the multiprocess engine (LLM(...) default), after a warm-up on other prompts;
  - HF generate output tok/s on the same prompts, in its own interpreter, at its defaults (DynamicCache, its
    default attention), left-padded batches of --hf-batch (all 256 at once by default), warmed up;
  - batch-1 decode ms/token: a 128-token prompt, 128 new tokens, time per output token after the first (median
    of 2 requests with different prompts; 1 on batch-1-only shapes);
  - time to ready: LLM(...) construction plus the first one-token request;
  - GPU-busy fraction during decode at batch 256 (and at batch 1) from torch.profiler: union of the CUDA
    kernel/copy intervals over the wall time of a window of decode steps, on an in-process engine
    (LLM(multiprocess=False)) in a fresh interpreter (gpu_busy_fraction: there the frontend's output processing
    shares the core's thread), and at batch 256 ALSO on the default multiprocess engine with vLLM's profiler API
    (gpu_busy_fraction_multiprocess, decode_step_multiprocess; gpu_busy_fraction_multiprocess_unprofiled_window:
    the same kernel time over an unprofiled window, since CUPTI slows every launch): a worker interpreter sets
    VLLM_TORCH_PROFILER_DIR for its private engine core, calls llm.start_profile() / stop_profile() around
    decode steps of the 256 prompts, and reads the core's Chrome trace back (the window's engine steps in
    gpu_busy_multiprocess_steps; null with a note on CPU; --skip-mp-profile skips it, --mp-trace-dir keeps the
    core's trace);
  - per decode step: the measured step time (same in-process engine, unprofiled window) against a roofline,
    max(bytes moved / copy bandwidth, FLOPs / matmul rate): bytes = matmul weights + every sequence's K/V,
    FLOPs = 2 x weights x batch + attention; both rates measured at the start of this run (a device-to-device
    copy counted as read + write, an 8192^3 bf16 matmul);
  - where a step's time goes, on the same in-process engine, for decode at batch 256 and 1 and for prefill (the
    first steps of a fresh 256-prompt batch, chunked at the step budget, and batch-1 128-token prompts run to
    their first token): one window of steps per mode, so no mode's overhead lands in another's figures:
    timed (step ms), profiled (busy fraction, busy/idle ms a step, kernels a step, top kernels, top CUDA runtime
    calls), phases (the engine's own functions wrapped by name, no file of the engine edited: schedule, runner
    input preparation, forward, sample, update, output processing; us a step, inclusive and self) and cProfile
    (top 10 Python functions by self time, top 10 of vllm_lite's by inclusive time); host ms a step = step ms
    less the device's busy ms a step; prefill steps against their matmul floor.
Every engine runs at the engine's defaults (async scheduling where the engine turns it on: CUDA). With
--compare-async a full shape also runs the other scheduling (async_scheduling=False on CUDA, True on CPU) after
the main parts: its multiprocess figures beside the main run's (compare_async: sync and async, async / sync
ratios, greedy tokens identical?) and its in-process decode profile (decode_step_sync or decode_step_async;
--skip-compare-profile leaves that out); "unsupported" where EngineArgs has no async_scheduling field.
A "batch1" run (default for llama-8b) measures only time to ready and batch-1 ms/token, with its roofline.

    python benchmarks/gpu.py                                   # llama-1b full + llama-8b batch-1 (<= 150 s on an H100)
    python benchmarks/gpu.py --shapes llama-8b-8l,qwen2-100m   # other shapes (NAME or NAME:batch1)
    python benchmarks/gpu.py --compare-eager                   # also enforce_eager=True: both figures, same tokens?
    python benchmarks/gpu.py --compare-async                   # async_scheduling False and True: both, same tokens?
    python benchmarks/gpu.py --shapes llama-1b --time-limit 170 --out-json r.json   # a short device call
    python benchmarks/gpu.py --trace-dir DIR                   # + Chrome traces of 3 steps of each step profile
    python benchmarks/gpu.py --device cpu --smoke              # seconds, on CPU (float32)

Prints ONE JSON line on stdout (progress on stderr: each part's key figures on a "FIGURES" line as soon as it
has them), also when a part fails: each failure is recorded in its shape's "errors" (and the exit status is 1).
--time-limit (330 s, from the interpreter's start) is a hard wall: the running part is stopped a grace before it
(a worker interpreter never gets more than the time left), the run prints what it has ("stopped" says why,
"partial": true) and at the limit itself a watchdog kills what is left and prints it anyway; SIGTERM stops the
run the same way. --out-json FILE holds the result so far after every part (the last complete state survives a
kill). "part_seconds" and "build" in each shape say where the time went. On the H100 (2026-11-27) the default
`--shapes llama-1b` run took ~146 s: start 4 s, build 14 s, engine 33 s, step profiles 28 s, multiprocess busy
24 s, HF 42 s; --compare-async adds ~11 s (the other scheduling's engine run) and ~25 s (its step profile).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before the heavy imports: --time-limit counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Optional  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
# The engine core and this script's workers are fresh interpreters: they import vllm_lite from this tree too.
_pp = os.environ.get("PYTHONPATH", "")
if REPO not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + _pp if _pp else "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_lite.testing import bench_deadline  # noqa: E402
from vllm_lite.testing.baselines import host_description  # noqa: E402
from vllm_lite.testing.bench_deadline import (  # noqa: E402
    END_LOCK,
    RUN,
    TimeLimit,
    arm_time_limit,
    die_with_parent,
    disarm,
    log,
    save_partial,
    write_out_json,
    write_worker_partial,
)

# The run's deadline, worker interpreters and --out-json: vllm_lite/testing/bench_deadline.py.
RUN["name"], RUN["t0"] = "gpu.py", T0


LABELS = {
    "tok_s": "tok/s",
    "batch1_ms_per_token": "batch-1 ms/token",
    "ttft_ms": "TTFT ms",
    "ready_s": "ready s",
    "async_scheduling": "async",
    "seconds": "part s",
    "step_ms": "step ms",
    "step_ms_median": "step ms (median)",
    "busy": "busy fraction",
    "host_ms": "host ms/step",
    "busy_ms_per_step": "busy ms/step",
    "window_ms_per_step": "window ms/step",
    "unprofiled_window_ms_per_step": "unprofiled window ms/step",
    "busy_unprofiled_window": "busy fraction (unprofiled window)",
    "engine_steps": "engine steps",
    "tok_s_ratio": "tok/s ratio",
    "batch1_ms_ratio": "batch-1 ms ratio",
    "greedy_identical": "greedy identical (workload/batch-1)",
    "ratio": "vllm-lite/HF",
}


def figures(what: str, **values: Any) -> None:
    """One progress line of a part's key figures, as soon as it has them: `[gpu.py  T] FIGURES what: k v, ...`."""
    parts = [f"{LABELS.get(k, k)} {v}" for k, v in values.items() if v is not None]
    log(f"FIGURES {what}: " + ", ".join(parts))


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, lengths uniform in [lo, hi] (benchmarks/throughput.py's rule)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lens]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _err(part: str, exc: BaseException) -> str:
    log(f"{part} FAILED:\n{traceback.format_exc()}")
    text = f"{part}: {type(exc).__name__}: {exc}"
    if isinstance(exc, subprocess.CalledProcessError):
        text += " (the worker's traceback is in stderr above)"
    return text[:2000]


# ------------------------------------------------------------------------------------------ vllm-lite


def llm_kwargs(s: dict[str, Any], enforce_eager: bool) -> dict[str, Any]:
    """LLM(...) arguments of every engine this script starts; enforce_eager only where EngineArgs has it."""
    from vllm_lite.engine_args import EngineArgs

    kw: dict[str, Any] = dict(
        dtype=s["dtype"],
        device=s["device"],
        max_model_len=s["max_model_len"],
        max_num_seqs=s["max_num_seqs"],
        disable_log_stats=True,
    )
    if s["max_num_batched_tokens"] is not None:
        kw["max_num_batched_tokens"] = s["max_num_batched_tokens"]
    if enforce_eager:
        if "enforce_eager" not in EngineArgs.__dataclass_fields__:
            raise TypeError("LLM has no enforce_eager argument yet")
        kw["enforce_eager"] = True
    kw.update(s["llm_kwargs"])
    return kw


def start_llm(model: str, s: dict[str, Any], enforce_eager: bool, multiprocess: bool, warm: list[list[int]]):
    """LLM(...) timed to ready (construction plus a first one-token request), then warmed up on `warm`."""
    from vllm_lite import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, multiprocess=multiprocess, **llm_kwargs(s, enforce_eager))
    init_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": warm[0][:16]}], SamplingParams(max_tokens=1), use_tqdm=False)
    ready_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": warm[0]}], params, use_tqdm=False)
    facts = {
        "llm_init_s": round(init_s, 2),
        "time_to_ready_s": round(ready_s, 2),
        "warmup_s": round(time.perf_counter() - t0, 2),
    }
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        cc = llm.llm_engine.vllm_config.cache_config
        facts["engine"] = {
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": sc.max_model_len,
            "block_size": cc.block_size,
            "async_scheduling": getattr(sc, "async_scheduling", None),  # as resolved (None: the default)
        }
    except AttributeError:
        pass
    return llm, facts


def run_workload(llm, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from vllm_lite import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    return {
        "tokens_per_s": round(n_out / dt, 1),
        "elapsed_s": round(dt, 3),
        "output_tokens": n_out,
        "expected_output_tokens": len(prompts) * out_len,
        "tokens": tokens,
    }


def run_batch1(llm, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    """One request at a time (a fresh prompt each, no prefix-cache hit): decode ms per output token after the
    first, time to first token; the median over the prompts."""
    from vllm_lite import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    per_tok, ttfts, tokens = [], [], []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"b1-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
        first, toks = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                toks.extend(out.outputs[0].token_ids)
                if first is None and toks:
                    first = time.perf_counter()
        end = time.perf_counter()
        if first is None or len(toks) < 2:
            raise RuntimeError(f"batch-1 request produced {len(toks)} tokens")
        ttfts.append(first - t0)
        per_tok.append((end - first) / (len(toks) - 1))
        tokens.append(toks)
    return {
        "ms_per_token": round(1e3 * float(np.median(per_tok)), 3),
        "ms_per_token_each": [round(1e3 * x, 3) for x in per_tok],
        "ttft_ms": round(1e3 * float(np.median(ttfts)), 2),
        "tokens": tokens,
    }


def engine_run(
    model: str, s: dict[str, Any], enforce_eager: bool, workload: Optional[list[list[int]]], b1: list[list[int]]
) -> dict[str, Any]:
    """The multiprocess engine: ready time, the workload (when given), batch 1."""
    warm = make_prompts(8, s["input_len"][0], s["input_len"][1], s["vocab"], s["seed"] + 2)
    llm, res = start_llm(model, s, enforce_eager, multiprocess=True, warm=warm)
    try:
        if workload is not None:
            log(f"  workload: {len(workload)} prompts x {s['output_len']} tokens")
            res["workload"] = run_workload(llm, workload, s["output_len"])
        log(f"  batch 1: {len(b1)} x {s['batch1_output_len']} tokens")
        res["batch1"] = run_batch1(llm, b1, s["batch1_output_len"])
    finally:
        llm.shutdown()
    return res


# ------------------------------------------------------------------------------ profile worker (in-process)

# Each measured window of steps runs once per mode: "timed" (wall time only), "profile" (torch.profiler: the
# device's busy time, kernels, CUDA runtime calls), "phases" (the engine's own functions timed by name:
# PhaseTimer), "cprofile" (cProfile of the step loop: top Python functions). Separate windows, so no mode's
# overhead lands in another's figures.
MODES = ("timed", "profile", "phases", "cprofile")
TRACE_STEPS = 3  # steps in a --trace-dir window (CPU ops and kernels: the trace grows fast)
NOTES = {
    "host": "host_ms = step_ms (unprofiled window) - gpu_busy_ms (busy fraction x profiled step time): "
    "the time a step the device waits for the host",
    "phases": "wall time inside the engine's functions, wrapped by name in an unprofiled window (PhaseTimer); "
    "self = less the phases called inside; on CUDA runner.sample's self time includes waiting for the device "
    "(the sampled tokens' copy to the host), and model.forward / cuda_graphs.run only launch work",
    "cprofile": "cProfile of the step loop (its own window; cProfile slows Python code, see cprofile_step_ms): "
    "top_functions by self time, top_cumulative by inclusive time among vllm_lite's functions",
}


def _activities(device: str, with_cpu: bool = False) -> list:
    from torch.profiler import ProfilerActivity

    if not device.startswith("cuda"):
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if with_cpu else [ProfilerActivity.CUDA]


def _install_phases(engine, timer, sched_log: list) -> None:
    """Time the in-process engine's step by its functions' names (schedule, runner input preparation, forward,
    sample, update, output processing); names missing from this tree are listed by the timer and skipped."""
    import vllm_lite.worker.model_runner as mr
    from vllm_lite.worker.step_inputs import StepInputs

    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    sched = getattr(core, "scheduler", None)
    executor = getattr(core, "executor", None)
    runner = getattr(getattr(executor, "worker", None), "model_runner", None)
    model = getattr(runner, "model", None)

    def log_schedule(so) -> None:
        n = getattr(so, "num_scheduled_tokens", None) or {}
        sched_log.append((int(so.total_num_scheduled_tokens), len(n), sum(1 for v in n.values() if v > 1)))

    w = timer.wrap
    w(engine, "step", "engine.step")
    w(core, "step", "core.step")
    w(sched, "schedule", "scheduler.schedule", on_return=log_schedule)
    w(executor, "execute_model", "execute_model")
    w(runner, "_update_states", "runner.update_states")
    w(runner, "_move_blocks", "runner.move_blocks")
    w(mr, "build_step_inputs", "runner.build_step_inputs")
    w(runner, "_logits_rows", "runner.logits_rows")
    w(runner, "_run_model", "runner.run_model")
    w(StepInputs, "to_device", "runner.inputs_to_device")
    if getattr(runner, "cuda_graphs", None) is not None:
        w(runner.cuda_graphs, "run", "cuda_graphs.run")
    w(model, "forward", "model.forward")
    w(runner, "_prompt_logprobs", "runner.prompt_logprobs")
    w(runner, "_sample", "runner.sample")
    w(runner, "_launch_sample", "runner.launch_sample")
    w(runner, "_run_sampler", "runner.run_sampler")
    w(model, "compute_logits", "model.compute_logits")
    w(getattr(runner, "sampler", None), "forward", "sampler.forward")
    w(mr, "_build_output", "runner.build_output")
    w(core, "_finish_oldest", "core.finish_oldest")
    w(sched, "update_from_output", "scheduler.update_from_output")
    w(getattr(engine, "output_processor", None), "process_outputs", "output_processor.process_outputs")


def _window(
    engine, step, steps: int, device: str, mode: str, activities=None, trace_path: Optional[str] = None
) -> dict[str, Any]:
    """`steps` calls of step(i) (one engine step, or one batch-1 request) under `mode` (see MODES; "trace": CPU
    and CUDA activity with the phases' ranges, written as a gzipped Chrome trace to trace_path)."""
    import cProfile
    import gzip
    import pstats

    from vllm_lite.testing.gpu_bench import PhaseTimer, top_functions

    prof = timer = cprof = None
    sched_log: list[tuple[int, int, int]] = []
    each: list[float] = []
    _sync(device)
    try:
        if mode in ("profile", "trace"):
            acts = activities or _activities(device, with_cpu=mode == "trace")
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        if mode in ("phases", "trace"):
            timer = PhaseTimer()
            _install_phases(engine, timer, sched_log)
        elif mode == "cprofile":
            cprof = cProfile.Profile()
            cprof.enable()
        t0 = time.perf_counter()
        for i in range(steps):
            ts = time.perf_counter()
            step(i)
            each.append(time.perf_counter() - ts)
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        if cprof is not None:
            cprof.disable()
        if timer is not None:
            timer.restore()
        if prof is not None:
            prof.__exit__(None, None, None)
    out: dict[str, Any] = {"wall_s": wall, "step_ms_each": [round(1e3 * x, 3) for x in each]}
    if prof is not None and mode == "profile":
        out["profile"] = _profile_facts(prof, wall, steps, device)
    if prof is not None and trace_path is not None:
        tmp = trace_path + ".tmp.json"
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as src, gzip.open(trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(tmp)
        return out
    if timer is not None:
        out["phases"] = timer.summary(steps)
        if timer.missing:
            out["phases_missing"] = timer.missing
        if sched_log:
            out["scheduled"] = {
                "tokens_per_step": [t for t, _, _ in sched_log],
                "requests_per_step": [r for _, r, _ in sched_log],
                "prefill_requests_per_step": [p for _, _, p in sched_log],
            }
    if cprof is not None:
        stats = pstats.Stats(cprof)
        out["cprofile"] = {
            "cprofile_step_ms": round(1e3 * wall / steps, 3),
            "top_functions": top_functions(stats, steps, 10, "tottime"),
            "top_cumulative": top_functions(stats, steps, 10, "cumtime", only="vllm_lite"),
        }
    return out


def _warm_profiler(device: str) -> None:
    """Start torch.profiler once outside the measured windows: its first start (CUPTI on CUDA) is slow."""
    with torch.profiler.profile(activities=_activities(device)):
        torch.ones(16, device=device).add_(1).sum().item()
    _sync(device)


def _engine_step(engine, state: dict[str, Any]) -> None:
    for o in engine.step():
        state["gen"][o.request_id] += len(o.outputs[0].token_ids)
        if o.finished:
            state["done"].add(o.request_id)


def _profile_facts(prof, wall_s: float, steps: int, device: str) -> dict[str, Any]:
    from torch.autograd import DeviceType

    from vllm_lite.testing.gpu_bench import summarize_device_events

    cuda = device.startswith("cuda")
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    dev, runtime = [], []
    for e in prof.events():
        span = (e.name, e.time_range.start, e.time_range.end)  # microseconds
        if e.device_type == want:
            dev.append(span)
        elif cuda and e.device_type == DeviceType.CPU and e.name.startswith("cu"):  # runtime and driver API
            runtime.append(span)
    return summarize_device_events(dev, runtime, wall_s * 1e6, steps, cuda)


def _windows(engine, make_step, steps: int, device: str, modes, trace: Optional[str] = None) -> dict[str, Any]:
    """One window per mode (make_step(mode) -> (step, done)), merged: the timed window's step time, the profiled
    window's device facts, host time, the phases, the cProfile top functions; "trace" (with `trace`, a file path)
    writes a Chrome trace of TRACE_STEPS steps."""
    from vllm_lite.testing.gpu_bench import host_time

    res: dict[str, Any] = {}
    for mode in modes:
        step, done = make_step(mode)
        try:
            if mode == "trace":
                if trace is not None:
                    _window(engine, step, min(steps, TRACE_STEPS), device, mode, trace_path=trace)
                    res["trace"] = {"file": os.path.basename(trace), "steps": min(steps, TRACE_STEPS)}
                continue
            w = _window(engine, step, steps, device, mode)
            if mode == "profile" and device.startswith("cuda") and w["profile"]["device_events"] == 0:
                w = _window(engine, step, steps, device, mode, _activities(device, with_cpu=True))  # some builds
        finally:
            done()
        if mode == "timed":
            res["step_ms"] = round(1e3 * w["wall_s"] / steps, 4)
            res["step_ms_each"] = w["step_ms_each"]
        elif mode == "profile":
            res.update(w["profile"])
        elif mode == "phases":
            res["phases"] = w["phases"]
            for key in ("phases_missing", "scheduled"):
                if key in w:
                    res[key] = w[key]
        elif mode == "cprofile":
            res.update(w["cprofile"])
    if "step_ms" in res and "busy_fraction" in res:
        res["host"] = host_time(res["step_ms"], res["busy_fraction"], res["profiled_step_ms"])
    return res


def _measure_decode(
    engine, prompts: list[list[int]], out_len: int, steps: int, device: str, tag: str, modes, trace=None
) -> dict:
    """Add `prompts`, step until every one has its first token (prefills done), then one window of decode steps
    per mode; abort the rest."""
    from vllm_lite import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    state: dict[str, Any] = {"gen": {}, "lens": {}, "done": set()}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        state["gen"][rid], state["lens"][rid] = 0, len(p)
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    prefill_steps = 0
    t0 = time.perf_counter()
    while min(state["gen"].values()) == 0 and engine.has_unfinished_requests():
        _engine_step(engine, state)
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    k = min(steps, (out_len - max(state["gen"].values()) - 1) // (len(modes) + 1))  # +1: a profile retried
    if k < 1:
        raise RuntimeError(f"{tag}: no decode steps left to measure after {prefill_steps} prefill steps")
    batches, contexts = [], []

    def make_step(mode: str):
        def step(i: int) -> None:
            live = [r for r in state["gen"] if r not in state["done"]]
            if mode == "timed":
                batches.append(len(live))
                contexts.append(sum(state["lens"][r] + state["gen"][r] for r in live))
            _engine_step(engine, state)

        return step, lambda: None

    try:
        res = _windows(engine, make_step, k, device, modes, trace)
    finally:
        engine.abort_request([r for r in state["gen"] if r not in state["done"]])
        while engine.has_unfinished_requests():
            engine.step()
    res.pop("step_ms_each", None)
    return {
        "prefill_steps": prefill_steps,
        "prefill_phase_s": round(prefill_s, 3),
        "steps": k,
        "batch": float(np.mean(batches)) if batches else float(len(prompts)),
        "sum_context": float(np.mean(contexts)) if contexts else 0.0,
        **res,
    }


def _measure_prefill(
    engine, s: dict[str, Any], num: int, lo: int, hi: int, steps: int, tag: str, modes, trace=None
) -> dict:
    """Prefill steps of a fresh batch: per mode, `num` new prompts (lengths lo-hi, a new seed each, so no prefix
    cache hit) are added and the first `steps` engine steps measured (chunked prefill at the step budget, with
    the decodes of requests already prefilled), then the rest aborted. num=1 with max_tokens=1 (batch-1): each
    "step" is one request, added and run to its first token (time to first token in-process)."""
    from vllm_lite import RequestOutputKind, SamplingParams

    device = s["device"]
    batch1 = num == 1
    out_len = 1 if batch1 else s["output_len"]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def make_step(mode: str):
        r = MODES.index(mode) if mode in MODES else len(MODES)
        state: dict[str, Any] = {"gen": {}, "done": set()}
        if batch1:
            prompts = make_prompts(steps, lo, hi, s["vocab"], s["seed"] + 200 + r)

            def step(i: int) -> None:
                rid = f"{tag}-{r}-{i}"
                state["gen"][rid] = 0
                engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params)
                while engine.has_unfinished_requests():
                    _engine_step(engine, state)

        else:
            for i, p in enumerate(make_prompts(num, lo, hi, s["vocab"], s["seed"] + 100 + r)):
                rid = f"{tag}-{r}-{i}"
                state["gen"][rid] = 0
                engine.add_request(rid, {"prompt_token_ids": p}, params)

            def step(i: int) -> None:
                if engine.has_unfinished_requests():
                    _engine_step(engine, state)

        def done() -> None:
            engine.abort_request([x for x in state["gen"] if x not in state["done"]])
            while engine.has_unfinished_requests():
                engine.step()

        return step, done

    res = _windows(engine, make_step, steps, device, modes, trace)
    res.update(requests=num, steps=steps, input_len=[lo, hi])
    if not batch1:
        res["note"] = (
            "the first steps of a fresh batch: chunked prefill filling the step budget, plus the decodes of the "
            "requests whose prompt is done (scheduled.* per step)"
        )
    else:
        res["note"] = "each step: one request added and run to its first token (max_tokens=1), in-process"
    return res


def profile_worker(spec: dict[str, Any]) -> dict[str, Any]:
    s = spec["settings"]
    parts = spec.get("parts", ["decode", "prefill"])
    modes = tuple(spec.get("modes", MODES))
    lo, hi = s["input_len"]
    prompts = make_prompts(s["num_prompts"], lo, hi, s["vocab"], s["seed"])
    b1 = make_prompts(1, s["batch1_input_len"], s["batch1_input_len"], s["vocab"], s["seed"] + 3)
    warm = make_prompts(8, lo, hi, s["vocab"], s["seed"] + 2)
    # CUPTI up before the engine captures CUDA graphs, so their kernels are traced one by one.
    _warm_profiler(s["device"])
    s = dict(s, llm_kwargs={**s["llm_kwargs"], **spec.get("extra_kwargs", {})})
    llm, facts = start_llm(spec["model"], s, spec["enforce_eager"], multiprocess=False, warm=warm)
    engine = llm.llm_engine
    res: dict[str, Any] = {
        "engine": "in-process (LLM(multiprocess=False)), fresh interpreter",
        "extra_kwargs": spec.get("extra_kwargs", {}),
        "async_scheduling": facts.get("engine", {}).get("async_scheduling"),
        "notes": NOTES,
    }
    steps = s["profile_steps"]
    trace_dir = spec.get("trace_dir")
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        modes += ("trace",)

    def trace(tag: str) -> Optional[str]:
        return os.path.join(trace_dir, f"{spec.get('trace_prefix', 'trace')}-{tag}.json.gz") if trace_dir else None

    dev = s["device"]
    n1, b1_len = s["prefill_b1_iters"], s["batch1_input_len"]
    measures = []
    if "decode" in parts:
        measures += [
            (
                "batch_n",
                lambda: _measure_decode(engine, prompts, s["output_len"], steps, dev, "bn", modes, trace("bn")),
            ),
            (
                "batch_1",
                lambda: _measure_decode(engine, b1, s["batch1_output_len"], steps, dev, "b1", modes, trace("b1")),
            ),
        ]
    if "prefill" in parts:
        measures += [
            (
                "prefill_n",
                lambda: _measure_prefill(engine, s, s["num_prompts"], lo, hi, steps, "pn", modes, trace("pn")),
            ),
            ("prefill_1", lambda: _measure_prefill(engine, s, 1, b1_len, b1_len, n1, "p1", modes, trace("p1"))),
        ]
    res["part_seconds"] = {}
    res["errors"] = []
    try:
        for key, measure in measures:  # one failing (a CUDA-only path, say) leaves the others' figures
            t0 = time.perf_counter()
            try:
                res[key] = measure()
            except Exception as e:  # noqa: BLE001 - recorded, the JSON says which part
                res["errors"].append(_err(f"step profile {key}", e))
            res["part_seconds"][key] = round(time.perf_counter() - t0, 2)
            write_worker_partial(spec, res)  # stopped at the deadline, the parent keeps these
            if spec.get("test_hang") == "profile":  # tests: a worker that never ends (the deadline must stop it)
                log("--test-hang profile: the profile worker hangs after its first measurement")
                threading.Event().wait()
    finally:
        llm.shutdown()
    return res


# ------------------------------------------------------------------------- multiprocess profile worker

MP_PROFILE_NOTE = (
    "the default multiprocess engine (frontend and engine core in separate processes), profiled with vLLM's API: "
    "VLLM_TORCH_PROFILER_DIR set for this worker's private core, llm.start_profile() / stop_profile() around "
    "decode steps of the workload's prompts (all prefilled); the core's trace read back: union of the CUDA "
    "kernel/copy intervals over the profiled window (busy_fraction; the start/stop calls drain the steps in "
    "flight, so the window's edges hold a pipeline refill) and over the first-to-last kernel span "
    "(busy_fraction_device_span); engine_steps: the core's steps inside the window (it ends once the core's step "
    "counter, read with get_stats, has moved target_engine_steps); the same window run unprofiled just before "
    "(unprofiled_window_ms_per_step: CUPTI's tracing slows every launch, graph replays per kernel node) and "
    "busy_fraction_unprofiled_window = busy_ms_per_step / unprofiled_window_ms_per_step"
)


def mp_profile_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode busy fraction of the multiprocess engine at the workload's batch (see MP_PROFILE_NOTE)."""
    from vllm_lite import RequestOutputKind, SamplingParams
    from vllm_lite.core.profiler import TRACE_SUFFIX
    from vllm_lite.testing.gpu_bench import read_chrome_trace, trace_busy_facts

    s = spec["settings"]
    trace_dir = os.path.abspath(spec["profiler_dir"])
    os.makedirs(trace_dir, exist_ok=True)
    # This interpreter is the benchmark's own worker: its private engine core starts with a copy of this
    # environment, so the variable reaches the core (and nothing else of the run).
    os.environ["VLLM_TORCH_PROFILER_DIR"] = trace_dir
    lo, hi = s["input_len"]
    prompts = make_prompts(s["num_prompts"], lo, hi, s["vocab"], s["seed"])
    warm = make_prompts(8, lo, hi, s["vocab"], s["seed"] + 2)
    s = dict(s, llm_kwargs={**s["llm_kwargs"], **spec.get("extra_kwargs", {})})
    out_len = s["output_len"]
    llm, facts = start_llm(spec["model"], s, spec["enforce_eager"], multiprocess=True, warm=warm)
    res: dict[str, Any] = {"engine": "multiprocess (LLM(...) default), fresh interpreter", "method": MP_PROFILE_NOTE}
    try:
        engine = llm.llm_engine
        params = SamplingParams(
            temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        state: dict[str, Any] = {"gen": {}, "done": set()}
        for i, p in enumerate(prompts):
            state["gen"][f"mp-{i}"] = 0
            engine.add_request(f"mp-{i}", {"prompt_token_ids": p}, params)
        prefill_steps = 0
        while min(state["gen"].values()) == 0 and engine.has_unfinished_requests():
            _engine_step(engine, state)
            prefill_steps += 1
        for _ in range(2):  # past the last prefill's step: decode only from here
            _engine_step(engine, state)
        # The core runs ahead of this frontend: leave it enough tokens (two windows) that no request ends inside.
        k = min(s["mp_profile_steps"], (out_len - max(state["gen"].values())) // 3 - 2)
        if k < 1:
            raise RuntimeError(f"no decode steps left to profile after {prefill_steps} prefill steps")
        live = len([r for r in state["gen"] if r not in state["done"]])

        def window(k: int) -> tuple[int, int]:
            """Until the core has run k steps (its own counter: outputs this frontend reads may have been queued
            before the start; the frontend reads outputs meanwhile, as a frontend does): (core steps, its steps)."""
            start_step = engine.call_utility("get_stats")["step_counter"]
            fe, moved = 0, 0
            while not state["done"] and fe < 8 * k:
                _engine_step(engine, state)
                fe += 1
                moved = engine.call_utility("get_stats")["step_counter"] - start_step
                if moved >= k:
                    break
            return moved, fe

        # The same window unprofiled first: the profiler's CUPTI tracing adds host time to every launch (each
        # kernel node of a replayed graph), so the profiled window's length overstates the step the GPU waits on.
        t0 = time.perf_counter()
        plain_steps, _ = window(k)
        plain_wall = time.perf_counter() - t0
        before = set(os.listdir(trace_dir))
        t0 = time.perf_counter()
        llm.start_profile()
        _, fe_steps = window(k)
        llm.stop_profile()
        wall = time.perf_counter() - t0
        ended_inside = len(state["done"])
        engine.abort_request([r for r in state["gen"] if r not in state["done"]])
        while engine.has_unfinished_requests():
            engine.step()
        new = sorted(f for f in os.listdir(trace_dir) if f not in before and f.endswith(TRACE_SUFFIX))
        if len(new) != 1:
            raise RuntimeError(f"expected one new trace in {trace_dir}, found {new}")
        path = os.path.join(trace_dir, new[0])
        parsed = read_chrome_trace(path)
        res.update(trace_busy_facts(parsed, s["device"].startswith("cuda")))
        res["unprofiled_core_steps"] = plain_steps
        res["unprofiled_window_ms_per_step"] = round(1e3 * plain_wall / max(1, plain_steps), 4)
        busy_ms = res.get("busy_ms_per_step")  # kernel time a step (CUDA): the profiler does not slow the device
        res["busy_fraction_unprofiled_window"] = (
            None if busy_ms is None else round(min(1.0, busy_ms / res["unprofiled_window_ms_per_step"]), 4)
        )
        res.update(
            batch=live,
            requests_finished_in_window=ended_inside,
            target_engine_steps=k,
            frontend_steps=fe_steps,
            frontend_window_ms=round(1e3 * wall, 2),
            prefill_steps=prefill_steps,
            trace_file=new[0],
            trace_bytes=os.path.getsize(path),
            time_to_ready_s=facts["time_to_ready_s"],
            trace_dir=trace_dir,
        )
    finally:
        llm.shutdown()
    return res


# ------------------------------------------------------------------------------------------ HF worker


def hf_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """HF generate at its defaults on the workload, each batch size of spec["batches"] after a warm-up there."""
    from transformers import AutoModelForCausalLM

    from vllm_lite.testing.baselines import hf_generate_left_padded

    s = spec["settings"]
    device = s["device"]
    dtype = getattr(torch, s["dtype"])
    prompts = make_prompts(s["num_prompts"], s["input_len"][0], s["input_len"][1], s["vocab"], s["seed"])
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    per_batch = {}
    with torch.no_grad():
        for batch in spec["batches"]:
            hf_generate_left_padded(hf, prompts[:batch], 2)  # warm-up at this batch shape
            _sync(device)
            t0 = time.perf_counter()
            n_out = 0
            for i in range(0, len(prompts), batch):
                n_out += hf_generate_left_padded(hf, prompts[i : i + batch], s["output_len"])
            _sync(device)
            per_batch[batch] = n_out / (time.perf_counter() - t0)
    best = max(per_batch, key=per_batch.__getitem__)
    return {
        "tokens_per_s": round(per_batch[best], 1),
        "best_batch": best,
        "tokens_per_s_by_batch": {str(b): round(v, 1) for b, v in per_batch.items()},
        "load_s": round(load_s, 2),
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "threads": torch.get_num_threads(),
        "settings": "generate() defaults (DynamicCache), greedy, left-padded batches, warmed up",
    }


def hang_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Tests: a worker that writes a partial result and never ends (only its parent's deadline stops it)."""
    write_worker_partial(spec, {"hung": True, "pid": os.getpid()})
    threading.Event().wait()
    return {}


def run_worker(kind: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """This script as a worker interpreter of KIND (bench_deadline.run_worker: own process group, the time left)."""
    return bench_deadline.run_worker(__file__, kind, spec, timeout_s)


# ------------------------------------------------------------------------------------------ one shape


def run_shape(name: str, mode: str, s: dict[str, Any], probes: dict[str, Any], workdir: str, entry: dict) -> None:
    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.testing.gpu_bench import (
        build_random_checkpoint,
        compare_runs,
        config_facts,
        decode_step_cost,
        plan_variants,
        roofline,
        shape_vocab,
    )

    errors = entry["errors"]
    device = s["device"]
    dtype = getattr(torch, s["dtype"])
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    path = os.path.join(workdir, name)
    if os.path.isfile(os.path.join(path, ".complete")):
        entry["build"] = {"reused": path}
    else:
        log(f"{name}: building the random-weight checkpoint on {device}")
        shutil.rmtree(path, ignore_errors=True)
        entry["build"] = build_random_checkpoint(
            name, path, torch.device(device), dtype, seed=s["seed"], tokenizer_cache=s["_tokenizers"]
        )
        open(os.path.join(path, ".complete"), "w").close()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        log(f"{name}: built in {entry['build']['build_s']} s ({entry['build']['checkpoint_bytes'] / 1e9:.2f} GB)")
    with open(os.path.join(path, "config.json")) as f:
        facts = config_facts(json.load(f))
    entry["config"] = facts
    entry["params_b"] = round(facts["matmul_params"] / 1e9, 3)
    s = dict(s, vocab=shape_vocab(name))
    s.pop("_tokenizers", None)
    lo, hi = s["input_len"]
    full = mode == "full"
    workload = make_prompts(s["num_prompts"], lo, hi, s["vocab"], s["seed"]) if full else None
    if not full:  # a batch-1-only shape (the full llama-8b): one request, to fit the time budget
        s["batch1_iters"] = s["batch1_iters_batch1_shapes"]
    entry["batch1_requests"] = s["batch1_iters"]
    b1 = make_prompts(s["batch1_iters"], s["batch1_input_len"], s["batch1_input_len"], s["vocab"], s["seed"] + 3)
    bw = probes.get("copy", {}).get("bytes_per_s")
    rate = probes.get("matmul", {}).get("flops_per_s")

    def step_roofline(batch: float, sum_context: float, measured_ms: float) -> dict[str, Any]:
        cost = decode_step_cost(facts, batch, sum_context, dtype_bytes)
        out = {"batch": round(batch, 2), "mean_context": round(sum_context / max(batch, 1e-9), 1)}
        if bw and rate:
            out.update(roofline(cost, measured_ms, bw, rate))
        else:
            out["measured_ms"] = round(measured_ms, 4)
            out["note"] = "no roofline: the probes failed"
        return out

    def decode_facts(m: dict[str, Any]) -> dict[str, Any]:
        step = step_roofline(m["batch"], m["sum_context"], m["step_ms"])
        step.update({k: v for k, v in m.items() if k not in ("batch", "sum_context", "step_ms")})
        return step

    def prefill_facts(m: dict[str, Any]) -> dict[str, Any]:
        """A prefill window's facts with its matmul floor: weights read once, 2 FLOPs per weight per token
        scheduled (the phases window's count), attention's FLOPs and K/V traffic not counted."""
        out = dict(m)
        if m.get("step_ms_each"):
            out["step_ms_median"] = round(float(np.median(m["step_ms_each"])), 3)
        tokens = sum(m.get("scheduled", {}).get("tokens_per_step", [])) / max(m["steps"], 1)
        if tokens and bw and rate and "step_ms" in m:
            floor = roofline(decode_step_cost(facts, tokens, 0.0, dtype_bytes), m["step_ms"], bw, rate)
            out["floor"] = {"tokens_per_step": round(tokens, 1), **floor, "note": "matmul weights and FLOPs only"}
        return out

    fields = set(EngineArgs.__dataclass_fields__)
    # The multiprocess runs: the main one at the engine's defaults (eager per --enforce-eager), --compare-eager's
    # other one; --compare-async's run is planned once the main run says which scheduling the default resolved to.
    variants = plan_variants(dict(s, compare_async=False), full, fields)
    want_async = full and s["compare_async"]
    if want_async and "async_scheduling" not in fields:
        entry["compare_async"] = {"unsupported": plan_variants(s, full, fields)["compare_async"]}
        want_async = False
    base = next(iter(variants))
    runs: dict[str, dict[str, Any]] = {}
    other: dict[str, Any] = {}  # --compare-async: "label" (sync or async: the one the default is not), "main"

    def record_main(main: dict[str, Any]) -> None:
        entry["time_to_ready_s"] = main["time_to_ready_s"]
        entry["llm_init_s"] = main["llm_init_s"]
        entry["warmup_s"] = main["warmup_s"]
        entry["engine"] = main.get("engine")
        b = main["batch1"]
        entry["batch1_ms_per_token"] = b["ms_per_token"]
        entry["batch1_ms_per_token_each"] = b["ms_per_token_each"]
        entry["batch1_ttft_ms"] = b["ttft_ms"]
        mean_ctx = s["batch1_input_len"] + s["batch1_output_len"] / 2
        entry["batch1_decode_step"] = step_roofline(1, mean_ctx, b["ms_per_token"])
        if full:
            w = main["workload"]
            entry["vllm_lite_tokens_per_s"] = w["tokens_per_s"]
            entry["vllm_lite_elapsed_s"] = w["elapsed_s"]
            entry["output_tokens"] = w["output_tokens"]
            if w["output_tokens"] != w["expected_output_tokens"]:
                errors.append(f"vllm_lite: {w['output_tokens']} output tokens, expected {w['expected_output_tokens']}")

    def run_engine(label: str) -> None:
        eager, extra = variants[label]
        try:
            log(f"{name}: vllm-lite, multiprocess engine, enforce_eager={eager}{f', {extra}' if extra else ''}")
            t0 = time.perf_counter()
            runs[label] = engine_run(path, dict(s, llm_kwargs={**s["llm_kwargs"], **extra}), eager, workload, b1)
            entry.setdefault("part_seconds", {})[f"vllm_lite_{label}"] = round(time.perf_counter() - t0, 1)
            if label == base:
                record_main(runs[label])
            r = runs[label]
            figures(
                f"{name} vllm-lite {label}",
                tok_s=r.get("workload", {}).get("tokens_per_s"),
                batch1_ms_per_token=r["batch1"]["ms_per_token"],
                ttft_ms=r["batch1"]["ttft_ms"],
                ready_s=r["time_to_ready_s"],
                async_scheduling=(r.get("engine") or {}).get("async_scheduling"),
                seconds=entry["part_seconds"][f"vllm_lite_{label}"],
            )
        except Exception as e:  # noqa: BLE001 - every part is recorded, the rest go on
            errors.append(_err(f"vllm_lite({label}: enforce_eager={eager}, {extra})", e))
        finally:
            save_partial(f"{name}: vllm_lite_{label} done")

    def step_figures(st: dict[str, Any]) -> dict[str, Any]:
        host = st.get("host") or {}
        return dict(
            step_ms=st.get("measured_ms", st.get("step_ms")),
            busy=st.get("busy_fraction"),
            host_ms=host.get("host_ms"),
            batch=st.get("batch"),
        )

    def record_profile(prof: dict[str, Any]) -> None:
        errors.extend(prof.get("errors", []))
        entry["step_profile_notes"] = prof.get("notes")
        entry["step_profile_seconds"] = prof.get("part_seconds")
        entry["step_profile_async_scheduling"] = prof.get("async_scheduling")
        for key, label in (("prefill_n", "prefill_step"), ("prefill_1", "prefill_step_batch1")):
            if key in prof:
                entry[label] = prefill_facts(prof[key])
        if "batch_n" in prof:
            bn = prof["batch_n"]
            entry["gpu_busy_fraction"] = bn["busy_fraction"]
            entry["gpu_busy_source"] = f"torch.profiler: {bn['busy_source']}, {prof['engine']}"
            entry["decode_step"] = decode_facts(bn)
            if device.startswith("cuda") and bn.get("kernels_per_step", 0) < facts["num_layers"]:
                entry["gpu_busy_note"] = (
                    f"only {bn.get('kernels_per_step')} kernels per step traced for {facts['num_layers']} layers: "
                    "kernels inside CUDA graphs may be missing from the trace, so the busy fraction may be low"
                )
            figures(f"{name} decode step batch {bn.get('batch')} (in-process)", **step_figures(entry["decode_step"]))
        if "batch_1" in prof:
            b1p = prof["batch_1"]
            entry["gpu_busy_fraction_batch1"] = b1p["busy_fraction"]
            entry["decode_step_batch1_inprocess"] = decode_facts(b1p)
            figures(f"{name} decode step batch 1 (in-process)", **step_figures(entry["decode_step_batch1_inprocess"]))
        if "batch_n" in prof or "batch_1" in prof:
            entry["host_ms_per_decode_step"] = {
                "batch_n": prof.get("batch_n", {}).get("host"),
                "batch_1": prof.get("batch_1", {}).get("host"),
            }
        if "prefill_step" in entry:
            p = entry["prefill_step"]
            figures(
                f"{name} prefill step (in-process)", step_ms_median=p.get("step_ms_median"), busy=p.get("busy_fraction")
            )

    def record_profile_compare(pa: dict[str, Any]) -> None:
        label, main_label = other["label"], other["main"]
        errors.extend(f"{label}: {x}" for x in pa.get("errors", []))
        cmp = entry.setdefault("compare_async", {})
        for part, key in (("batch_n", "decode_step"), ("batch_1", "decode_step_batch1")):
            if part not in pa:
                continue
            entry[f"{key}_{label}"] = decode_facts(pa[part])
            main_step = entry.get(key if part == "batch_n" else key + "_inprocess", {})
            cmp[f"inprocess_{part}"] = {
                v: {f: st.get(f) for f in ("measured_ms", "busy_fraction", "host")}
                for v, st in ((main_label, main_step), (label, entry[f"{key}_{label}"]))
            }
            figures(f"{name} decode step {part} (in-process, {label})", **step_figures(entry[f"{key}_{label}"]))

    def record_mp_profile(mp: dict[str, Any]) -> None:
        entry["gpu_busy_fraction_multiprocess"] = mp["busy_fraction"]
        entry["gpu_busy_fraction_multiprocess_unprofiled_window"] = mp.get("busy_fraction_unprofiled_window")
        entry["gpu_busy_multiprocess_steps"] = mp["engine_steps"]
        entry["decode_step_multiprocess"] = mp
        if mp["busy_fraction"] is None:
            entry["gpu_busy_multiprocess_note"] = mp.get("note")
        elif device.startswith("cuda") and mp.get("kernels_per_step", 0) < facts["num_layers"]:
            entry["gpu_busy_multiprocess_note"] = (
                f"only {mp.get('kernels_per_step')} kernels per step traced for {facts['num_layers']} layers: "
                "kernels inside CUDA graphs may be missing from the trace, so the busy fraction may be low"
            )
        figures(
            f"{name} decode busy (multiprocess)",
            busy=mp["busy_fraction"],
            busy_ms_per_step=mp.get("busy_ms_per_step"),
            window_ms_per_step=mp.get("window_ms_per_step"),
            unprofiled_window_ms_per_step=mp.get("unprofiled_window_ms_per_step"),
            busy_unprofiled_window=mp.get("busy_fraction_unprofiled_window"),
            engine_steps=mp["engine_steps"],
            batch=mp.get("batch"),
        )

    def record_hf(hf: dict[str, Any]) -> None:
        entry["hf_tokens_per_s"] = hf["tokens_per_s"]
        entry["hf"] = {k: v for k, v in hf.items() if k != "tokens_per_s"}
        if "vllm_lite_tokens_per_s" in entry:
            entry["ratio_vs_hf"] = round(entry["vllm_lite_tokens_per_s"] / hf["tokens_per_s"], 2)
        figures(f"{name} HF generate", tok_s=hf["tokens_per_s"], batch=hf["best_batch"], ratio=entry.get("ratio_vs_hf"))

    def run_job(label: str, kind: str, spec: dict[str, Any], record) -> None:
        """A worker interpreter's part: recorded as soon as it ends; stopped at the deadline, what it had is
        recorded (the profile worker's finished measurements) and the run stops."""
        what = {
            "hf": "HF generate",
            "mp_profile": "decode busy fraction, multiprocess engine (start_profile/stop_profile)",
            "profile": f"step profiles, in-process engine {spec.get('extra_kwargs') or '(defaults)'}",
        }[kind]
        log(f"{name}: {what}, own interpreter")
        t0 = time.perf_counter()
        try:
            out = run_worker(kind, spec, s["worker_timeout_s"])
            if kind == "mp_profile":
                out["worker_s"] = round(time.perf_counter() - t0, 1)
            record(out)
        except TimeLimit as stop:
            errors.append(f"{label}: {stop}" + ("; its finished measurements are kept" if stop.partial else ""))
            entry["stopped_worker"] = {"part": label, "pid": stop.worker_pid}
            if stop.partial:
                try:
                    record(stop.partial)
                except Exception as e:  # noqa: BLE001
                    errors.append(_err(f"{label} (partial)", e))
            raise
        except Exception as e:  # noqa: BLE001 - recorded with the part's name, the rest go on
            errors.append(_err(label, e))
        finally:
            entry.setdefault("part_seconds", {})[label] = round(time.perf_counter() - t0, 1)
            save_partial(f"{name}: {label} done")

    # The main engine run, its step profiles and HF first; the comparison runs (--compare-eager, --compare-async)
    # after them, so a comparison that fails or hangs (past --time-limit) cannot cost the main figures.
    prof_spec = {"model": path, "settings": s, "enforce_eager": s["enforce_eager"]}
    if s["trace_dir"]:
        prof_spec.update(trace_dir=os.path.abspath(s["trace_dir"]), trace_prefix=name)
    if s.get("test_hang"):
        prof_spec["test_hang"] = s["test_hang"]
    try:
        run_engine(base)
        if want_async:
            # The default's scheduling, as the main run resolved it (the device's rule where that run failed).
            resolved = (runs.get(base, {}).get("engine") or {}).get("async_scheduling")
            main_async = bool(resolved) if resolved is not None else device.startswith("cuda")
            other.update(label="sync" if main_async else "async", main="async" if main_async else "sync")
            variants[other["label"]] = (s["enforce_eager"], {"async_scheduling": not main_async})
            entry.setdefault("compare_async", {})["default"] = other["main"]
        if full:
            run_job("profile", "profile", prof_spec, record_profile)
            if s["skip_mp_profile"]:
                entry["gpu_busy_multiprocess_skipped"] = "--skip-mp-profile"
            else:
                # The main multiprocess run's engine (its variant's arguments), profiled through vLLM's API; the
                # core's traces go to --mp-trace-dir/SHAPE (kept), else a folder of the run's (deleted).
                keep = s["mp_trace_dir"]
                profiler_dir = os.path.join(os.path.abspath(keep) if keep else workdir, f"{name}-multiprocess")
                mp_spec = dict(prof_spec, profiler_dir=profiler_dir, extra_kwargs=variants[base][1])
                mp_spec.pop("trace_dir", None)
                mp_spec.pop("test_hang", None)
                try:
                    run_job("profile_mp", "mp_profile", mp_spec, record_mp_profile)
                finally:
                    if not keep:
                        shutil.rmtree(profiler_dir, ignore_errors=True)
            if s["skip_hf"]:
                entry["hf_skipped"] = "--skip-hf"
            elif name == "llama-8b" and not s["hf_8b"]:
                entry["hf_skipped"] = (
                    "full llama-8b: HF generate not run, it would not fit the time budget (--hf-8b runs it)"
                )
            else:
                run_job("hf", "hf", {"model": path, "settings": s, "batches": s["hf_batch"]}, record_hf)
        for label in list(variants)[1:]:
            run_engine(label)
        if want_async:
            if s["skip_compare_profile"]:
                entry["compare_async"]["inprocess_skipped"] = "--skip-compare-profile"
            else:
                label = other["label"]
                spec = dict(
                    prof_spec,
                    extra_kwargs=variants[label][1],
                    parts=["decode"],
                    modes=["timed", "profile", "phases"],
                )
                spec.pop("test_hang", None)
                if s["trace_dir"]:
                    spec["trace_prefix"] = f"{name}-{label}"
                run_job(f"profile_{label}", "profile", spec, record_profile_compare)
    finally:  # also past --time-limit: whatever pair ran is compared
        pairs = [("compare_eager", "eager" if base == "graphs" else "graphs")]
        if want_async:
            pairs.append(("compare_async", other["label"]))
        for key, label in pairs:
            if label not in variants:
                continue
            cmp = entry.setdefault(key, {})
            if base in runs and label in runs:
                if key == "compare_eager":
                    cmp.update(compare_runs(base, runs[base], label, runs[label]))
                else:  # sync first: the ratios are async / sync
                    by = {other["main"]: runs[base], other["label"]: runs[label]}
                    cmp.update(compare_runs("sync", by["sync"], "async", by["async"]))
                    figures(
                        f"{name} compare_async (async / sync)",
                        tok_s_ratio=cmp["tokens_per_s_ratio"],
                        batch1_ms_ratio=cmp["batch1_ms_per_token_ratio"],
                        greedy_identical=f"{cmp['greedy_identical_workload']}/{cmp['greedy_identical_batch1']}",
                    )
            else:
                cmp["error"] = f"the {base} or the {label} multiprocess run did not finish (errors)"


# ------------------------------------------------------------------------------------------ main


def parse_shapes(text: str) -> list[tuple[str, str]]:
    from vllm_lite.testing.gpu_bench import SHAPES

    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, mode = item.partition(":")
        mode = mode or "full"
        if name not in SHAPES or mode not in ("full", "batch1"):
            raise SystemExit(f"--shapes: {item!r}: expected NAME or NAME:batch1, NAME one of {sorted(SHAPES)}")
        out.append((name, mode))
    return out


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if args.smoke:
        d = dict(
            shapes="tiny",
            num_prompts=8,
            input_len=(8, 24),
            output_len=16,
            batch1_input_len=8,
            batch1_output_len=8,
            batch1_iters=1,
            batch1_iters_batch1_shapes=1,
            profile_steps=2,
            prefill_b1_iters=2,
            max_model_len=128,
            hf_batch="8",
            matmul_n=256,
            copy_mib=16,
            probe_reps=3,
        )
    else:
        d = dict(
            shapes="llama-1b,llama-8b:batch1",
            num_prompts=256,
            input_len=(128, 512),
            output_len=128,
            batch1_input_len=128,
            batch1_output_len=128,
            batch1_iters=2,
            batch1_iters_batch1_shapes=1,
            profile_steps=10,
            prefill_b1_iters=5,
            max_model_len=1024,
            hf_batch="256",
            matmul_n=8192 if cuda else 1024,
            copy_mib=1024 if cuda else 256,
            probe_reps=20 if cuda else 3,
        )
        if args.quick:
            d.update(shapes="llama-1b", num_prompts=64, output_len=64, batch1_output_len=64, profile_steps=5)
            d["hf_batch"] = "64"
    for key in ("shapes", "num_prompts", "output_len", "batch1_iters", "profile_steps", "hf_batch"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    if args.batch1_iters is not None:
        d["batch1_iters_batch1_shapes"] = args.batch1_iters
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if not cuda and dtype == "float16":
        raise SystemExit("float16 on CPU is not supported by this benchmark: use float32 or bfloat16")
    d.update(
        device=args.device,
        dtype=dtype,
        seed=args.seed,
        max_num_seqs=max(int(d["num_prompts"]), 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        compare_eager=args.compare_eager,
        compare_async=args.compare_async,
        trace_dir=args.trace_dir,
        llm_kwargs=json.loads(args.llm_kwargs) if args.llm_kwargs else {},
        skip_hf=args.skip_hf,
        skip_mp_profile=args.skip_mp_profile,
        skip_compare_profile=args.skip_compare_profile,
        test_hang=args.test_hang,
        mp_profile_steps=args.mp_profile_steps or 3 * int(d["profile_steps"]),
        mp_trace_dir=args.mp_trace_dir,
        hf_8b=args.hf_8b,
        multiprocess=True,
        worker_timeout_s=args.worker_timeout,
    )
    d["hf_batch"] = [int(b) for b in str(d["hf_batch"]).split(",") if b.strip()]
    d["input_len"] = list(d["input_len"])
    return d


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent is a fact to record
            env[mod] = None
    try:
        env["commit"] = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        env["commit"] = None
    if device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(torch.device(device))
        props = torch.cuda.get_device_properties(torch.device(device))
        env["device_memory_gib"] = round(props.total_memory / (1 << 30), 1)
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def run_probes(s: dict[str, Any]) -> dict[str, Any]:
    from vllm_lite.testing.gpu_bench import copy_bandwidth, matmul_rate

    device = torch.device(s["device"])
    dtype = getattr(torch, s["dtype"])
    copy = copy_bandwidth(device, s["copy_mib"] << 20, s["probe_reps"])
    mm = matmul_rate(device, dtype, s["matmul_n"], s["probe_reps"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy": copy,
        "matmul": mm,
        "copy_gb_per_s": round(copy["bytes_per_s"] / 1e9, 1),
        "matmul_tflops": round(mm["flops_per_s"] / 1e12, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--shapes", default=None, help="NAME[:batch1],... (default llama-1b,llama-8b:batch1)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, tiny workload (the CPU smoke test)")
    ap.add_argument("--quick", action="store_true", help="llama-1b only, 64 prompts, 64 new tokens")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--batch1-iters", type=int, default=None, help="batch-1 requests (median reported)")
    ap.add_argument("--profile-steps", type=int, default=None, help="decode steps per timed/profiled window")
    ap.add_argument("--hf-batch", default=None, help="HF batch sizes, comma-separated; the best is reported")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default unless given")
    ap.add_argument("--enforce-eager", action="store_true", help="LLM(enforce_eager=True): no CUDA graphs")
    ap.add_argument(
        "--compare-eager", action="store_true", help="full shapes run with and without enforce_eager; same tokens?"
    )
    ap.add_argument(
        "--compare-async",
        action="store_true",
        help="full shapes run with async_scheduling=False and True (multiprocess figures, same tokens?, and the "
        "in-process decode profile of each); 'unsupported' where EngineArgs has no async_scheduling",
    )
    ap.add_argument(
        "--trace-dir",
        default=None,
        help="also write gzipped Chrome traces (CPU ops, kernels, the phases' ranges) of 3 steps of each step "
        "profile to this folder: SHAPE[-async]-{bn,b1,pn,p1}.json.gz (open in Perfetto / chrome://tracing)",
    )
    ap.add_argument("--llm-kwargs", default=None, help="extra LLM(...) arguments as JSON, e.g. '{\"seed\": 1}'")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--skip-mp-profile",
        action="store_true",
        help="skip the multiprocess engine's decode busy fraction (start_profile/stop_profile, its own interpreter)",
    )
    ap.add_argument(
        "--mp-profile-steps", type=int, default=None, help="frontend decode steps in that window (default 3x profile)"
    )
    ap.add_argument(
        "--mp-trace-dir",
        default=None,
        help="keep the multiprocess engine core's Chrome traces (VLLM_TORCH_PROFILER_DIR) in DIR/SHAPE-multiprocess",
    )
    ap.add_argument("--hf-8b", action="store_true", help="run HF generate on the full llama-8b shape too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="checkpoint folder, kept and reused (default: a temp dir)")
    ap.add_argument(
        "--worker-timeout",
        type=float,
        default=400.0,
        help="seconds for each worker interpreter (at most the time left before --time-limit's soft stop)",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=330,
        help="seconds for the whole run from this interpreter's start (0: none), a hard wall: a worker "
        "interpreter gets at most the time left; at LIMIT less a grace (8%%, 3-15 s) the running part stops "
        "(its worker's process group is killed, what the profile worker had measured is kept) and the run prints "
        "the JSON it has; at LIMIT a watchdog kills every process the run started, prints that JSON and exits "
        "whatever the main thread is stuck in. SIGTERM stops the run the same way (hard wall 8 s later)",
    )
    ap.add_argument(
        "--out-json",
        default=None,
        help='also write the result to this file, rewritten (atomically) after every part with "partial": true, '
        'so a run killed from outside leaves its last complete state; the final result has "partial": false',
    )
    ap.add_argument(
        "--skip-compare-profile",
        action="store_true",
        help="--compare-async: skip the in-process decode step profile of the non-default scheduling (the "
        "multiprocess comparison run, tok/s and batch-1, still runs)",
    )
    ap.add_argument("--test-hang", choices=("main", "profile"), default=None, help=argparse.SUPPRESS)  # tests
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: KIND SPEC_FILE
    args = ap.parse_args()
    if args.worker is not None:
        kind, spec_file = args.worker
        with open(spec_file) as f:
            spec = json.load(f)
        die_with_parent(spec.get("parent_pid"))
        workers = {"profile": profile_worker, "mp_profile": mp_profile_worker, "hf": hf_worker, "hang": hang_worker}
        out = workers[kind](spec)
        print(json.dumps(out), flush=True)
        return 0

    RUN["out_json"] = os.path.abspath(args.out_json) if args.out_json else None
    s = settings_from(args)
    shapes = parse_shapes(s["shapes"])
    result: dict[str, Any] = {"benchmark": "gpu", "partial": True, "stopped": None, "errors": []}
    RUN["result"] = result
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm_lite_gpu_bench-")
    os.makedirs(workdir, exist_ok=True)
    try:
        arm_time_limit(args.time_limit)
        if args.test_hang == "main":  # tests: a run stuck where no TimeLimit reaches (only the hard wall ends it)
            _test_hang_main()
        result.update(environment(s["device"]))
        result["host"] = host_description()  # the CPU beside the device: the host side's figures depend on it
        result["settings"] = {
            **{k: v for k, v in s.items() if not k.startswith("_")},
            "workload": f"{s['num_prompts']} prompts of {s['input_len'][0]}-{s['input_len'][1]} random token ids "
            f"(seed {s['seed']}), {s['output_len']} new tokens each, ignore_eos, temperature 0",
            "batch1": f"{s['batch1_iters']} requests of {s['batch1_input_len']} tokens, {s['batch1_output_len']} new "
            "tokens each, ms per output token after the first (median)",
            "time_to_ready": "LLM(...) construction plus the first one-token request",
            "roofline": "per decode step: max(bytes moved / copy bandwidth, FLOPs / matmul rate); bytes = matmul "
            "weights + K/V read; copy bandwidth counts read + write",
        }
        result["shapes"] = {name: {"mode": mode, "errors": [], "status": "not run yet"} for name, mode in shapes}
        log(f"device {result['device']}; shapes {shapes}; time limit {args.time_limit} s")
        save_partial("probes")
        try:
            result["probes"] = run_probes(s)
            log(
                f"probes: copy {result['probes']['copy_gb_per_s']} GB/s, matmul {result['probes']['matmul_tflops']} TFLOP/s"
            )
        except Exception as e:  # noqa: BLE001
            result["probes"] = {}
            result["errors"].append(_err("probes", e))
        s["_tokenizers"] = {}
        for name, mode in shapes:
            entry = result["shapes"][name]
            entry.pop("status")
            t0 = time.perf_counter()
            try:
                run_shape(name, mode, s, result["probes"], workdir, entry)
            except TimeLimit as stop:
                entry["errors"].append(f"stopped during this shape: {RUN['stop_reason'] or stop}")
                raise
            except Exception as e:  # noqa: BLE001
                entry["errors"].append(_err(name, e))
            finally:
                entry["seconds"] = round(time.perf_counter() - t0, 1)
            if not args.workdir:
                shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
            log(f"{name}: done in {entry['seconds']} s, {len(entry['errors'])} errors")
            save_partial(f"{name} done")
    except TimeLimit as stop:
        log(f"stopping: {stop}")
        result["stopped"] = str(RUN["stop_reason"] or stop)
        for entry in result.get("shapes", {}).values():
            if entry.pop("status", None):
                entry["errors"].append(f"not run: {result['stopped']}")
    except Exception as e:  # noqa: BLE001
        result["errors"].append(_err("main", e))
    finally:
        if hasattr(signal, "SIGALRM"):
            signal.setitimer(signal.ITIMER_REAL, 0)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        result["elapsed_s"] = round(time.perf_counter() - T0, 1)
        result.pop("current_part", None)
        try:
            from vllm_lite.testing.gpu_bench import summary_lines

            for line in summary_lines(result):
                log(line)
        except Exception as e:  # noqa: BLE001 - the summary is a courtesy; the JSON below is the result
            log(f"summary failed: {type(e).__name__}: {e}")
        with END_LOCK:  # the watchdog has not printed (else this process would be gone): this thread prints
            RUN["finished"] = True
            disarm()
            result["partial"] = result["stopped"] is not None
            text = json.dumps(result)
            try:
                write_out_json(text)
            except OSError as e:
                log(f"--out-json: {e}")
            print(text, flush=True)
    failed = result["stopped"] or result["errors"] or any(e["errors"] for e in result.get("shapes", {}).values())
    return 1 if failed else 0


def _test_hang_main() -> None:
    """--test-hang main: a child process (this run's, as an engine core is) and a main thread that swallows
    every TimeLimit, as a stuck shutdown would: only the hard wall ends this run."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    RUN["result"]["test_child_pid"] = child.pid
    save_partial("--test-hang main")
    log(f"--test-hang main: child {child.pid}; the main thread now ignores the time limit")
    while True:
        try:
            threading.Event().wait()
        except TimeLimit:
            continue


if __name__ == "__main__":
    sys.exit(main())
