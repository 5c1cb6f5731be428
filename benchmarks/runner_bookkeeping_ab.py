"""The runner's per-decode-step host bookkeeping, this tree against a baseline tree, interleaved step by step in one
process (issue #14).

benchmarks/async_runner_host.py times whole runner steps in separate processes; on this shared VM the speed drifts
1.5-2x between (and within) runs, more than the changes measured. Here the baseline's package is imported next to
ours as `vllm_lite_base` (benchmarks/scheduler_ab.py's load_baseline) and one decode step's bookkeeping runs on each
side in turn, alternating which goes first, with no model, sampler or LM head (device work on CUDA): update_requests
(the scheduler's diff; each request gets a new block every 16 tokens, staggered), build_step_inputs, the CUDA-graph
step (step_graph_key, pack_step, the persistent-buffer copies; the replay a no-op), the sampling metadata, then
sync: record_sampled; async: the pending rows of the step before, note_sampled and the step before's fill_pending;
and the step's ModelRunnerOutput (_build_output, the new tree with the runner's req_id_to_index). Prints one JSON
line per (batch, mode): each side's median step, and the median of the per-step ratios new/base.

    git archive <commit> vllm_lite | tar -x -C /tmp/base
    python benchmarks/runner_bookkeeping_ab.py --baseline /tmp/base [--batches 1 64 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_lite.testing.baselines import bench_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

BLOCK, MAX_LEN, PROMPT = 16, 512, 3


class _NoGraph:
    def replay(self) -> None:
        pass


class Side:
    """One tree's batch, graphs and bookkeeping for `batch` decoding requests."""

    def __init__(self, package: str, batch: int, async_: bool) -> None:
        m = SimpleNamespace(
            **{
                k: importlib.import_module(f"{package}.{mod}")
                for k, mod in {
                    "ib": "worker.input_batch",
                    "si": "worker.step_inputs",
                    "cg": "worker.cuda_graphs",
                    "mr": "worker.model_runner",
                    "step": "worker.step",
                    "sp": "sampling_params",
                }.items()
            }
        )
        # a tree whose runner keeps req_id_to_index between steps passes it to _build_output, as its runner does
        self.m, self.async_, self.new = m, async_, hasattr(m.mr.GPUModelRunner, "_req_id_to_index")
        self.batch = m.ib.InputBatch(batch, MAX_LEN, MAX_LEN // BLOCK, 1000, torch.device("cpu"))
        self.ids = [f"r{i}" for i in range(batch)]
        for i, rid in enumerate(self.ids):
            params = m.sp.SamplingParams(temperature=0.0, max_tokens=MAX_LEN, ignore_eos=True)
            blocks = [1 + i * (MAX_LEN // BLOCK)]
            # request i starts i % BLOCK tokens into its block: the new blocks are staggered, as in a real batch
            prompt = [1 + (i + j) % 50 for j in range(PROMPT + i % BLOCK)]
            self.batch.add_request(m.step.NewRequestData(rid, prompt, [], params, blocks, len(prompt) - 1))
        self.next_block = {rid: 2 + i * (MAX_LEN // BLOCK) for i, rid in enumerate(self.ids)}
        self.g = m.cg.CudaDecodeGraphs(None, None, torch.device("cpu"), [batch], BLOCK, MAX_LEN // BLOCK, MAX_LEN)
        key = (batch, 1)
        self.g.graphs[key] = _NoGraph()
        self.g.outputs[key] = torch.zeros(batch, 8)
        self.arange = np.arange(MAX_LEN * batch + 1, dtype=np.int64)
        self.runner = SimpleNamespace(_req_index=None)
        self.step_id = 0
        self.tokens = np.arange(batch, dtype=np.int64) % 900 + 7
        self.prev_tokens: Any = None

    def diff(self) -> tuple[list[list[int]], list[int]]:
        """The scheduler's diff for the next step (built outside the timed region)."""
        b = self.batch
        rows = b.rows_of(self.ids)
        known = b.num_tokens[rows]
        blocks: list[list[int]] = []
        for rid, n, nb in zip(self.ids, known.tolist(), b.num_blocks[rows].tolist()):
            if n > nb * BLOCK:  # the token at position n - 1 runs now: a block more when it starts one
                blocks.append([self.next_block[rid]])
                self.next_block[rid] += 1
            else:
                blocks.append([])
        return blocks, (known - 1).tolist()

    def step(self, blocks: list[list[int]], computed: list[int]) -> None:
        m, b = self.m, self.batch
        self.step_id += 1
        b.update_requests(self.ids, blocks, computed)
        sched = dict.fromkeys(self.ids, 1)
        inputs = m.si.build_step_inputs(b, sched, BLOCK, self.arange)
        if self.async_ and self.prev_tokens is not None:
            b.sampling.any_needs_token_values()
            pos = b.pending_rows(inputs.rows, self.step_id - 1)
            hit = (pos >= 0).nonzero()[0]
            b.pending_sources(inputs.rows[hit], self.step_id - 1)
        out = self.g.run(inputs)
        assert out is not None
        b.num_computed_tokens[inputs.rows] = inputs.seq_lens
        s_idx = np.nonzero(inputs.sampling_mask(b.num_tokens[inputs.rows]))[0]
        rows = inputs.rows[s_idx]
        b.sampling_metadata(rows)
        if self.async_:
            b.note_sampled(rows, self.step_id)
            if self.prev_tokens is not None:
                b.fill_pending(self.prev_tokens, self.step_id - 1)
            self.prev_tokens = self.tokens
        else:
            b.record_sampled(rows, self.tokens)
        sampled = m.mr._Sampled(s_idx, self.tokens, None)
        if self.new:
            m.mr._build_output(inputs, sampled, {}, m.mr.GPUModelRunner._req_id_to_index(self.runner, inputs.req_ids))
        else:
            m.mr._build_output(inputs, sampled, {})


def run(batch: int, async_: bool, steps: int) -> dict[str, Any]:
    sides = {"base": Side("vllm_lite_base", batch, async_), "new": Side("vllm_lite", batch, async_)}
    times: dict[str, list[float]] = {"base": [], "new": []}
    for i in range(steps):
        order = ("base", "new") if i % 2 else ("new", "base")
        for name in order:
            side = sides[name]
            blocks, computed = side.diff()
            t0 = time.perf_counter()
            side.step(blocks, computed)
            times[name].append(time.perf_counter() - t0)
    warm = steps // 10
    base, new = times["base"][warm:], times["new"][warm:]
    a, b = sides["base"].batch, sides["new"].batch
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.block_table, b.block_table)
    assert np.array_equal(a.sampling.num_output, b.sampling.num_output)
    return {
        "batch": batch,
        "mode": "async" if async_ else "sync",
        "base_us": round(1e6 * statistics.median(base), 1),
        "new_us": round(1e6 * statistics.median(new), 1),
        "ratio_new_base": round(statistics.median(n / o for n, o in zip(new, base)), 3),
        "steps": len(base),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="a tree holding the baseline's vllm_lite package")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    from scheduler_ab import load_baseline

    load_baseline(a.baseline)
    print(json.dumps({"load_avg": os.getloadavg()}))
    for b in a.batches:
        for async_ in (False, True):
            print(bench_json(run(b, async_, a.steps)), flush=True)


if __name__ == "__main__":
    main()
