"""Pieces of benchmarks/gpu.py that are not CUDA-specific: the model shapes, random-weight checkpoints
built on any device, the device probes (copy bandwidth, matmul rate), the per-step roofline, the
busy fraction of a profiled window, the summary of a profiler's device events, the per-phase timer of a
step (PhaseTimer: wraps existing functions by name, no edit of the engine) and the cProfile summary.
Tested on CPU (tests/test_gpu_bench_smoke.py).
"""

from __future__ import annotations

import gzip
import json
import os
import pstats
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

# name -> (arch, config kwargs). Llama shapes use vocab 8000; "qwen2-100m" is the CI bench shape
# (vllm_lite.testing.checkpoints, size "100m"), with its tokenizer's vocabulary.
_LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama-8b-8l": ("llama", dict(_LLAMA_8B, num_hidden_layers=8)),
    "llama-8b": ("llama", dict(_LLAMA_8B, num_hidden_layers=32)),
    "qwen2-100m": ("qwen2", {}),
    # The CPU smoke shape: seconds to build and run.
    "tiny": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
        ),
    ),
}
SHAPE_VOCAB = {"qwen2-100m": 32000, "tiny": 512}
DEFAULT_VOCAB = 8000


def shape_vocab(name: str) -> int:
    return SHAPE_VOCAB.get(name, DEFAULT_VOCAB)


def hf_config(name: str):
    """The transformers config of shape `name` (bos 1, eos 2, pad 0, as the test checkpoints)."""
    import transformers

    from vllm_lite.testing.checkpoints import BOS_ID, EOS_ID, PAD_ID, _hf_config

    if name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}.")
    arch, kwargs = SHAPES[name]
    vocab = shape_vocab(name)
    if arch == "qwen2":
        return _hf_config("qwen2", "100m", vocab, None)
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **kwargs,
    )


def config_facts(cfg: dict[str, Any]) -> dict[str, int]:
    """Layer counts and sizes from a config.json dict, with the per-token matmul parameters
    (every projection and the LM head; the embedding is a row lookup, not counted)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    mlp = 3 * h * inter
    return {
        "hidden_size": h,
        "num_layers": n_layers,
        "intermediate_size": inter,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": hd,
        "vocab_size": cfg["vocab_size"],
        "matmul_params": n_layers * (attn + mlp) + h * cfg["vocab_size"],
    }


def decode_step_cost(facts: dict[str, int], batch: float, sum_context: float, dtype_bytes: int) -> dict[str, float]:
    """Bytes a decode step must move and FLOPs it must do, at `batch` sequences whose contexts sum to
    `sum_context` tokens: every matmul weight read once, each sequence's K and V read for every layer;
    FLOPs: 2 per weight per token, plus QK^T and PV (2 x 2 x heads x head_dim per context token per layer)."""
    weight_bytes = facts["matmul_params"] * dtype_bytes
    kv_per_token = 2 * facts["num_layers"] * facts["num_kv_heads"] * facts["head_dim"] * dtype_bytes
    kv_bytes = kv_per_token * sum_context
    flops = (
        2.0 * facts["matmul_params"] * batch
        + 4.0 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"] * sum_context
    )
    return {"weight_bytes": float(weight_bytes), "kv_read_bytes": float(kv_bytes), "flops": float(flops)}


def roofline(
    cost: dict[str, float], measured_ms: float, copy_bytes_per_s: float, matmul_flops_per_s: float
) -> dict[str, float]:
    """Measured step time against max(bytes / copy bandwidth, FLOPs / matmul rate)."""
    bytes_moved = cost["weight_bytes"] + cost["kv_read_bytes"]
    bytes_ms = 1e3 * bytes_moved / copy_bytes_per_s
    flops_ms = 1e3 * cost["flops"] / matmul_flops_per_s
    limit_ms = max(bytes_ms, flops_ms)
    return {
        "measured_ms": _sig(measured_ms),
        "bytes_moved": round(bytes_moved),
        "weight_bytes": round(cost["weight_bytes"]),
        "kv_read_bytes": round(cost["kv_read_bytes"]),
        "flops": cost["flops"],
        "bytes_ms": _sig(bytes_ms),
        "flops_ms": _sig(flops_ms),
        "roofline_ms": _sig(limit_ms),
        "bound": "bytes" if bytes_ms >= flops_ms else "flops",
        "fraction_of_roofline": _sig(limit_ms / measured_ms) if measured_ms > 0 else None,
    }


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (small CPU figures keep their precision)."""
    return float(f"{x:.{digits}g}")


