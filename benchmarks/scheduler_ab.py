"""The scheduler's host time per decode step, this tree against a baseline tree, interleaved step by step in one
process (issue #14).

On a shared VM the machine's speed drifts by 1.5-2x within seconds, more than the changes being measured. So both
schedulers run here side by side: the baseline's `vllm_lite` package is copied under the name `vllm_lite_base`
(its imports rewritten) and each decode step times `schedule` and `update_from_output` of one, then of the other,
alternating which goes first. The workload is benchmarks/scheduler_step.py's: `--batch` requests of random 128-512
token prompts (block_size 16, prefix caching on), steady decode, a fake runner output built outside the timed calls.
Prints one JSON line per mode (sync, async): medians of each side and the median of the per-step ratios new/base.

    git archive <commit> vllm_lite | tar -x -C /tmp/base
    python benchmarks/scheduler_ab.py --baseline /tmp/base [--batch 256] [--steps 600] [--reverse]
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

from vllm_lite.testing.baselines import bench_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def load(package: str) -> SimpleNamespace:
    mod = {
        "Request": ("core.request", "Request"),
        "Scheduler": ("core.sched.scheduler", "Scheduler"),
        "SamplingParams": ("sampling_params", "SamplingParams"),
        "make_config": ("testing.scheduler_config", "make_config"),
        "ModelRunnerOutput": ("worker.step", "ModelRunnerOutput"),
    }
    return SimpleNamespace(**{k: getattr(importlib.import_module(f"{package}.{m}"), a) for k, (m, a) in mod.items()})


def load_baseline(tree: str) -> SimpleNamespace:
    """The baseline tree's package, importable next to ours as `vllm_lite_base`."""
    tmp = tempfile.mkdtemp(prefix="scheduler-ab-")
    dst = os.path.join(tmp, "vllm_lite_base")
    shutil.copytree(os.path.join(tree, "vllm_lite"), dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    name = re.compile(r"\bvllm_lite\b")
    for root, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(name.sub("vllm_lite_base", text))
    sys.path.insert(0, tmp)
    return load("vllm_lite_base")


class Side:
    """One scheduler and its steps in flight."""

    def __init__(self, ns: SimpleNamespace, batch: int, steps: int, async_scheduling: bool, seed: int, rev: bool):
        cfg = ns.make_config(
            num_gpu_blocks=batch * (512 + 16 + 2 * steps) // 16 + 64,
            block_size=16,
            max_num_batched_tokens=8192,
            max_num_seqs=batch,
            max_model_len=4096,
        )
        cfg.scheduler_config.async_scheduling = async_scheduling
        self.ns = ns
        self.sched = ns.Scheduler(cfg)
        self.async_scheduling = async_scheduling
        self.reverse = rev
        self.batch = batch
        rng = random.Random(seed)
        for i in range(batch):
            prompt = [rng.randrange(1000) for _ in range(rng.randint(128, 512))]
            sp = ns.SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
            self.sched.add_request(ns.Request(f"r{i}", prompt, sp, 2, float(i)))
        self.pending: list[tuple[Any, Any]] = []

    def step(self) -> tuple[float, float, bool]:
        """(schedule s, update s, steady decode?) of one engine step."""
        clock = time.perf_counter
        while True:
            t0 = clock()
            so = self.sched.schedule()
            t1 = clock()
            ids = list(so.num_scheduled_tokens)
            decode = len(ids) == self.batch and so.total_num_scheduled_tokens == self.batch
            if self.reverse:
                ids.reverse()
            self.pending.append(
                (so, self.ns.ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[7]] * len(ids)))
            )
            if self.async_scheduling and len(self.pending) < 2:
                continue
            so_u, mro_u = self.pending.pop(0)
            t2 = clock()
            self.sched.update_from_output(so_u, mro_u)
            t3 = clock()
            return t1 - t0, t3 - t2, decode


def run(base: SimpleNamespace, new: SimpleNamespace, args: argparse.Namespace, async_scheduling: bool) -> dict:
    sides = [Side(ns, args.batch, args.steps, async_scheduling, args.seed, args.reverse) for ns in (base, new)]
    times: dict[str, list[list[float]]] = {"schedule": [[], []], "update": [[], []]}
    warm = 0
    n = 0
    while len(times["update"][0]) < args.steps:
        order = (0, 1) if n % 2 == 0 else (1, 0)
        n += 1
        got = {}
        for i in order:
            got[i] = sides[i].step()
        if got[0][2] and got[1][2]:
            warm += 1
            if warm > 10:
                for i in (0, 1):
                    times["schedule"][i].append(got[i][0])
                    times["update"][i].append(got[i][1])
    out: dict[str, Any] = {}
    for part, (b, w) in times.items():
        out[f"{part}_base_us"] = round(1e6 * statistics.median(b), 1)
        out[f"{part}_new_us"] = round(1e6 * statistics.median(w), 1)
        out[f"{part}_ratio"] = round(statistics.median(y / x for x, y in zip(b, w)), 3)
    step_b = [s + u for s, u in zip(*(times[p][0] for p in times))]
    step_w = [s + u for s, u in zip(*(times[p][1] for p in times))]
    out["step_base_us"] = round(1e6 * statistics.median(step_b), 1)
    out["step_new_us"] = round(1e6 * statistics.median(step_w), 1)
    out["step_ratio"] = round(statistics.median(y / x for x, y in zip(step_b, step_w)), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a tree holding the baseline's vllm_lite/ (git archive)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reverse", action="store_true", help="the runner's output in the reverse of the step's order")
    args = ap.parse_args()
    base = load_baseline(args.baseline)
    new = load("vllm_lite")
    for mode in ("sync", "async"):
        result = {"benchmark": "scheduler_ab", "mode": mode, "batch": args.batch, "steps": args.steps}
        result["reverse"] = args.reverse
        result.update(run(base, new, args, mode == "async"))
        result["load"] = round(os.getloadavg()[0], 2)
        print(bench_json(result), flush=True)


if __name__ == "__main__":
    main()
