"""A request that makes the worker raise mid-step ends with an error; the core and the others go on.

The failure is injected by wrapping the core's real executor: it raises when a
poisoned request id is in the step (before the worker runs it, or after, so the
worker's batch is left half-advanced). The other requests must finish with the
same tokens as in a run where the poisoned request's twin simply ends at the
same step, and no KV block may leak. Failures that belong to no request (the
batch fails only as a whole, or the worker fails with anything) stay fatal.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import pytest

from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import FinishReason
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.core_harness import (
    Result,
    assert_no_leak,
    drain,
    make_request,
    tiny_engine_core,
    unique_id,
)
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

POISON_AFTER = 3  # the poisoned request runs this many steps fine, then fails in every step it is in


class PoisonedExecutor:
    """The core's executor, except that steps holding a poisoned request raise (once it has run `after` steps)."""

    def __init__(self, inner: object, poisoned: set[str], *, when: str, after: int = POISON_AFTER) -> None:
        self.inner = inner
        self.poisoned = poisoned
        self.when = when  # "before": nothing of the step runs; "after": the worker ran it, then the step fails
        self.after = after
        self.seen: Counter = Counter()
        self.calls = 0
        self.raised = 0
        # Request ids the worker's batch holds, as told by the steps it was given.
        self.held: set[str] = set()

    def _poisoned_in(self, so: SchedulerOutput) -> bool:
        hit = False
        for rid in self.poisoned & set(so.num_scheduled_tokens):
            self.seen[rid] += 1
            hit = hit or self.seen[rid] > self.after
        return hit

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        bad = self._poisoned_in(so)
        if bad and self.when == "before":
            self.raised += 1
            raise RuntimeError("poisoned request in the step (before)")
        self.held -= so.finished_req_ids
        self.held |= {new.req_id for new in so.scheduled_new_reqs}
        out = self.inner.execute_model(so)  # type: ignore[attr-defined]
        if bad:
            self.raised += 1
            raise RuntimeError("poisoned request in the step (after)")
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()  # type: ignore[attr-defined]


class FailingExecutor:
    """Raises whenever `fails(step)` says so; otherwise the real executor runs the step."""

    def __init__(self, inner: object, fails: Callable[[SchedulerOutput], bool]) -> None:
        self.inner = inner
        self.fails = fails

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.total_num_scheduled_tokens and self.fails(so):
            raise RuntimeError("the worker failed")
        return self.inner.execute_model(so)  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self.inner.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def core() -> EngineCore:
    c = tiny_engine_core(enable_prefix_caching=False)
    yield c
    c.shutdown()


def _workload() -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded random requests of different lengths (chunking and decodes share steps)."""
    return [
        ([11, 12, 13, 14, 15], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        ([21, 22, 23] * 7, SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)),
        ([31, 32], SamplingParams(temperature=1.0, seed=11, top_k=20, max_tokens=6, ignore_eos=True, logprobs=2)),
        ([41, 42, 43, 44] * 3, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, presence_penalty=1.0)),
    ]


def _run(
    core: EngineCore, extra: list[tuple[str, list[int], SamplingParams]]
) -> tuple[list[Result], dict[str, Result]]:
    """The workload plus `extra` requests, all added at once; the workload's results in order, and all."""
    ids = [unique_id("w") for _ in _workload()]
    for rid, (prompt, params) in zip(ids, _workload(), strict=True):
        core.add_request(make_request(rid, prompt, params))
    for rid, prompt, params in extra:
        core.add_request(make_request(rid, prompt, params))
    results: dict[str, Result] = {}
    drain(core, results)
    assert_no_leak(core)
    return [results[rid] for rid in ids], results


def _with_executor(core: EngineCore, executor: object) -> Callable[[], None]:
    real = core.executor
    core.executor = executor  # type: ignore[assignment]

    def restore() -> None:
        core.executor = real

    return restore