def busy_fraction(intervals: Iterable[tuple[float, float]], window: float) -> float:
    """Length of the union of (start, end) intervals over `window` (same unit), clamped to [0, 1]:
    overlapping kernels (several streams) count once."""
    if window <= 0:
        return 0.0
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return max(0.0, min(1.0, busy / window))


def summarize_device_events(
    events: Iterable[tuple[str, float, float]],
    runtime: Iterable[tuple[str, float, float]],
    wall_us: float,
    steps: int,
    cuda: bool,
    top: int = 12,
) -> dict[str, Any]:
    """A profiled window of `steps` steps lasting `wall_us`: `events` are (name, start_us, end_us) of the
    device's activity (CUDA kernels and copies; on CPU the CPU operators), `runtime` the host-side CUDA API calls
    and driver calls (cudaLaunchKernel, cuLaunchKernel (Triton), cudaGraphLaunch, cudaMemcpyAsync,
    cudaStreamSynchronize, ...; empty off CUDA).
    Busy fraction (union of the intervals), busy and idle ms per step, kernels per step, kernel-time fraction,
    the top kernels (or CPU ops) by time, and the top runtime calls (a long cudaMemcpyAsync / synchronize is the
    host waiting for the device)."""
    events = list(events)
    runtime = list(runtime)
    steps = max(steps, 1)
    busy = busy_fraction([(s, e) for _, s, e in events], wall_us)
    facts: dict[str, Any] = {
        "busy_fraction": round(busy, 4),
        "busy_source": "CUDA kernels and copies" if cuda else "CPU operators (no GPU)",
        "device_events": len(events),
        "profiled_step_ms": round(wall_us / 1e3 / steps, 4),
        "busy_ms_per_step": round(busy * wall_us / 1e3 / steps, 4),
        "idle_ms_per_step": round((1 - busy) * wall_us / 1e3 / steps, 4),
    }
    if cuda:
        kernels = [ev for ev in events if not ev[0].startswith(("Memcpy", "Memset"))]
        copies = [ev for ev in events if ev[0].startswith(("Memcpy", "Memset"))]
        facts["kernels_per_step"] = round(len(kernels) / steps, 1)
        facts["kernel_time_fraction"] = round(sum(e - s for _, s, e in kernels) / wall_us, 4) if wall_us > 0 else 0.0
        facts["kernel_ms_per_step"] = round(sum(e - s for _, s, e in kernels) / 1e3 / steps, 4)
        facts["copies_per_step"] = round(len(copies) / steps, 1)
        facts["copy_ms_per_step"] = round(sum(e - s for _, s, e in copies) / 1e3 / steps, 4)
        facts["top_kernels"] = _top_by_time(kernels, steps, top)
        if runtime:
            facts["top_runtime_calls"] = _top_by_time(runtime, steps, 8)
    else:
        facts["top_cpu_ops"] = _top_by_time(events, steps, top)
    return facts


