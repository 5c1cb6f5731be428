"""The runner's host work per decode step, synchronous against async scheduling, on CPU (issue #14).

    bench python benchmarks/async_runner_host.py [--batches 1 64] [--tokens 40] [--rounds 5]

Drives a CPU runner (the tiny float32 llama) through testing.stand_in_core.StandInCore, with CUDA-graph stand-ins
so decode steps take the replay path the GPU takes. Each decode step's host time is execute_model (plus, async, the
get_output of the step before) with the model's forward left out (on CUDA a graph replay, one launch), and its ATen
ops outside the forward (each one a launch or ~5-10 us of dispatch on CUDA). Sync and async run interleaved, round
by round, on runners built once; the median step of each round, and the median of those over rounds (robust to
other processes' bursts on a shared machine; --threads 1 keeps the forward off the second core). Prints one JSON line per (batch, mode)
and a final JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.baselines import bench_json
from vllm_lite.testing.cpu_runner import cpu_runner
from vllm_lite.testing.device_ops import DeviceOpCounter, install_stand_in_graphs
from vllm_lite.testing.stand_in_core import StandInCore

BLOCK_SIZE = 16
BLOCKS_PER_REQ = 4  # max_model_len 64


class _Timed:
    """Host seconds and ATen ops of the runner's calls, with the model's forward left out."""

    def __init__(self, runner: Any, count_ops: bool, device_out: bool = False) -> None:
        self.host_s = 0.0
        self.steps: list[float] = []  # each decode step's host seconds
        self.ops = 0
        self.kernels = 0
        self.calls = 0
        self._fwd = 0.0
        self._counter: Any = None
        self._count_ops = count_ops
        orig_forward = runner.model.forward

        def forward(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            if self._counter is not None:
                with self._counter.paused():
                    out = orig_forward(*a, **k)
            else:
                out = orig_forward(*a, **k)
            self._fwd += time.perf_counter() - t0
            return out

        runner.model.forward = forward
        self._in_replay = False
        if device_out:  # the stand-in's whole replay (its metadata and forward context too), LM head and sampler
            for g in runner.cuda_graphs.graphs.values():
                g.replay = self._timed_replay(g.replay)
            runner.model.compute_logits = self._timed_replay(runner.model.compute_logits)
            runner.sampler.forward = self._timed_replay(runner.sampler.forward)

    def _timed_replay(self, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            fwd0 = self._fwd
            if self._counter is not None:
                with self._counter.paused():
                    out = fn(*a, **k)
            else:
                out = fn(*a, **k)
            self._fwd = fwd0 + (time.perf_counter() - t0)  # the forward inside it counted once
            return out

        return timed

    def call(self, fn: Any, *a: Any, **k: Any) -> Any:
        self._fwd = 0.0
        if self._count_ops:
            with DeviceOpCounter() as c:
                self._counter = c
                try:
                    t0 = time.perf_counter()
                    out = fn(*a, **k)
                    dt = time.perf_counter() - t0
                finally:
                    self._counter = None
            self.ops += c.num_ops
            self.kernels += c.num_kernels
        else:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            dt = time.perf_counter() - t0
        self.host_s += dt - self._fwd
        return out


class _Core(StandInCore):
    """StandInCore whose runner calls go through `_Timed` during decode steps."""

    timed: _Timed
    timing = False

    def step(self) -> None:
        so = self.schedule()
        decode = all(n == 1 for n in so.num_scheduled_tokens.values()) and so.total_num_scheduled_tokens > 0
        call = self.timed.call if (self.timing and decode) else (lambda fn, *a, **k: fn(*a, **k))
        before = self.timed.host_s
        if decode and self.timing:
            self.timed.calls += 1
        if not self.async_:
            self.update(call(self.runner.execute_model, so))
        else:
            self.in_flight.append(call(self.runner.execute_model, so, non_block=True))
            if len(self.in_flight) == 2:
                self.update(call(self.in_flight.popleft().get_output))
        if decode and self.timing:
            self.timed.steps.append(self.timed.host_s - before)


def _generation(runner: Any, async_: bool, batch: int, tokens: int, seed0: int) -> _Core:
    core = _Core(runner, async_, record_inputs=False, blocks_per_req=BLOCKS_PER_REQ)
    plen = max(1, min(3, 256 // batch))  # the whole batch prefills in one step of at most 256 tokens (cpu_runner's)
    for i in range(batch):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        core.add(i, [1 + (seed0 + i) % 50, 2 + i % 40, 3][:plen], params)
    return core


def run(batch: int, tokens: int, rounds: int, count_ops: bool, device_out: bool = False) -> dict[str, Any]:
    runners = {}
    for mode in ("sync", "async"):
        r = cpu_runner(BLOCK_SIZE, BLOCKS_PER_REQ, "float32", max(batch, 2), async_scheduling=mode == "async")
        install_stand_in_graphs(r, [(b, 1) for b in sorted({1, batch})])
        runners[mode] = r
    per_step: dict[str, list[float]] = {"sync": [], "async": []}
    ops: dict[str, list[float]] = {"sync": [], "async": []}
    kernels: dict[str, list[float]] = {"sync": [], "async": []}
    outs: dict[str, list] = {}
    for rnd in range(rounds + 1):  # round 0 warms up
        for mode in ("sync", "async") if rnd % 2 else ("async", "sync"):
            runner = runners[mode]
            core = _generation(runner, mode == "async", batch, tokens, rnd)
            timed = _Timed(runner, count_ops, device_out)
            core.timed, core.timing = timed, True
            while any(len(r.out) < r.params.max_tokens for r in core.reqs.values()):
                core.step()
            core.drain()
            del runner.model.forward
            for g in runner.cuda_graphs.graphs.values():
                g.__dict__.pop("replay", None)
            runner.model.__dict__.pop("compute_logits", None)
            runner.sampler.__dict__.pop("forward", None)
            for i in range(batch):  # every request done: the next round re-adds them under new ids
                core.to_finish.add(f"r{i}")
            core.timing = False
            so = core.schedule()
            runner.execute_model(so)
            if rnd:
                per_step[mode].append(1e6 * statistics.median(timed.steps))
                ops[mode].append(timed.ops / timed.calls)
                kernels[mode].append(timed.kernels / timed.calls)
            outs.setdefault(mode, []).append([r.out for r in core.reqs.values()])
    assert outs["sync"] == outs["async"], "async tokens differ from sync"
    row = {
        "batch": batch,
        "decode_steps_per_round": tokens - 1,
        "host_us_per_step": {m: round(statistics.median(v), 1) for m, v in per_step.items()},
        "host_us_per_step_all_rounds": {m: [round(x, 1) for x in v] for m, v in per_step.items()},
    }
    if count_ops:
        row["aten_ops_per_step"] = {m: round(statistics.median(v), 1) for m, v in ops.items()}  # views included
        row["kernels_per_step"] = {m: round(statistics.median(v), 1) for m, v in kernels.items()}  # views not
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", action="store_true", help="count ATen ops outside the forward (slows the host)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument(
        "--device-out",
        action="store_true",
        help="leave out, as the forward, the stand-in graphs' whole replay (on CUDA one launch; the stand-in's "
        "attention metadata and forward context are CPU-only work), the LM head (compute_logits) and the sampler "
        "(its argmax over the vocabulary is device work that grows with the batch on CPU; its Python is left out "
        "too): what remains is the runner's own bookkeeping",
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    result: dict[str, Any] = {"load_avg": os.getloadavg()}
    for b in a.batches:
        row = run(b, a.tokens, a.rounds, a.ops, a.device_out)
        print(bench_json(row), flush=True)
        result[f"b{b}"] = row
    print(bench_json(result))


if __name__ == "__main__":
    main()