@pytest.mark.parametrize("when", ["before", "after"])
def test_poisoned_request_gets_an_error_and_the_others_the_same_tokens(core: EngineCore, when: str) -> None:
    poison_prompt = [51, 52, 53, 54, 55, 56]
    # Reference: the poisoned request's twin ends (max_tokens) exactly where the poisoned one will fail.
    twin = SamplingParams(temperature=0.0, max_tokens=POISON_AFTER, ignore_eos=True)
    expected, _ = _run(core, [(unique_id("twin"), poison_prompt, twin)])

    poisoned_id = unique_id("poison")
    executor = PoisonedExecutor(core.executor, {poisoned_id}, when=when)
    restore = _with_executor(core, executor)
    try:
        long_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        got, results = _run(core, [(poisoned_id, poison_prompt, long_params)])
        again, later = _run(core, [])  # the core goes on serving
    finally:
        restore()
    print(
        f"\n[poison {when}] executor calls={executor.calls} raised={executor.raised} "
        f"(failed step + probes), other requests={len(got)}"
    )
    bad = results[poisoned_id]
    assert bad.finish_reason == FinishReason.ERROR
    assert bad.error and "RuntimeError" in bad.error and "poisoned" in bad.error
    assert len(bad.token_ids) == POISON_AFTER  # what it produced before failing stays delivered
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(r.finish_reason == FinishReason.LENGTH and r.error is None for r in got)
    assert [r.token_ids for r in again] == [r.token_ids for r in expected]
    # Nothing of the failed step lingers in the worker's batch beyond the drop notices still due.
    assert executor.held <= set(later), executor.held - set(later)


def test_a_poisoned_request_alone_is_pinned_by_the_canary(core: EngineCore) -> None:
    poisoned_id = unique_id("alone")
    executor = PoisonedExecutor(core.executor, {poisoned_id}, when="before", after=0)
    restore = _with_executor(core, executor)
    try:
        core.add_request(make_request(poisoned_id, [7, 8, 9]))
        results: dict[str, Result] = {}
        drain(core, results)
        # Still serving; its steps also tell the worker to drop whatever the recovery left there.
        _, later = _run(core, [])
    finally:
        restore()
    assert results[poisoned_id].finish_reason == FinishReason.ERROR
    assert results[poisoned_id].token_ids == []
    assert_no_leak(core)
    # Only the last run's requests (their drop notice goes with the next step) may still be in the batch:
    # not the canary, not the poisoned request.
    assert executor.held <= set(later), executor.held - set(later)
    print(f"\n[poison alone] executor calls={executor.calls} raised={executor.raised}")


def test_several_poisoned_requests_in_one_step_all_end_with_errors(core: EngineCore) -> None:
    twin = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    expected, _ = _run(core, [(unique_id("t"), [60 + i, 61], twin) for i in range(3)])
    poisoned = [unique_id("p") for _ in range(3)]
    executor = PoisonedExecutor(core.executor, set(poisoned), when="after", after=1)
    restore = _with_executor(core, executor)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got, results = _run(core, [(rid, [60 + i, 61], params) for i, rid in enumerate(poisoned)])
    finally:
        restore()
    print(f"\n[3 poisoned] executor calls={executor.calls} raised={executor.raised}")
    assert all(results[rid].finish_reason == FinishReason.ERROR for rid in poisoned)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


@pytest.mark.parametrize("case", ["only_together", "always"])
def test_a_failure_no_request_explains_stays_fatal(case: str) -> None:
    """Fails with every part alone (a broken worker) or with none alone (the batch): the step raises."""
    core = tiny_engine_core(enable_prefix_caching=False)
    try:
        if case == "only_together":
            fails: Callable[[SchedulerOutput], bool] = lambda so: len(so.num_scheduled_tokens) > 1  # noqa: E731
        else:
            fails = lambda so: True  # noqa: E731
        core.executor = FailingExecutor(core.executor, fails)  # type: ignore[assignment]
        for i in range(3):
            core.add_request(make_request(unique_id("f"), [5 + i, 6, 7]))
        with pytest.raises(RuntimeError, match="the worker failed"):
            core.step()
    finally:
        core.shutdown()