# Chrome-trace categories (torch.profiler / Kineto) of the device's own activity and of the host's CUDA calls.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def read_chrome_trace(path: str) -> dict[str, Any]:
    """A torch.profiler Chrome trace (plain or .gz, as `export_chrome_trace` and the engine core's
    $VLLM_TORCH_PROFILER_DIR traces write it) as (name, start_us, end_us) lists: `device_events` (categories
    kernel, gpu_memcpy, gpu_memset), `runtime` (cuda_runtime, cuda_driver) and `cpu_ops`; `window_us`, the
    profiled window (the profiler's own "Trace" span, else the extent of all events); `device_span_us`, first
    device event start to last end (0 without any); `engine_steps` from the engine core's metadata (None
    without it)."""
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    device: list[tuple[str, float, float]] = []
    runtime: list[tuple[str, float, float]] = []
    cpu: list[tuple[str, float, float]] = []
    spans: list[tuple[float, float]] = []
    lo, hi = float("inf"), float("-inf")
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "ts" not in ev:
            continue
        start = float(ev["ts"])
        end = start + float(ev.get("dur", 0.0))
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if cat == "Trace":
            spans.append((start, end))
            continue
        lo, hi = min(lo, start), max(hi, end)
        if cat in DEVICE_CATEGORIES:
            device.append((name, start, end))
        elif cat in RUNTIME_CATEGORIES:
            runtime.append((name, start, end))
        elif cat == "cpu_op":
            cpu.append((name, start, end))
    if spans:
        window = max(e for _, e in spans) - min(s for s, _ in spans)
    else:
        window = hi - lo if hi > lo else 0.0
    meta = trace.get("vllm_lite_profile") or {}
    return {
        "device_events": device,
        "runtime": runtime,
        "cpu_ops": cpu,
        "window_us": window,
        "device_span_us": (max(e for _, _, e in device) - min(s for _, s, _ in device)) if device else 0.0,
        "engine_steps": meta.get("engine_steps"),
        "meta": meta,
    }


def trace_busy_facts(parsed: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The busy figures of an engine core's exported trace (`read_chrome_trace`): on CUDA the union of its
    kernel/copy intervals over the whole profiled window (`busy_fraction`: also the start and stop calls'
    drains) and over the device's first-to-last span (`busy_fraction_device_span`), per engine step; off CUDA
    the fraction is meaningless (CPU operators are not a device's work) and is None, with a note."""
    steps = parsed.get("engine_steps")
    out: dict[str, Any] = {
        "engine_steps": steps,
        "window_ms": round(parsed["window_us"] / 1e3, 3),
        "cpu_ops": len(parsed["cpu_ops"]),
        "device_events": len(parsed["device_events"]),
    }
    if not cuda:
        out["busy_fraction"] = None
        out["note"] = "no GPU: a busy fraction of CPU operators says nothing about a device; trace parsed only"
        return out
    intervals = [(s, e) for _, s, e in parsed["device_events"]]
    out["busy_fraction"] = round(busy_fraction(intervals, parsed["window_us"]), 4)
    out["busy_fraction_device_span"] = round(busy_fraction(intervals, parsed["device_span_us"]), 4)
    if steps:
        out["window_ms_per_step"] = round(parsed["window_us"] / 1e3 / steps, 4)
        out["busy_ms_per_step"] = round(out["busy_fraction"] * parsed["window_us"] / 1e3 / steps, 4)
        out["kernels_per_step"] = round(len(parsed["device_events"]) / steps, 1)
    if parsed["runtime"]:
        out["top_runtime_calls"] = _top_by_time(parsed["runtime"], max(steps or 1, 1), 6)
    out["top_kernels"] = _top_by_time(parsed["device_events"], max(steps or 1, 1), 6)
    return out


def _top_by_time(events: list[tuple[str, float, float]], steps: int, n: int) -> list[dict[str, Any]]:
    by_name: dict[str, list[float]] = {}
    for name, s, e in events:
        acc = by_name.setdefault(name[:100], [0, 0.0])
        acc[0] += 1
        acc[1] += e - s
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k, "per_step": round(c / steps, 1), "us_per_step": round(t / steps, 1)} for k, (c, t) in ranked]


def host_time(step_ms: float, busy_fraction_: float, profiled_step_ms: float) -> dict[str, float]:
    """Host time a step: the unprofiled step time less the device's busy time a step (busy fraction times the
    profiled step time): what the device waits on the host for, each step."""
    busy_ms = busy_fraction_ * profiled_step_ms
    return {
        "step_ms": round(step_ms, 4),
        "gpu_busy_ms": round(busy_ms, 4),
        "host_ms": round(max(step_ms - busy_ms, 0.0), 4),
        "host_fraction": round(max(step_ms - busy_ms, 0.0) / step_ms, 4) if step_ms > 0 else 0.0,
    }


