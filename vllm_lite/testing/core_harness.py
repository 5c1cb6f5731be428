"""A real in-process `EngineCore` over a tiny checkpoint, driven step by step, for reliability tests.

Tests talk to the core exactly as `EngineCoreProc` does (add_request, step,
abort_requests) and read back what each request got, then check that nothing
leaked: every KV block free again and no request left in the scheduler.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import EngineCoreRequest, FinishReason
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint

# Small enough that a request at max_tokens=2**63-1 still ends in a few dozen steps.
TINY_MAX_MODEL_LEN = 64
_ids = itertools.count()


def tiny_engine_core(**engine_kwargs: Any) -> EngineCore:
    """An EngineCore on CPU over the cached tiny Llama; `engine_kwargs` override EngineArgs fields."""
    kwargs: dict[str, Any] = dict(
        model=get_checkpoint("llama"),
        device="cpu",
        max_model_len=TINY_MAX_MODEL_LEN,
        block_size=8,
        kv_cache_memory_bytes=1 << 20,
        max_num_seqs=16,
    )
    kwargs.update(engine_kwargs)
    return EngineCore(EngineArgs(**kwargs).create_engine_config())


def unique_id(prefix: str) -> str:
    """A request id never used before in this process (the core refuses a live duplicate)."""
    return f"{prefix}-{next(_ids)}"


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: Optional[SamplingParams] = None,
    *,
    eos_token_id: Optional[int] = 2,
    **fields: Any,
) -> EngineCoreRequest:
    """An EngineCoreRequest as a frontend would send it (greedy, 4 tokens, EOS ignored by default)."""
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return EngineCoreRequest(request_id, list(prompt_token_ids), params, eos_token_id, 0.0, **fields)


@dataclass
class Result:
    """Everything one request got back from the core."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None


def drain(core: EngineCore, results: dict[str, Result], max_steps: int = 10_000) -> int:
    """Step until the core has nothing left; collects outputs into `results`; returns the steps taken."""
    steps = 0
    while core.has_unfinished_requests():
        if steps >= max_steps:
            raise AssertionError(f"the core still has unfinished requests after {max_steps} steps")
        steps += 1
        for outs in core.step().values():
            for out in outs.outputs:
                res = results.setdefault(out.request_id, Result())
                if res.finish_reason is not None:
                    raise AssertionError(f"request {out.request_id!r} got an output after it finished: {out!r}")
                res.token_ids.extend(out.new_token_ids)
                res.finish_reason = out.finish_reason
                res.error = out.error
    return steps


def assert_no_leak(core: EngineCore) -> None:
    """Every KV block is free again (cached ones count, they are evictable) and no request is left.

    With async scheduling the step launched on the last tokens is still in flight when the caller has every
    output: it is finished here first, and must yield no request output (its requests had all finished)."""
    sched = core.scheduler
    core.drain()
    late = [o.request_id for ready in core.take_ready_outputs() for outs in ready.values() for o in outs.outputs]
    assert not late, f"outputs after every request finished: {late}"
    assert not core.has_unfinished_requests(), f"requests left in the scheduler: {list(sched.requests)}"
    assert not sched.running and not sched.waiting and not sched.swapped
    assert sched.num_free_blocks == sched.num_total_blocks, (
        f"KV block leak: {sched.num_free_blocks} free of {sched.num_total_blocks}"
    )
