"""The scheduler's host time per decode step at large batch, model-free (issue #14/#15).

A real Scheduler over a fake model: `--batch` requests of random 128-512 token prompts (block_size 16, prefix
caching on) run to steady decode; then `--steps` decode steps are timed, `schedule` and `update_from_output`
separately (the fake runner output is built outside the timed region). Sync and async scheduling are both
measured (async: step N+1 is scheduled before step N's update, as the engine core does). With --cold, a 64 MiB
buffer is written before each timed call (untimed), as a CPU model forward evicts the caches between the
scheduler's calls in a real step. Prints one JSON line.

    python benchmarks/scheduler_step.py [--batch 256] [--steps 200] [--reps 5] [--cold] [--reverse]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from vllm_lite.core.request import Request  # noqa: E402
from vllm_lite.core.sched.scheduler import Scheduler  # noqa: E402
from vllm_lite.sampling_params import SamplingParams  # noqa: E402
from vllm_lite.testing.baselines import bench_json  # noqa: E402
from vllm_lite.testing.scheduler_config import make_config  # noqa: E402
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput  # noqa: E402


def _mro(so: SchedulerOutput, reverse: bool = False) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    if reverse:  # a runner whose batch rows are not in the scheduler's order (after joins and condensing)
        ids.reverse()
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[7] for _ in ids], None)


def run(batch: int, steps: int, async_scheduling: bool, seed: int, cold: bool = False, reverse: bool = False) -> dict:
    cfg = make_config(
        num_gpu_blocks=batch * (512 + 16 + 4 * steps) // 16 + 64,
        block_size=16,
        max_num_batched_tokens=2048,
        max_num_seqs=batch,
        max_model_len=4096,
    )
    cfg.scheduler_config.async_scheduling = async_scheduling
    sched = Scheduler(cfg)
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(128, 512))]
        sp = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, sp, 2, float(i)))
    t_sched: list[float] = []
    t_upd: list[float] = []
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    warm = 0
    clock = time.perf_counter
    flush = np.zeros(16 << 20, dtype=np.float32) if cold else None
    while len(t_upd) < steps:
        if flush is not None:
            flush += 1.0
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        decode = len(so.num_scheduled_tokens) == batch and so.total_num_scheduled_tokens == batch
        pending.append((so, _mro(so, reverse)))
        if async_scheduling and len(pending) < 2:
            continue
        so_u, mro_u = pending.pop(0)
        if flush is not None:
            flush += 1.0
        t2 = clock()
        sched.update_from_output(so_u, mro_u)
        t3 = clock()
        if decode:
            warm += 1
            if warm > 10:  # steady decode
                t_sched.append(t1 - t0)
                t_upd.append(t3 - t2)
    return {
        "schedule_us": round(1e6 * statistics.median(t_sched), 1),
        "update_us": round(1e6 * statistics.median(t_upd), 1),
        "schedule_mean_us": round(1e6 * statistics.fmean(t_sched), 1),
        "update_mean_us": round(1e6 * statistics.fmean(t_upd), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each timed call")
    ap.add_argument("--reverse", action="store_true", help="the runner's output in the reverse of the step's order")
    args = ap.parse_args()
    out: dict = {"benchmark": "scheduler_step", "batch": args.batch, "steps": args.steps, "reps": args.reps}
    out["cold"] = args.cold
    out["reverse"] = args.reverse
    for mode in ("sync", "async"):
        runs = [
            run(args.batch, args.steps, mode == "async", args.seed + r, args.cold, args.reverse)
            for r in range(args.reps)
        ]
        out[mode] = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
        out[mode]["step_us"] = round(out[mode]["schedule_us"] + out[mode]["update_us"], 1)
    out["load"] = os.getloadavg()[0]
    print(bench_json(out))


if __name__ == "__main__":
    main()
