"""A stand-in engine core for driving a GPUModelRunner step by step under async scheduling's contract (issue #14),
without a scheduler: tests/test_async_runner.py and scripts/async_gpu_check.py.

Every running request prefills its whole prompt in one step, then decodes one token a step. With `async_` each step
is launched with non_block=True and the previous step's output is read only after the next launch (two in flight),
as the engine core's batch queue does: a request whose last token is still in flight is sent as a cached request
with one token at the placeholder's position; a request that stops at update(N) (`eos_at`) still runs in step N+1
and that token is discarded; a preempted request still takes its in-flight token and is re-admitted with every token
known. `max_tokens` is never scheduled past (the core's rule), so such requests leave at the sync step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import PLACEHOLDER_TOKEN
from vllm_lite.worker.step import AsyncModelRunnerOutput, CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class StandInRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int]
    eos_at: Optional[int] = None  # finishes at the update that brings its output to this length (a stop token)
    eos_token_id: Optional[int] = None
    out: list[int] = field(default_factory=list)
    ph: int = 0  # placeholders: sampled by a launched step, not yet known
    computed: int = 0
    sent: bool = False
    status: str = "running"  # running | preempted | finished
    logprobs: list[tuple] = field(default_factory=list)
    prompt_logprobs: list[tuple] = field(default_factory=list)


class StandInCore:
    """A stand-in engine core: every running request prefills its whole prompt, then decodes one token a step."""

    def __init__(self, runner: Any, async_: bool, record_inputs: bool = True, blocks_per_req: int = 4) -> None:
        self.runner, self.async_, self.blocks_per_req = runner, async_, blocks_per_req
        self.reqs: dict[str, StandInRequest] = {}
        self.to_finish: set[str] = set()
        self.in_flight: deque = deque()
        self.step_inputs: list[list[int]] = []  # the forward's input ids, per step
        self.checks: list[Callable[[], None]] = []  # run right after each launch, before any get_output
        if record_inputs:  # on CPU only (a host read of the input ids)
            runner.model.register_forward_pre_hook(lambda m, args: self.step_inputs.append(args[0].tolist()))

    def add(self, i: int, prompt: list[int], params: SamplingParams, **kw: Any) -> None:
        """Request r{i}, holding blocks 1 + i * blocks_per_req onwards (block 0 is the pool's null block)."""
        rid = f"r{i}"
        blocks = [1 + i * self.blocks_per_req + j for j in range(self.blocks_per_req)]
        self.reqs[rid] = StandInRequest(rid, list(prompt), params, blocks, **kw)

    def preempt(self, rid: str) -> None:
        r = self.reqs[rid]
        r.status, r.sent, r.computed = "preempted", False, 0
        self.to_finish.add(rid)

    def resume(self, rid: str) -> None:
        r = self.reqs[rid]
        assert r.status == "preempted" and r.ph == 0, "re-admitted only with every token known"
        r.status = "running"

    def schedule(self) -> SchedulerOutput:
        new, cached, sched = [], CachedRequestData(), {}
        for r in self.reqs.values():
            if r.status != "running" or len(r.out) + r.ph >= r.params.max_tokens:
                continue
            total = len(r.prompt) + len(r.out) + r.ph
            if not r.sent:
                assert r.ph == 0
                new.append(
                    NewRequestData(
                        req_id=r.rid,
                        prompt_token_ids=list(r.prompt),
                        output_token_ids=list(r.out),
                        sampling_params=r.params,
                        block_ids=list(r.blocks),
                        num_computed_tokens=0,
                        eos_token_id=r.eos_token_id,
                    )
                )
                r.sent = True
            else:
                cached.req_ids.append(r.rid)
                cached.new_block_ids.append([])
                cached.num_computed_tokens.append(r.computed)
            sched[r.rid] = total - r.computed
            r.computed = total
            if self.async_:
                r.ph += 1
        finished, self.to_finish = self.to_finish, set()
        return SchedulerOutput(new, cached, sched, sum(sched.values()), finished)

    def update(self, out) -> None:
        for i, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            r = self.reqs[rid]
            if rid in out.prompt_logprobs_dict and out.prompt_logprobs_dict[rid] is not None:
                lp = out.prompt_logprobs_dict[rid]
                r.prompt_logprobs.append((lp.logprob_token_ids.clone(), lp.logprobs.clone()))
            if not toks:
                continue
            if self.async_:
                r.ph -= len(toks)
            if r.status == "finished":
                continue  # ran one step past its stop (async): discarded, as the core does
            r.out += toks
            if out.logprobs is not None and r.params.logprobs is not None:
                lp = out.logprobs.slice(i, i + 1)
                r.logprobs.append((lp.logprob_token_ids.clone(), lp.logprobs.clone(), lp.selected_token_ranks.clone()))
            if r.eos_at is not None and len(r.out) >= r.eos_at or len(r.out) >= r.params.max_tokens:
                if r.status == "running":
                    self.to_finish.add(rid)
                r.status = "finished"

    def step(self) -> None:
        so = self.schedule()
        if not self.async_:
            self.update(self.runner.execute_model(so))
            return
        handle = self.runner.execute_model(so, non_block=True)
        assert isinstance(handle, AsyncModelRunnerOutput)
        self.in_flight.append(handle)
        for check in self.checks:
            check()
        self.assert_placeholders()
        if len(self.in_flight) == 2:
            self.update(self.in_flight.popleft().get_output())

    def drain(self) -> None:
        while self.in_flight:
            self.update(self.in_flight.popleft().get_output())

    def assert_placeholders(self) -> None:
        """The tokens of the step just launched are -1 in the runner's host batch (no forward can read them)."""
        batch = self.runner.input_batch
        for r in self.reqs.values():
            row = batch.req_id_to_row.get(r.rid)
            if row is None or r.ph == 0 or r.status != "running":
                continue
            known = len(r.prompt) + len(r.out)
            assert batch.num_tokens[row] == known + r.ph
            # The step just launched is never read yet (an earlier one may be: penalties wait for its tokens).
            assert batch.token_ids[row, known + r.ph - 1] == PLACEHOLDER_TOKEN, (r.rid, known, r.ph)
            assert batch.token_ids[row, known - 1] != PLACEHOLDER_TOKEN
