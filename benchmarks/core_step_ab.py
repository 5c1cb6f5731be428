"""The engine-core process's host time per decode step, this tree against a baseline tree, interleaved iteration
by iteration in one process (issue #14).

benchmarks/core_step.py's setup (a real EngineCoreProc with its sockets and output thread over a real EngineCore and
Scheduler, a model-free stand-in executor, a frontend in a child process sending `--batch` requests) twice: once
from this tree and once from the baseline's `vllm_lite` imported as `vllm_lite_base` (benchmarks/scheduler_ab.py's
loader). Their busy loops are driven `--chunk` iterations each in turn (alternating which goes first), since the
VM's speed drifts more than the changes measured. With one iteration a turn the same code on both sides measured
0.72-1.45 (each side's output thread takes the GIL during the other's iterations); with 20, 0.94-1.06: run the
baseline against this tree's own copy first to see the spread. An iteration is the busy loop's body: read input, housekeeping,
`step()`, route the outputs. Only steady decode iterations count (the step launched and the step updated both ran
`--batch` one-token requests); `core_us` is an iteration less the stand-in executor's own time. Prints one JSON
line: medians of each side and the median of the per-iteration ratios new/base.

    git archive <commit> vllm_lite | tar -x -C /tmp/base
    python benchmarks/core_step_ab.py --baseline /tmp/base [--batch 256] [--steps 300] [--sync] [--chunk 20]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from vllm_lite.testing.baselines import bench_json

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import core_step  # noqa: E402
import scheduler_ab  # noqa: E402


class Side:
    """One EngineCoreProc (from `package`) with its frontend child, stepped one busy-loop iteration at a time."""

    def __init__(self, package: str, args: argparse.Namespace) -> None:
        mod = importlib.import_module
        engine_core = mod(f"{package}.core.engine_core")
        proc_mod = mod(f"{package}.core.engine_core_proc")
        addresses_cls = mod(f"{package}.endpoints").CoreAddresses
        cfg = core_step.core_config(mod(f"{package}.testing.scheduler_config").make_config, args)

        class Proc(proc_mod.EngineCoreProc):
            def _make_engine_core(self, vllm_config: Any) -> Any:
                return engine_core.EngineCore(vllm_config, core_step.StandInExecutor)

        tmp = tempfile.mkdtemp(prefix="core-step-ab-")
        self.addresses = addresses_cls(f"ipc://{tmp}/in.sock", f"ipc://{tmp}/out.sock")
        self.proc = Proc(cfg, self.addresses, proc_mod.CoreProcOptions(heartbeat_timeout_s=None))
        self.core = self.proc.engine_core
        self.batch = args.batch
        self.flags = {"launched": 0, "updated": 0, "execute": 0.0}
        sched = self.core.scheduler
        schedule, update, execute = sched.schedule, sched.update_from_output, self.core.executor.execute_model
        clock = time.perf_counter

        def timed_schedule() -> Any:
            so = schedule()
            self.flags["launched"] = so.total_num_scheduled_tokens == self.batch == len(so.num_scheduled_tokens)
            return so

        def timed_update(so: Any, mro: Any) -> Any:
            self.flags["updated"] = so.total_num_scheduled_tokens == self.batch == len(so.num_scheduled_tokens)
            return update(so, mro)

        def timed_execute(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            r = execute(*a, **kw)
            self.flags["execute"] += clock() - t0
            return r

        sched.schedule = timed_schedule
        sched.update_from_output = timed_update
        self.core.executor.execute_model = timed_execute
        self.child = subprocess.Popen(
            [sys.executable, core_step.__file__, "--frontend", self.addresses.input, self.addresses.output]
            + [str(args.batch), str(args.steps + 40), str(args.seed)]
        )
        self.times: list[float] = []

    def iterate(self) -> None:
        """One busy-loop iteration (EngineCoreProc.run_busy_loop's body, without blocking or shutdown)."""
        p = self.proc
        f = self.flags
        f["launched"] = f["updated"] = 0
        f["execute"] = 0.0
        t0 = time.perf_counter()
        p._process_input(block=False)
        p._housekeeping()
        core = p.engine_core
        if core.has_unfinished_requests() and not p._batch_open() and not p._awaiting_verdict():
            p._route_outputs(p._step())
        dt = time.perf_counter() - t0
        if f["launched"] and f["updated"]:
            self.times.append(dt - f["execute"])

    def close(self) -> None:
        self.child.wait(60)
        self.proc._close(dead=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a tree holding the baseline's vllm_lite/ (git archive)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--chunk", type=int, default=20, help="iterations a side runs at its turn")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    scheduler_ab.load_baseline(args.baseline)
    sides = [Side("vllm_lite_base", args), Side("vllm_lite", args)]
    n = 0
    deadline = time.monotonic() + 120
    while min(len(s.times) for s in sides) < args.steps + 10 and time.monotonic() < deadline:
        for i in (0, 1) if n % 2 == 0 else (1, 0):
            for _ in range(args.chunk):
                sides[i].iterate()
        n += 1
    # Drain: let both frontends see every request finish.
    while any(s.core.has_unfinished_requests() for s in sides) and time.monotonic() < deadline:
        for s in sides:
            s.iterate()
    for s in sides:
        s.close()
    k = min(len(s.times) for s in sides)
    base, new = (s.times[10:k] for s in sides)
    out = {"benchmark": "core_step_ab", "batch": args.batch, "async": not args.sync, "steps": len(base)}
    out["core_base_us"] = round(1e6 * statistics.median(base), 1)
    out["core_new_us"] = round(1e6 * statistics.median(new), 1)
    out["ratio"] = round(statistics.median(y / x for x, y in zip(base, new)), 3)
    out["load"] = round(os.getloadavg()[0], 2)
    print(bench_json(out))


if __name__ == "__main__":
    main()
