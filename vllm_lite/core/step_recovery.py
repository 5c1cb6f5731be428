"""After a step raised: find the request(s) that make it fail, so they alone end with an error.

Runs only on an exception, never on the hot path. The failed step's requests are
rewound to where the step started and re-run in halves (bisection) from a clean
worker state: each probe first drops every request of the step from the worker's
batch, then re-adds the probed ones in full (as after a preemption), so a probe
sees the same inputs whatever the failed attempt left half-done. A request that
fails alone is a culprit. When every request fails alone, a one-token canary
request decides between "these requests are poison" (the canary runs) and "the
worker is broken" (it fails too: fatal). A failure that no single request shows
(the batch fails, every part runs) cannot be pinned and stays fatal, as do
failures of a step that swapped blocks out (replaying a half-done swap would
corrupt the host copy) and worker deaths.

The good requests then run the step once more, together; their tokens are the
ones the step would have produced (seeded generators are rebuilt from the seed
and the number of tokens already drawn, exactly as after a preemption).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Protocol

from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler, new_request_data
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger("vllm_lite.engine_core")

_CANARY_ID = "__vllm_lite_step_recovery_canary__"
# Error text that reaches a frontend is cut to this many characters.
_MAX_ERROR_CHARS = 500


class StepExecutor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass
class RecoveredStep:
    """The step's output for the requests that run, and the ones that were finished with an error."""

    model_output: ModelRunnerOutput
    # request id -> (client index, error message) of each culprit, already finished in the scheduler.
    failed: dict[str, tuple[int, str]] = field(default_factory=dict)


class _Unpinnable(Exception):
    """The failure belongs to no request in particular: the step's error stays fatal."""


def recover_failed_step(
    scheduler: Scheduler, executor: StepExecutor, so: SchedulerOutput, error: BaseException, async_step: bool = False
) -> Optional[RecoveredStep]:
    """Pin `error` (raised by `executor.execute_model(so)`) to requests; None when it cannot be pinned.

    ``async_step``: the step ran next to another (async scheduling), so a request of it may have finished or been
    preempted since it was scheduled; such requests are left out (a synchronous step's all still run, else None).

    On success the culprits are finished (FINISHED_ERROR, blocks freed) and the returned model
    output answers `so` for every other request, ready for `scheduler.update_from_output`.
    """
    if not _replayable(so, error):
        return None
    step: dict[str, tuple[Request, int]] = {}
    for rid, n in so.num_scheduled_tokens.items():
        req = scheduler.get_request(rid)
        if req is None or req.status != RequestStatus.RUNNING:
            if not async_step:
                return None
            # Async scheduling: finished by the step before, or preempted by the one after; the step owes it
            # nothing (the probes drop it from the worker).
            continue
        step[rid] = (req, n)
    for req, n in step.values():  # back to where the step started; the worker's progress is discarded
        req.num_computed_tokens -= n
    rewound = True
    try:
        prober = _Prober(scheduler, executor, so, step)
        # A step with requests left out (async scheduling) failed maybe only for them: its error proves nothing
        # about the rest, which are probed afresh; if they all run, the step is recovered with no culprit.
        left_out = len(step) < len(so.num_scheduled_tokens)
        culprits = prober.find_culprits(list(step), None if left_out else error) if step else {}
        if not culprits and not left_out:
            logger.error("A step failed, but every part of it runs alone: the failure is not one request's.")
            return None
        if culprits and len(culprits) == len(step) and not prober.canary_runs(set(culprits)):
            logger.error("A step failed, and so does a plain one-token request: the worker is broken.")
            return None
        failed: dict[str, tuple[int, str]] = {}
        for rid, exc in culprits.items():
            req = step[rid][0]
            message = f"the request failed inside an engine step and was dropped ({type(exc).__name__}: {exc})"
            failed[rid] = (req.client_index, message[:_MAX_ERROR_CHARS])
            logger.error("Request %r failed inside an engine step; finishing it with an error.", rid, exc_info=exc)
        scheduler.finish_requests(list(culprits), RequestStatus.FINISHED_ERROR)
        good = [rid for rid in step if rid not in culprits]
        model_output = prober.run(good)
        if model_output is None:
            logger.error("A step failed, and its requests that ran alone fail together once the culprits are out.")
            return None
        for rid in good:
            req, n = step[rid]
            req.num_computed_tokens += n
        rewound = False
        return RecoveredStep(model_output, failed)
    except _Unpinnable:
        return None
    finally:
        if rewound:  # fatal: leave the scheduler as the failed step had it
            for req, n in step.values():
                req.num_computed_tokens += n


