"""Drive a real Scheduler without a model: made-up requests and a fake runner that picks each sampled token.

Scheduler unit tests share these so each test states only the behaviour it checks.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch

from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs
from vllm_lite.core.request import Request
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.structured_output.backend_types import GrammarCompileError, StructuredOutputMatcher
from vllm_lite.structured_output.request import StructuredOutputRequest
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.step import LogprobsTensors, ModelRunnerOutput, SchedulerOutput

_arrivals = itertools.count()

TokenFn = Callable[[Request], int]


def make_request(
    rid: str,
    prompt: int | list[int],
    *,
    start: int = 100,
    priority: int = 0,
    eos: Optional[int] = None,
    client_index: int = 0,
    cache_salt: Optional[str] = None,
    arrival: Optional[float] = None,
    **sp,
) -> Request:
    """A WAITING request: `prompt` is a token list or a length (tokens start, start+1, ...); max_tokens 16 unless
    given. Arrival times increase with each call unless `arrival` pins one."""
    tokens = list(range(start, start + prompt)) if isinstance(prompt, int) else list(prompt)
    sp.setdefault("max_tokens", 16)
    return Request(
        rid,
        tokens,
        SamplingParams(**sp),
        eos,
        float(next(_arrivals)) if arrival is None else arrival,
        priority=priority,
        client_index=client_index,
        cache_salt=cache_salt,
    )


def tight_scheduler(policy: str = "fcfs", **kw) -> Scheduler:
    """A Scheduler over 4 usable blocks of 4 tokens, max_model_len 16 and no prefix caching unless `kw` says
    otherwise (any other make_config setting too): two 7-token prompts collide at their third block."""
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("max_model_len", 16)
    return Scheduler(make_config(num_gpu_blocks=5, block_size=4, policy=policy, **kw))


def fake_runner_output(
    sched: Scheduler, so: SchedulerOutput, token_fn: TokenFn = lambda r: 7, logprobs: bool = False
) -> ModelRunnerOutput:
    """What a model runner returns: one token for each request whose known tokens are all computed now."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.get_request(rid)
        sampled.append([token_fn(req)] if req is not None and req.num_computed_tokens >= req.num_tokens else [])
    lp = None
    if logprobs:
        n = len(req_ids)
        lp = LogprobsTensors(
            torch.arange(n, dtype=torch.int64).view(n, 1), torch.full((n, 1), -0.5), torch.ones(n, dtype=torch.int64)
        )
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, lp)


def step(sched: Scheduler, token_fn: TokenFn = lambda r: 7) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """One schedule -> fake forward -> update_from_output."""
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_runner_output(sched, so, token_fn))


def outputs_by_id(outs: dict[int, EngineCoreOutputs]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for eco in outs.values() for o in eco.outputs}


def run_to_completion(
    sched: Scheduler, token_fn: TokenFn = lambda r: 7, max_steps: int = 500
) -> dict[str, list[EngineCoreOutput]]:
    """Step until nothing is unfinished; every output per request, in order."""
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        _, outs = step(sched, token_fn)
        for rid, o in outputs_by_id(outs).items():
            got.setdefault(rid, []).append(o)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(sched.requests)}")


class ScriptedMatcher(StructuredOutputMatcher):
    """A grammar that allows exactly `script`, then only `eos` (then nothing): enough to drive the scheduler's
    structured-output bookkeeping without a tokenizer or a grammar compiler. `complete_at_end`: the grammar
    reports itself terminated once the script is done, before its EOS (as a complete regex may)."""

    def __init__(self, script: list[int], eos: int, complete_at_end: bool = False) -> None:
        super().__init__()
        self.script = list(script)
        self.eos = eos
        self.complete_at_end = complete_at_end
        self.accepted: list[int] = []

    def _next_allowed(self) -> Optional[int]:
        n = len(self.accepted)
        if n < len(self.script):
            return self.script[n]
        return self.eos if n == len(self.script) else None

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for tok in token_ids:
            if tok != self._next_allowed():
                return False
            self.accepted.append(tok)
            self.num_accepted_tokens += 1
        return True

    def _rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        tok = self._next_allowed()
        if tok is not None:
            word = int(bitmask[row, tok // 32]) | (1 << (tok % 32))
            bitmask[row, tok // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wrap

    def is_terminated(self) -> bool:
        return len(self.accepted) >= len(self.script) + (0 if self.complete_at_end else 1)

    def reset(self) -> None:
        self.accepted = []
        self.num_accepted_tokens = 0


class ControlledGrammars:
    """Stands in for the grammar compiler of `sched`: each constrained request added gets a compile future the
    test resolves (`compile` with a matcher, `fail` with a message), in the order the requests were added."""

    def __init__(self, sched: Scheduler) -> None:
        self.futures: list[Future] = []
        sched.structured_output_manager.grammar_init = self._grammar_init  # type: ignore[method-assign]

    def _grammar_init(self, params: object) -> StructuredOutputRequest:
        future: Future = Future()
        self.futures.append(future)
        return StructuredOutputRequest(future)

    def compile(self, index: int, matcher: StructuredOutputMatcher) -> None:
        self.futures[index].set_result(matcher)

    def fail(self, index: int, message: str) -> None:
        self.futures[index].set_exception(GrammarCompileError(message))
