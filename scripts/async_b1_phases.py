"""Batch-1 decode with and without async scheduling: wall time per token and where it goes, per engine phase.

    python3 scripts/async_b1_phases.py [--model DIR] [--tokens 64] [--rounds 3]

A GPU-lease diagnostic (it runs on CPU too): on the bundled 4-layer model an H100 showed async scheduling slower
than synchronous at batch 1 (about 1.0 against 0.69 ms/token), the opposite of llama-1b. Each phase (schedule,
execute_model, the async handle's get_output, update_from_output, the frontend's process_outputs) is wrapped with
perf_counter; printed per engine: ms/token, engine steps per token, and microseconds per token in each phase, so a
phase that grows under async (a wait, a second step per token) stands out. Mode async_2execs is async with two
graph execs a key replayed in turn (CudaDecodeGraphs.execs_per_key = 2); --cprofile N adds each mode's top N
Python functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _wrap(obj: Any, attr: str, key: str, acc: dict, calls: dict) -> None:
    fn = getattr(obj, attr)

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t0
            calls[key] += 1
        if key == "execute_model" and hasattr(out, "get_output"):  # an async handle: time its wait too
            get = out.get_output

            def timed_get() -> Any:
                t1 = time.perf_counter()
                try:
                    return get()
                finally:
                    acc["get_output"] += time.perf_counter() - t1
                    calls["get_output"] += 1

            out.get_output = timed_get
        return out

    setattr(obj, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-of-engines", type=int, default=2, help="engines per mode, built in turn")
    ap.add_argument("--cprofile", type=int, default=0, help="also print the top N Python functions by own time")
    a = ap.parse_args()
    import torch

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.default_model import resolve_model
    from vllm_lite.worker.cuda_graphs import CudaDecodeGraphs

    model = resolve_model(a.model)
    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {"gpu_memory_utilization": 0.12, "max_num_seqs": 16} if cuda else {}
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 138))}]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": model}
    modes = ("sync", "async", "async_2execs") * a.rounds_of_engines
    for name in modes:
        CudaDecodeGraphs.execs_per_key = 2 if name == "async_2execs" else 1
        try:
            llm = LLM(
                model,
                dtype="bfloat16",
                multiprocess=False,
                max_model_len=512,
                disable_log_stats=True,
                async_scheduling=name != "sync",
                **kw,
            )
        finally:
            CudaDecodeGraphs.execs_per_key = 1
        core = llm.llm_engine.engine_core.engine_core
        acc: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        llm.generate(prompt, params, use_tqdm=False)  # warm-up, untimed
        _wrap(core.scheduler, "schedule", "schedule", acc, calls)
        _wrap(core.executor, "execute_model", "execute_model", acc, calls)
        _wrap(core.scheduler, "update_from_output", "update_from_output", acc, calls)
        _wrap(core, "step", "engine_step", acc, calls)
        _wrap(llm.llm_engine.output_processor, "process_outputs", "process_outputs", acc, calls)
        t0 = time.perf_counter()
        toks = 0
        for _ in range(a.rounds):
            out = llm.generate(prompt, params, use_tqdm=False)
            toks += len(out[0].outputs[0].token_ids)
        wall = time.perf_counter() - t0
        row = {
            "ms_per_token": round(1e3 * wall / toks, 4),
            "engine_steps_per_token": round(calls["engine_step"] / toks, 3),
            "us_per_token": {k: round(1e6 * v / toks, 1) for k, v in acc.items()},
            "calls_per_token": {k: round(v / toks, 3) for k, v in calls.items()},
        }
        if a.cprofile and not result.get(name):  # each mode's first engine: one more round under cProfile
            prof = cProfile.Profile()
            prof.runcall(llm.generate, prompt, params, use_tqdm=False)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.cprofile)
            print(f"### {name} cProfile (one round of {a.tokens} tokens)\n{buf.getvalue()}", flush=True)
        result.setdefault(name, []).append(row)
        print(name, json.dumps(row), flush=True)
        llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