def _replayable(so: SchedulerOutput, error: BaseException) -> bool:
    """A step can be re-run only if re-running cannot corrupt state and the worker is still there."""
    if so.blocks_to_swap_out or so.blocks_to_copy:
        logger.error("A step that moved KV blocks failed; it cannot be replayed to find a culprit.")
        return False
    return not _worker_died(error)


def _worker_died(error: BaseException) -> bool:
    # Imported here: only a failure ever needs it, and the single-process path never loads it otherwise.
    from vllm_lite.worker.multiproc_executor import WorkerDiedError

    return isinstance(error, WorkerDiedError)


class _Prober:
    """Re-runs subsets of a failed step, each from a clean slate in the worker's batch."""

    def __init__(
        self, scheduler: Scheduler, executor: StepExecutor, so: SchedulerOutput, step: dict[str, tuple[Request, int]]
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.so = so
        self.step = step
        # Everything the worker may hold from this step (or was told to drop in it).
        self.drop: set[str] = set(so.finished_req_ids) | set(so.num_scheduled_tokens)

    def find_culprits(self, ids: list[str], known_error: Optional[BaseException]) -> dict[str, BaseException]:
        """Bisect: the requests of `ids` that fail alone, with the error each raised."""
        error = known_error if known_error is not None else self.try_run(ids)
        if error is None:
            return {}
        if len(ids) == 1:
            return {ids[0]: error}
        mid = len(ids) // 2
        return {**self.find_culprits(ids[:mid], None), **self.find_culprits(ids[mid:], None)}

    def try_run(self, ids: list[str]) -> Optional[BaseException]:
        """The error a probe of `ids` raises, or None when it runs."""
        try:
            self.executor.execute_model(self._probe_output(ids))
        except Exception as e:  # noqa: BLE001 -- a probe's failure is data, not the end
            if _worker_died(e):
                raise _Unpinnable from e
            return e
        return None

    def run(self, ids: list[str]) -> Optional[ModelRunnerOutput]:
        """The step for `ids` alone (also drops every other request of the step from the worker)."""
        try:
            return self.executor.execute_model(self._probe_output(ids))
        except Exception:  # noqa: BLE001 -- the caller turns this into the step's fatal error
            logger.exception("Re-running the step's good requests failed.")
            return None

    def canary_runs(self, freed: set[str]) -> bool:
        """Does a plain one-token greedy request run? Borrows a block freed by finishing `freed` first."""
        self.scheduler.finish_requests(list(freed), RequestStatus.FINISHED_ERROR)
        kv = self.scheduler.kv_cache_manager
        canary = Request(_CANARY_ID, [0], SamplingParams(temperature=0.0, max_tokens=1), None, 0.0)
        if kv.allocate_slots(canary, 1) is None:
            return False
        self.drop.add(_CANARY_ID)
        new = NewRequestData(_CANARY_ID, [0], [], canary.sampling_params, kv.get_block_ids(_CANARY_ID), 0)
        try:
            self.executor.execute_model(SchedulerOutput([new], CachedRequestData(), {_CANARY_ID: 1}, 1, set(self.drop)))
        except Exception as e:  # noqa: BLE001 -- the answer is "no"
            logger.error("The canary request failed too: %s: %s", type(e).__name__, e)
            return False
        finally:
            kv.free(canary)
        return True

    def _probe_output(self, ids: list[str]) -> SchedulerOutput:
        kv = self.scheduler.kv_cache_manager
        # The same worker copy the scheduler sends: a pooling request keeps its params and token-type boundary.
        new_reqs = [new_request_data(self.step[rid][0], kv.get_block_ids(rid)) for rid in ids]
        scheduled = {rid: self.step[rid][1] for rid in ids}
        # Swap-ins are idempotent (host blocks are not reused during recovery); swap-outs never get here.
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=set(self.drop),
            blocks_to_swap_in=list(self.so.blocks_to_swap_in) if ids else [],
            # The same tokens are sampled again, under the same grammar masks (the matchers have not moved).
            structured_output_request_ids={r: i for r, i in self.so.structured_output_request_ids.items() if r in ids},
            grammar_bitmask=self.so.grammar_bitmask,
            scheduled_spec_decode_tokens={r: d for r, d in self.so.scheduled_spec_decode_tokens.items() if r in ids},
        )
