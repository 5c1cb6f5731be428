"""Step recovery, unit by unit: which requests a failed step is pinned on, what each probe sends the worker,
and when the failure must stay fatal (no model: a real Scheduler and KV cache, a FakeExecutor).

Each test schedules one step, lets the executor fail it, then calls `recover_failed_step` as the engine core
does, and checks the scheduler's state and the probes the worker saw.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import pytest

from vllm_lite.core.messages import FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.core.step_recovery import RecoveredStep, recover_failed_step
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.fake_executor import FakeExecutor, fake_next_token
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.multiproc_executor import WorkerDiedError
from vllm_lite.worker.step import SchedulerOutput

CANARY = "__vllm_lite_step_recovery_canary__"
PREFIX = "the request failed inside an engine step and was dropped"
_arrivals = itertools.count()
FailWhen = Callable[[SchedulerOutput], Optional[BaseException]]


def request(rid: str, prompt: list[int], client_index: int = 0, max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, None, float(next(_arrivals)), client_index=client_index)


PROMPTS = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9], "d": [10, 11, 12]}


def setup(rids: list[str], fail_when: Optional[FailWhen] = None, **config: Any) -> tuple[Scheduler, FakeExecutor]:
    cfg = make_config(**config)
    sched = Scheduler(cfg)
    executor = FakeExecutor(cfg, fail_when=fail_when)
    for i, rid in enumerate(rids):
        sched.add_request(request(rid, PROMPTS[rid], client_index=i))
    return sched, executor


def failing_step(sched: Scheduler, executor: FakeExecutor) -> tuple[SchedulerOutput, BaseException]:
    """Schedule a step and run it; it must fail. Returns the step and its error."""
    so = sched.schedule()
    with pytest.raises(Exception) as e:
        executor.execute_model(so)
    return so, e.value


def fails_if_in(*bad: str, together: Optional[set[str]] = None) -> FailWhen:
    """Fails a step holding any of `bad` (with an error naming it), or holding exactly `together`."""

    def fail_when(so: SchedulerOutput) -> Optional[BaseException]:
        ids = set(so.num_scheduled_tokens)
        for rid in bad:
            if rid in ids:
                return RuntimeError(f"bad {rid}")
        if together is not None and ids == together:
            return RuntimeError("together")
        return None

    return fail_when


def computed(sched: Scheduler, *rids: str) -> list[int]:
    return [sched.get_request(r).num_computed_tokens for r in rids]


def probes(executor: FakeExecutor, first: int) -> list[SchedulerOutput]:
    """The steps the worker saw from index `first` on (the failed step is index first - 1)."""
    return executor.steps[first:]


# ---------------------------------------------------------------------- pinned
def test_a_request_failing_alone_is_finished_with_its_error_and_the_others_get_the_steps_tokens() -> None:
    sched, ex = setup(["a", "b", "c"], fails_if_in("b"))
    so, error = failing_step(sched, ex)
    reqs = {r: sched.get_request(r) for r in "abc"}
    after_step = computed(sched, "a", "b", "c")
    assert after_step == [3, 4, 2]
    rec = recover_failed_step(sched, ex, so, error)
    assert isinstance(rec, RecoveredStep)
    assert rec.failed == {"b": (1, f"{PREFIX} (RuntimeError: bad b)")}
    assert reqs["b"].status == RequestStatus.FINISHED_ERROR and sched.get_request("b") is None
    mro = rec.model_output
    assert mro.req_ids == ["a", "c"]
    assert mro.sampled_token_ids == [[fake_next_token(PROMPTS["a"])], [fake_next_token(PROMPTS["c"])]]
    assert computed(sched, "a", "c") == [3, 2]  # the good requests keep the step's progress
    outs = sched.update_from_output(so, mro)
    got = {o.request_id: o.new_token_ids for batch in outs.values() for o in batch.outputs}
    assert got == {"a": mro.sampled_token_ids[0], "c": mro.sampled_token_ids[1]}
    # The worker's batch is consistent again: the next steps run and the tokens follow the model's rule.
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, ex.execute_model(so))
    for rid in "ac":
        tokens = list(PROMPTS[rid])
        for _ in range(4):
            tokens.append(fake_next_token(tokens))
        assert reqs[rid].output_token_ids == tokens[len(PROMPTS[rid]) :]
    assert sched.num_free_blocks == sched.num_total_blocks


def test_every_probe_starts_from_a_clean_batch_with_the_requests_sent_in_full() -> None:
    sched, ex = setup(["a", "b", "c"])
    so = sched.schedule()
    sched.update_from_output(so, ex.execute_model(so))  # a first step runs: every request has one output
    ex.fail_when = fails_if_in("b")
    so, error = failing_step(sched, ex)
    assert all(v == 1 for v in so.num_scheduled_tokens.values())
    so.finished_req_ids = {"gone"}
    before_recovery = computed(sched, "a", "b", "c")
    reqs = {r: sched.get_request(r) for r in "abc"}
    blocks = {r: list(sched.kv_cache_manager.get_block_ids(r)) for r in "abc"}
    n_seen = len(ex.steps)
    rec = recover_failed_step(sched, ex, so, error)
    assert rec is not None
    seen = probes(ex, n_seen)
    assert len(seen) >= 3
    for probe in seen:
        assert probe.finished_req_ids >= {"a", "b", "c", "gone"}
        assert probe.scheduled_cached_reqs.req_ids == []
        assert probe.num_scheduled_tokens == {r.req_id: 1 for r in probe.scheduled_new_reqs}
        assert probe.total_num_scheduled_tokens == len(probe.scheduled_new_reqs)
        for new in probe.scheduled_new_reqs:
            req = reqs[new.req_id]
            assert new.prompt_token_ids == PROMPTS[new.req_id]
            assert new.output_token_ids == req.output_token_ids
            # Rewound to where the step started: the step's token is run again.
            assert new.num_computed_tokens == len(PROMPTS[new.req_id])
            assert new.block_ids == blocks[new.req_id] != []
            assert new.sampling_params is req.sampling_params
    # The last probe is the good requests' replay, together.
    assert [n.req_id for n in seen[-1].scheduled_new_reqs] == ["a", "c"]
    assert computed(sched, "a", "c") == [before_recovery[0], before_recovery[2]]


def test_bisection_pins_each_failing_request_on_its_own_error() -> None:
    sched, ex = setup(["a", "b", "c", "d"], fails_if_in("b", "d"))
    so, error = failing_step(sched, ex)
    rec = recover_failed_step(sched, ex, so, error)
    assert rec is not None
    assert rec.failed == {
        "b": (1, f"{PREFIX} (RuntimeError: bad b)"),
        "d": (3, f"{PREFIX} (RuntimeError: bad d)"),
    }
    assert rec.model_output.req_ids == ["a", "c"]
    # One probe per half, per quarter, and the replay: the failed step's own error is not re-probed.
    assert [sorted(p.num_scheduled_tokens) for p in probes(ex, 1)] == [
        ["a", "b"],
        ["a"],
        ["b"],
        ["c", "d"],
        ["c"],
        ["d"],
        ["a", "c"],
    ]


def test_the_error_text_sent_to_a_frontend_is_cut_to_500_characters() -> None:
    long = "x" * 2000
    sched, ex = setup(["a", "b"], lambda so: ValueError(long) if "a" in so.num_scheduled_tokens else None)
    so, error = failing_step(sched, ex)
    rec = recover_failed_step(sched, ex, so, error)
    assert rec is not None
    message = rec.failed["a"][1]
    assert len(message) == 500
    assert message.startswith(f"{PREFIX} (ValueError: xxx")


def test_probes_carry_the_steps_swap_ins_and_grammar_rows_of_their_own_requests() -> None:
    sched, ex = setup(["a", "b", "c"], fails_if_in("b"))
    so, error = failing_step(sched, ex)
    bitmask = object()
    so.blocks_to_swap_in = [(1, 2)]
    so.structured_output_request_ids = {"a": 0, "b": 1, "c": 2}
    so.grammar_bitmask = bitmask
    assert recover_failed_step(sched, ex, so, error) is not None
    for probe in probes(ex, 1):
        ids = set(probe.num_scheduled_tokens)
        assert probe.blocks_to_swap_in == [(1, 2)]
        assert probe.blocks_to_swap_in is not so.blocks_to_swap_in
        assert probe.structured_output_request_ids == {
            r: i for r, i in so.structured_output_request_ids.items() if r in ids
        }
        assert probe.grammar_bitmask is bitmask


# ---------------------------------------------------------------------- the canary
def test_a_lone_failing_request_is_pinned_once_a_one_token_canary_runs() -> None:
    sched, ex = setup(["a"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    rec = recover_failed_step(sched, ex, so, error)
    assert rec is not None
    assert set(rec.failed) == {"a"}
    assert rec.model_output.req_ids == []
    canary_step, replay = probes(ex, 1)
    (new,) = canary_step.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.output_token_ids, new.num_computed_tokens) == (CANARY, [0], [], 0)
    assert new.sampling_params.temperature == 0.0 and new.sampling_params.max_tokens == 1
    assert len(new.block_ids) == 1
    assert canary_step.num_scheduled_tokens == {CANARY: 1} and canary_step.total_num_scheduled_tokens == 1
    assert canary_step.finished_req_ids >= {"a"}
    # The replay of the (no) good requests also drops the canary from the worker's batch, and moves no blocks.
    assert replay.num_scheduled_tokens == {} and replay.total_num_scheduled_tokens == 0
    assert replay.finished_req_ids >= {"a", CANARY}
    assert replay.blocks_to_swap_in == []
    assert CANARY not in ex.batch and "a" not in ex.batch
    assert sched.num_free_blocks == sched.num_total_blocks  # the canary's block is back
    assert sched.get_request(CANARY) is None


def test_when_the_canary_fails_too_the_worker_is_broken_and_the_step_stays_fatal(caplog) -> None:
    sched, ex = setup(["a", "b"], lambda so: RuntimeError("device lost") if so.num_scheduled_tokens else None)
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is None
    assert "the worker is broken" in caplog.text
    assert sched.num_free_blocks == sched.num_total_blocks  # the canary's block is given back


def test_with_no_room_for_the_canary_the_step_stays_fatal(monkeypatch) -> None:
    sched, ex = setup(["a"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    monkeypatch.setattr(sched.kv_cache_manager, "allocate_slots", lambda *args, **kwargs: None)
    assert recover_failed_step(sched, ex, so, error) is None
    assert all(CANARY not in p.num_scheduled_tokens for p in ex.steps)


# ---------------------------------------------------------------------- fatal
def test_a_failure_only_the_whole_batch_shows_is_fatal_and_leaves_the_step_as_it_was(caplog) -> None:
    sched, ex = setup(["a", "b", "c"], fails_if_in(together={"a", "b", "c"}))
    so, error = failing_step(sched, ex)
    after_step = computed(sched, "a", "b", "c")
    assert recover_failed_step(sched, ex, so, error) is None
    assert "not one request's" in caplog.text
    assert computed(sched, "a", "b", "c") == after_step
    assert all(sched.get_request(r).status == RequestStatus.RUNNING for r in "abc")


def test_good_requests_that_fail_together_once_the_culprit_is_out_keep_the_step_fatal(caplog) -> None:
    sched, ex = setup(["a", "b", "c"], fails_if_in("b", together={"a", "c"}))
    so, error = failing_step(sched, ex)
    after_step = computed(sched, "a", "b", "c")
    assert recover_failed_step(sched, ex, so, error) is None
    assert "fail together once the culprits are out" in caplog.text
    assert computed(sched, "a", "c") == [after_step[0], after_step[2]]


@pytest.mark.parametrize("move", ["blocks_to_swap_out", "blocks_to_copy"])
def test_a_step_that_moved_kv_blocks_is_never_replayed(move: str) -> None:
    sched, ex = setup(["a", "b"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    setattr(so, move, [(0, 1)])
    assert recover_failed_step(sched, ex, so, error) is None
    assert len(ex.steps) == 1
    assert computed(sched, "a", "b") == [3, 4]


def test_a_dead_worker_is_fatal_whether_it_died_in_the_step_or_in_a_probe() -> None:
    sched, ex = setup(["a", "b"], fails_if_in("a"))
    so, _ = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, WorkerDiedError("rank 1 died")) is None
    assert len(ex.steps) == 1
    ex.fail_when = lambda so: WorkerDiedError("rank 1 died in a probe")
    assert recover_failed_step(sched, ex, so, RuntimeError("first")) is None
    assert len(ex.steps) == 2  # the first probe found the dead worker: no more probes
    assert computed(sched, "a", "b") == [3, 4]
    assert all(sched.get_request(r).status == RequestStatus.RUNNING for r in "ab")


def test_a_step_whose_request_is_no_longer_in_the_scheduler_is_not_replayed() -> None:
    sched, ex = setup(["a", "b"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert recover_failed_step(sched, ex, so, error) is None
    assert len(ex.steps) == 1
    assert computed(sched, "a") == [3]


def test_an_error_outputs_finish_reason_is_error() -> None:
    sched, ex = setup(["a", "b"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    req = sched.get_request("a")
    assert recover_failed_step(sched, ex, so, error) is not None
    assert req.get_finish_reason() == FinishReason.ERROR


# ---------------------------------------------------------------------- what operators read
def _errors(caplog) -> list[tuple[str, Optional[str]]]:
    """(message, the logged exception's text or None) of each error line of the engine core's logger."""
    return [
        (r.getMessage(), str(r.exc_info[1]) if r.exc_info else None)
        for r in caplog.records
        if r.name == "vllm_lite.engine_core" and r.levelname == "ERROR"
    ]


def test_each_outcome_logs_one_line_that_says_what_happened(caplog) -> None:
    sched, ex = setup(["a", "b"], fails_if_in("a"))
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is not None
    assert _errors(caplog) == [("Request 'a' failed inside an engine step; finishing it with an error.", "bad a")]
    caplog.clear()
    sched, ex = setup(["a", "b"], fails_if_in(together={"a", "b"}))
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is None
    assert _errors(caplog) == [
        ("A step failed, but every part of it runs alone: the failure is not one request's.", None)
    ]
    caplog.clear()
    so.blocks_to_copy = [(0, 1)]
    assert recover_failed_step(sched, ex, so, error) is None
    assert _errors(caplog) == [("A step that moved KV blocks failed; it cannot be replayed to find a culprit.", None)]
    caplog.clear()
    sched, ex = setup(["a"], lambda so: ValueError("no device") if so.num_scheduled_tokens else None)
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is None
    assert _errors(caplog)[-2:] == [
        ("The canary request failed too: ValueError: no device", None),
        ("A step failed, and so does a plain one-token request: the worker is broken.", None),
    ]
    caplog.clear()
    sched, ex = setup(["a", "b", "c"], fails_if_in("b", together={"a", "c"}))
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is None
    assert _errors(caplog)[-2:] == [
        ("Re-running the step's good requests failed.", "together"),
        ("A step failed, and its requests that ran alone fail together once the culprits are out.", None),
    ]


def test_probes_keep_each_requests_eos_id_and_the_canary_takes_one_slot() -> None:
    cfg = make_config(block_size=1)
    sched = Scheduler(cfg)
    ex = FakeExecutor(cfg, fail_when=fails_if_in("a"))
    sched.add_request(Request("a", [1, 2], SamplingParams(max_tokens=2), 9, 0.0))
    sched.add_request(Request("b", [3, 4], SamplingParams(max_tokens=2), 11, 1.0))
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is not None
    b_probes = [new for p in probes(ex, 1) for new in p.scheduled_new_reqs if new.req_id == "b"]
    assert len(b_probes) == 2 and all(new.eos_token_id == 11 for new in b_probes)
    # A lone culprit: the canary asks for one slot (one block of one token), and the empty replay moves nothing.
    sched, ex = setup(["a"], fails_if_in("a"), block_size=1)
    so, error = failing_step(sched, ex)
    so.blocks_to_swap_in = [(3, 4)]
    assert recover_failed_step(sched, ex, so, error) is not None
    canary, replay = probes(ex, 1)
    assert len(canary.scheduled_new_reqs[0].block_ids) == 1
    assert replay.blocks_to_swap_in == []


def test_a_fatal_failure_in_a_later_step_leaves_each_requests_progress_as_the_step_had_it() -> None:
    sched, ex = setup(["a", "b"])
    so = sched.schedule()
    sched.update_from_output(so, ex.execute_model(so))
    ex.fail_when = fails_if_in(together={"a", "b"})
    so, error = failing_step(sched, ex)
    after_step = computed(sched, "a", "b")
    assert after_step == [4, 5]
    assert recover_failed_step(sched, ex, so, error) is None
    assert computed(sched, "a", "b") == after_step


def test_probes_send_a_pooling_request_with_its_pooling_params_and_token_type_boundary() -> None:
    cfg = make_config()
    sched = Scheduler(cfg)
    ex = FakeExecutor(cfg, fail_when=fails_if_in("p"))
    sched.add_request(request("a", PROMPTS["a"]))
    pooled = Request(
        "p", [5, 6, 7, 8], None, None, 1.0, pooling_params=PoolingParams(task="embed"), compressed_token_type_ids=2
    )
    sched.add_request(pooled)
    so, error = failing_step(sched, ex)
    assert recover_failed_step(sched, ex, so, error) is not None
    p_rows = [new for probe in probes(ex, 1) for new in probe.scheduled_new_reqs if new.req_id == "p"]
    assert p_rows, "the failing pooling request was never probed"
    for new in p_rows:
        assert new.pooling_params is pooled.pooling_params
        assert new.compressed_token_type_ids == 2
