"""Share of decode-step time spent sampling, on the ~100M Qwen2 checkpoint (bf16), batch 64. Prints one JSON line.

Every request uses all penalties, temperature, top-k and top-p, so the sampler does its
full work. The benchmark runs an in-process LLM and wraps, inside the real engine:
- `runner.sampler.forward` (the sampler call in GPUModelRunner.execute_model),
- `runner.input_batch.sampling.make_metadata` / `append_token_ids` (the per-step sampling bookkeeping),
- `engine_core.step` (schedule -> execute_model -> update: the whole step) and
  `executor.execute_model` (the worker part),
and reports the sampler's share over pure-decode steps (every one of the 64 rows decoding).

    python benchmarks/sampler_share.py [--batch 64] [--prompt-len 32] [--new-tokens 24] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.testing.baselines import bench_json
from vllm_lite.testing.checkpoints import get_checkpoint  # noqa: E402


class _Timers:
    """Wall time of wrapped calls, attributed to the current engine step when it is a pure decode."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.in_decode = False
        self.totals: dict[str, float] = defaultdict(float)
        self.decode_steps = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.in_decode:
                    self.totals[name] += time.perf_counter() - t0

        return timed

    def wrap_execute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """execute_model: decide whether this step is a full-batch pure decode, then time it."""

        def timed(so: Any) -> Any:
            n = len(so.num_scheduled_tokens)
            self.in_decode = n == self.batch and so.total_num_scheduled_tokens == n
            t0 = time.perf_counter()
            try:
                return fn(so)
            finally:
                if self.in_decode:
                    self.totals["execute_model"] += time.perf_counter() - t0
                    self.decode_steps += 1

        return timed

    def wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The whole core step; attributed after execute_model told us what kind of step it was."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.in_decode = False
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.in_decode:
                    self.totals["core_step"] += time.perf_counter() - t0
                self.in_decode = False

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = get_checkpoint("qwen2", size="100m")
    llm = LLM(
        model=path,
        dtype=args.dtype,
        multiprocess=False,
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        num_threads=args.threads,
    )
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    runner = core.executor.worker.model_runner
    timers = _Timers(args.batch)
    runner.sampler.forward = timers.wrap("sampler", runner.sampler.forward)
    state = runner.input_batch.sampling
    state.make_metadata = timers.wrap("make_metadata", state.make_metadata)
    state.append_token_ids = timers.wrap("append_token_ids", state.append_token_ids)
    core.executor.execute_model = timers.wrap_execute(core.executor.execute_model)
    core.step = timers.wrap_step(core.step)

    params = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        seed=None,
    )
    vocab = len(llm.get_tokenizer())
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()}
        for _ in range(args.batch)
    ]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    timers.totals.clear()
    timers.decode_steps = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)

    t = timers.totals
    steps = max(timers.decode_steps, 1)
    sampling_all = t["sampler"] + t["make_metadata"] + t["append_token_ids"]
    print(
        bench_json(
            {
                "bench": "sampler_share",
                "model": "qwen2-100m",
                "dtype": args.dtype,
                "batch": args.batch,
                "threads": args.threads,
                "decode_steps": timers.decode_steps,
                "core_step_ms": round(1e3 * t["core_step"] / steps, 2),
                "execute_model_ms": round(1e3 * t["execute_model"] / steps, 2),
                "sampler_ms": round(1e3 * t["sampler"] / steps, 3),
                "sampling_bookkeeping_ms": round(1e3 * (t["make_metadata"] + t["append_token_ids"]) / steps, 3),
                "sampler_share_of_step": round(t["sampler"] / t["core_step"], 4) if t["core_step"] else None,
                "sampling_share_of_step": round(sampling_all / t["core_step"], 4) if t["core_step"] else None,
                "wall_s": round(wall, 2),
            }
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
