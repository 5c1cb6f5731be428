"""Honest baselines for benchmarks: each run records how it was configured, and a check refuses
a baseline that differs from the engine in dtype, warm-up or threads unless the JSON says so.

A benchmark builds one `RunConfig` for the engine and one per baseline, puts `as_json()` of each in
its output line, and calls `check_fair(engine, baselines)` before printing: a difference is allowed
only when the baseline names it in `declared`, with the reason, so a reader sees it beside the number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

# What must match between the engine and a baseline unless declared.
COMPARED = ("dtype", "warmup", "threads")


@dataclass
class RunConfig:
    """How one side of a comparison ran."""

    name: str
    dtype: str
    warmup: bool
    threads: int
    batch: Union[int, list[int], None] = None  # a list: the sizes swept (the best is reported)
    # field -> why it differs from the engine's, e.g. {"threads": "HF at torch's default"}.
    declared: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def hf_generate_left_padded(hf: Any, prompts: list[list[int]], new_tokens: int, pad: int = 0) -> int:
    """One HF `generate` over a left-padded batch of token-id prompts, exactly `new_tokens` each, greedy.

    Returns the output tokens produced. Shared by every benchmark's HF baseline so they all run HF alike.
    """
    import torch

    width = max(len(p) for p in prompts)
    device = getattr(hf, "device", None)  # the model's device (CUDA for benchmarks/gpu.py)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    return (out.shape[1] - width) * len(prompts)


def fairness_problems(engine: RunConfig, baseline: RunConfig) -> list[str]:
    """Each compared field where baseline differs from engine and does not say why."""
    problems = []
    for key in COMPARED:
        mine, theirs = getattr(engine, key), getattr(baseline, key)
        if mine != theirs and not baseline.declared.get(key):
            problems.append(
                f"{baseline.name}: {key}={theirs!r} but the engine ran with {key}={mine!r}, "
                f"and the JSON does not say why (set declared[{key!r}])."
            )
    for key in baseline.declared:
        if key not in COMPARED:
            problems.append(f"{baseline.name}: declared[{key!r}] names no compared field ({', '.join(COMPARED)}).")
    return problems


def check_fair(engine: RunConfig, baselines: Sequence[RunConfig]) -> None:
    """Raise ValueError listing every undeclared difference; benchmarks call it before printing results."""
    problems = [p for b in baselines for p in fairness_problems(engine, b)]
    if problems:
        raise ValueError("unfair baseline configuration:\n  " + "\n  ".join(problems))


def engine_core_threads(num_threads: Optional[int]) -> int:
    """The engine core's torch threads on CPU: --num-threads, else every core it may use. That is what its adaptive
    policy (core/thread_policy.py) computes with from the first step on a host where nothing else runs, as in these
    benchmarks: start-up counts as an idle spell. It keeps one core fewer only beside a busy process."""
    if num_threads is not None:
        return num_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores)


def run_json_subprocess(argv: list[str], timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Run `python ARGV` in a fresh interpreter (torch at its default threads) and parse its last stdout line."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the baseline gets torch's own default
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True, check=True, timeout=timeout_s
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def host_description() -> dict[str, Any]:
    """The CPU model and capability a benchmark ran on (platform.describe_host), with whether vllm-lite's CPU kernels
    load on this tree: they are loaded here first (the cached build the engines load), so a benchmark whose engine
    runs in another process does not report them as unknown."""
    from vllm_lite.platform import describe_host
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    load_cpu_ops()
    return describe_host()


def bench_json(result: dict[str, Any]) -> str:
    """A benchmark's JSON output line: its result plus the machine it ran on (CPU model, capability, kernels)."""
    return json.dumps({**result, "host": host_description()})