class PhaseTimer:
    """Wall time and calls of named functions of a live engine, without editing its files: `wrap` swaps
    `obj.attr` (a bound method, a module's function, an nn.Module's forward, a class's method) for a wrapper
    that times it (time.perf_counter) inside a torch.profiler.record_function range of the phase's name, so a
    profiler trace shows the ranges too; `restore` puts every original back (reverse order). Nesting is
    observed at run time: a phase's self time is its time less that of the phases called inside it, and its
    parent is the phase it was last called from. A name the object lacks is listed in `missing` (the engine's
    functions may be renamed) and skipped. One thread (the in-process engine's step loop)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.child_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.parent: dict[str, Optional[str]] = {}
        self.missing: list[str] = []
        self._stack: list[str] = []
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, obj: Any, attr: str, name: str, on_return: Optional[Callable[[Any], None]] = None) -> bool:
        fn = getattr(obj, attr, None) if obj is not None else None
        if fn is None or not callable(fn):
            self.missing.append(name)
            return False
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        had, old = attr in own, own.get(attr)
        if isinstance(obj, type):  # a class's method: the wrapper becomes the class attribute, called with self
            fn = own.get(attr, fn)
        for table in (self.seconds, self.child_seconds):
            table.setdefault(name, 0.0)
        self.calls.setdefault(name, 0)
        self.parent.setdefault(name, None)
        from torch.profiler import record_function

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack
            parent = stack[-1] if stack else None
            stack.append(name)
            t0 = time.perf_counter()
            try:
                with record_function(name):
                    out = fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                self.seconds[name] += dt
                self.calls[name] += 1
                if parent is not None:
                    self.child_seconds[parent] += dt
                    self.parent[name] = parent
            if on_return is not None:
                on_return(out)
            return out

        try:
            setattr(obj, attr, timed)
        except (AttributeError, TypeError):  # __slots__, a C type: not timed, said so
            self.missing.append(name)
            return False
        self._undo.append((obj, attr, had, old))
        return True

    def restore(self) -> None:
        while self._undo:
            obj, attr, had, old = self._undo.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

    def summary(self, steps: int) -> dict[str, Any]:
        """Per phase called: inclusive and self microseconds a step, calls a step, the phase it ran inside."""
        steps = max(steps, 1)
        return {
            k: {
                "us_per_step": round(1e6 * self.seconds[k] / steps, 1),
                "self_us_per_step": round(1e6 * (self.seconds[k] - self.child_seconds[k]) / steps, 1),
                "calls_per_step": round(self.calls[k] / steps, 2),
                "parent": self.parent[k],
            }
            for k in self.seconds
            if self.calls[k]
        }


def top_functions(stats: pstats.Stats, steps: int, n: int = 10, sort: str = "tottime", only: str = "") -> list:
    """The top `n` functions of a cProfile run over `steps` steps, by self time ("tottime") or inclusive time
    ("cumtime"), optionally only those whose file path contains `only`: function (file:line(name), the path
    from the package or site-packages on), calls a step, self and inclusive microseconds a step."""
    steps = max(steps, 1)
    rows = []
    for (path, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if only and only not in path:
            continue
        rows.append((tt if sort == "tottime" else ct, path, line, func, ncalls, tt, ct))
    rows.sort(key=lambda r: -r[0])
    out = []
    for _, path, line, func, ncalls, tt, ct in rows[:n]:
        out.append(
            {
                "function": f"{_short_path(path)}:{line}({func})",
                "calls_per_step": round(ncalls / steps, 2),
                "self_us_per_step": round(1e6 * tt / steps, 1),
                "cum_us_per_step": round(1e6 * ct / steps, 1),
            }
        )
    return out


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "vllm_lite/", "benchmarks/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + (len("site-packages/") if marker == "site-packages/" else 0) :]
    return path


def _first_difference(a: list[list[int]], b: list[list[int]]) -> Optional[dict[str, int]]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return {"sequence": i, "token": j}
    return None


def plan_variants(s: dict[str, Any], full: bool, engine_fields: set[str]) -> dict[str, Any]:
    """The multiprocess engine runs of a shape, label -> (enforce_eager, extra LLM kwargs), the main one first:
    --compare-eager adds the other enforce_eager, --compare-async (full shapes) runs async_scheduling=False and
    True, or says why it cannot ("compare_async" -> the reason, when `engine_fields` (EngineArgs' fields) lack
    async_scheduling)."""
    eager = s["enforce_eager"]
    out: dict[str, Any] = {}
    async_ok = "async_scheduling" in engine_fields
    if full and s.get("compare_async") and not async_ok:
        out["compare_async"] = "unsupported: EngineArgs has no async_scheduling field in this tree"
    both_async = full and s.get("compare_async") and async_ok
    base = {"async_scheduling": False} if both_async else {}
    out["eager" if eager else "graphs"] = (eager, base)
    if full and s["compare_eager"]:
        out["graphs" if eager else "eager"] = (not eager, base)
    if both_async:
        out["async"] = (eager, {"async_scheduling": True})
    return {k: out[k] for k in sorted(out, key=lambda k: k == "compare_async")}  # the main run stays first


def compare_runs(la: str, a: dict[str, Any], lb: str, b: dict[str, Any]) -> dict[str, Any]:
    """Two multiprocess runs' figures side by side, and whether their greedy tokens are identical."""
    cmp: dict[str, Any] = {}
    for label, r in ((la, a), (lb, b)):
        cmp[label] = {
            "tokens_per_s": r["workload"]["tokens_per_s"],
            "batch1_ms_per_token": r["batch1"]["ms_per_token"],
            "batch1_ttft_ms": r["batch1"]["ttft_ms"],
            "time_to_ready_s": r["time_to_ready_s"],
        }
    cmp["tokens_per_s_ratio"] = round(b["workload"]["tokens_per_s"] / a["workload"]["tokens_per_s"], 3)
    cmp["batch1_ms_per_token_ratio"] = round(b["batch1"]["ms_per_token"] / a["batch1"]["ms_per_token"], 3)
    aw, bw = a["workload"]["tokens"], b["workload"]["tokens"]
    cmp["greedy_identical_workload"] = aw == bw
    cmp["workload_sequences_differing"] = sum(x != y for x, y in zip(aw, bw))
    cmp["first_difference_workload"] = _first_difference(aw, bw)
    cmp["greedy_identical_batch1"] = a["batch1"]["tokens"] == b["batch1"]["tokens"]
    cmp["first_difference_batch1"] = _first_difference(a["batch1"]["tokens"], b["batch1"]["tokens"])
    return cmp


def summary_lines(result: dict[str, Any]) -> list[str]:
    """A few human-readable lines of benchmarks/gpu.py's JSON (the step profiles' headline figures), for the log:
    per shape throughput, batch 1, and per step profile its ms, device busy / kernel ms, host ms, the top phases by
    self time and the top kernels; --compare-async's ratios."""
    lines = []
    for name, e in result.get("shapes", {}).items():
        head = [f"{name}:"]
        for key, label, unit in (
            ("vllm_lite_tokens_per_s", "out tok/s", ""),
            ("ratio_vs_hf", "x HF", ""),
            ("batch1_ms_per_token", "batch-1", " ms/tok"),
            ("batch1_ttft_ms", "TTFT", " ms"),
            ("gpu_busy_fraction", "busy", ""),
            ("gpu_busy_fraction_multiprocess", "busy (multiprocess)", ""),
        ):
            if key in e:
                head.append(f"{label} {e[key]}{unit}")
        if e.get("errors"):
            head.append(f"{len(e['errors'])} errors")
        lines.append(" ".join(head))
        for key in (
            "decode_step",
            "decode_step_batch1_inprocess",
            "prefill_step",
            "prefill_step_batch1",
            "decode_step_async",
            "decode_step_batch1_async",
        ):
            st = e.get(key)
            if not st:
                continue
            ms = st.get("step_ms_median", st.get("measured_ms", st.get("step_ms")))
            parts = [f"  {key}: {ms} ms/step"]
            if "busy_ms_per_step" in st:
                parts.append(f"busy {st['busy_ms_per_step']} ms")
            if "kernel_ms_per_step" in st:
                parts.append(f"kernels {st['kernel_ms_per_step']} ms ({st.get('kernels_per_step')}/step)")
            if "host" in st:
                parts.append(f"host {st['host']['host_ms']} ms")
            if "floor" in st:
                parts.append(f"floor {st['floor']['roofline_ms']} ms ({st['floor']['tokens_per_step']} tok/step)")
            lines.append(", ".join(parts))
            phases = sorted(st.get("phases", {}).items(), key=lambda kv: -kv[1]["self_us_per_step"])[:6]
            if phases:
                lines.append("    self us/step: " + ", ".join(f"{k} {v['self_us_per_step']}" for k, v in phases))
            kernels = st.get("top_kernels") or st.get("top_cpu_ops") or []
            if kernels:
                lines.append("    top: " + "; ".join(f"{k['name'][:48]} {k['us_per_step']} us" for k in kernels[:4]))
        ca = e.get("compare_async")
        if ca:
            if "unsupported" in ca or "error" in ca:
                lines.append(f"  compare_async: {ca.get('unsupported') or ca.get('error')}")
            else:
                lines.append(
                    f"  compare_async: tok/s x{ca.get('tokens_per_s_ratio')}, batch-1 ms x"
                    f"{ca.get('batch1_ms_per_token_ratio')}, greedy identical: workload "
                    f"{ca.get('greedy_identical_workload')}, batch-1 {ca.get('greedy_identical_batch1')}"
                )
    return lines


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, reps: int, device: torch.device) -> float:
    """Mean milliseconds of fn() over reps, after one warm-up call (CUDA events on CUDA)."""
    fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Device-to-device copy rate, bytes read plus bytes written per second (a copy of N bytes moves 2N)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps, device)
    return {"copy_bytes": nbytes, "copy_ms": round(ms, 4), "bytes_per_s": 2 * nbytes / (ms / 1e3)}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> dict[str, Any]:
    """FLOP/s of an n x n x n matmul in dtype."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _time_ms(lambda: a @ b, reps, device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 4), "flops_per_s": 2 * n**3 / (ms / 1e3)}


def _tokenizer(vocab: int, tokenizer_cache: Optional[dict[int, str]], scratch: str) -> str:
    from vllm_lite.testing.checkpoints import build_tokenizer

    if tokenizer_cache is not None and vocab in tokenizer_cache:
        return tokenizer_cache[vocab]
    path = build_tokenizer(os.path.join(scratch, f".tokenizer-{vocab}"), vocab_size=vocab)
    if tokenizer_cache is not None:
        tokenizer_cache[vocab] = path
    return path


@torch.no_grad()
def build_random_checkpoint(
    name: str,
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    tokenizer_cache: Optional[dict[int, str]] = None,
    shard_bytes: int = 2 << 30,
) -> dict[str, Any]:
    """Write shape `name` as a Hugging Face checkpoint at path: the tensors' names and shapes come from
    the transformers model built on the meta device, their random values are drawn on `device` (matrices
    std 0.02, norm gains 1 + 0.2 noise, biases 0.1 noise) and written as safetensors shards in parallel.
    Returns the build's timings and sizes."""
    import transformers
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    config = hf_config(name)
    config.dtype = dtype
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    del meta
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    tok = _tokenizer(config.vocab_size, tokenizer_cache, os.path.dirname(os.path.abspath(path)))
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), os.path.join(path, f))

    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for key in sorted(shapes):
        shape = shapes[key]
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) == 1 and key.endswith("weight"):
            t.mul_(0.2).add_(1.0)
        elif len(shape) == 1:
            t.mul_(0.1)
        else:
            t.mul_(0.02)
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
        total += nbytes
    t_gen = time.perf_counter() - t0
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: n for n, shard in zip(names, shards) for k in shard},
        }
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    with ThreadPoolExecutor(max_workers=min(8, len(shards))) as pool:
        list(
            pool.map(
                lambda ns: save_file(ns[1], os.path.join(path, ns[0]), metadata={"format": "pt"}), zip(names, shards)
            )
        )
    return {
        "build_s": round(time.perf_counter() - t0, 2),
        "random_init_s": round(t_gen, 2),
        "checkpoint_bytes": total,
        "shards": len(shards),
        "init_device": str(device),
    }
