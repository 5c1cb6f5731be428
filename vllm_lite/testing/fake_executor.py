"""A model-free executor for unit tests of the engine core's bookkeeping (EngineCore, step recovery).

It keeps a batch the way the real model runner does (the scheduler's diff: drop finished ids,
(re-)add new requests in full, update cached ones), so a test sees the same protocol errors a
worker would raise, and samples by a fixed rule, `fake_next_token(tokens)`, so every test can
compute the expected ids itself. Failures are injected per step with `fail_when`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.worker.step import LogprobsTensors, ModelRunnerOutput, SchedulerOutput

FAKE_VOCAB = 1000


def fake_next_token(tokens: list[int]) -> int:
    """The token the fake model samples after `tokens` (prompt plus output so far)."""
    return (sum(tokens) * 7 + len(tokens) * 13 + 5) % FAKE_VOCAB


@dataclass
class _Row:
    tokens: list[int]
    num_computed_tokens: int
    num_logprobs: Optional[int]


@dataclass
class FakeExecutor:
    """The executor interface (`determine_num_blocks`, `initialize_cache`, `execute_model`, `shutdown`)."""

    vllm_config: VllmConfig
    # Returns the exception a step must raise (before the batch changes), or None to run it.
    fail_when: Optional[Callable[[SchedulerOutput], Optional[BaseException]]] = None
    batch: dict[str, _Row] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    initialized: Optional[tuple[int, int]] = None
    shut_down: bool = False

    def determine_num_blocks(self) -> tuple[int, int]:
        cc = self.vllm_config.cache_config
        return (cc.num_gpu_blocks or 64, cc.num_cpu_blocks or 0)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.initialized = (num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        if self.fail_when is not None:
            exc = self.fail_when(so)
            if exc is not None:
                raise exc
        self._apply_diff(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            row = self.batch.get(rid)
            if row is None:
                raise KeyError(f"step schedules {rid!r}, which the worker's batch does not hold")
            row.num_computed_tokens += so.num_scheduled_tokens[rid]
            if row.num_computed_tokens > len(row.tokens):
                raise ValueError(f"{rid!r}: {row.num_computed_tokens} tokens computed of {len(row.tokens)} known")
            if row.num_computed_tokens == len(row.tokens):
                tok = fake_next_token(row.tokens)
                row.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, self._logprobs(req_ids))

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.batch[new.req_id] = _Row(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                new.num_computed_tokens,
                new.sampling_params.logprobs,
            )
        cached = so.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            if rid not in self.batch:
                raise KeyError(f"cached request {rid!r} is not in the worker's batch")
            self.batch[rid].num_computed_tokens = num_computed

    def _logprobs(self, req_ids: list[str]) -> Optional[LogprobsTensors]:
        """Row i: the last token of request i with logprob -(i+1) and rank 1 (only read for rows that sampled)."""
        if not any(self.batch[r].num_logprobs is not None for r in req_ids):
            return None
        n = len(req_ids)
        ids = torch.tensor([[self.batch[r].tokens[-1]] for r in req_ids], dtype=torch.int64).view(n, 1)
        lps = -torch.arange(1, n + 1, dtype=torch.float32).view(n, 1)
        return LogprobsTensors(ids, lps, torch.ones(n, dtype=torch.int64))

    def shutdown(self) -> None:
        self.shut_down = True
