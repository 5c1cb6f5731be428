"""Async scheduling (vLLM's `async_scheduling`, issue #14): the engine core schedules and launches step N+1 while
step N runs, and gets exactly the tokens of the synchronous path.

Model-free: a real Scheduler and EngineCore over `PagedFakeExecutor`, whose "model" reads each request's whole
context back from a paged cache of token ids and hashes it, and whose async step takes its input token from its
own record of what it sampled (never from the scheduler). Every workload runs twice, synchronously and with
async scheduling, and both are checked against tokens computed with no engine at all.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_lite.config import SpeculativeConfig, verify_async_scheduling
from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import EngineCoreRequest, FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.core_harness import assert_no_leak
from vllm_lite.testing.hypothesis_profiles import max_examples
from vllm_lite.testing.paged_fake_executor import PagedFakeExecutor, paged_next_token, reference_tokens
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.step import SchedulerOutput

VOCAB = 64


# ---------------------------------------------------------------------- driver
@dataclass
class Spec:
    """One request of a workload: when it arrives (step() call), what it asks for, when (if) it is aborted."""

    rid: str
    prompt: list[int]
    max_tokens: int
    arrive: int = 0
    priority: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    abort_at: Optional[int] = None

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
            min_tokens=self.min_tokens,
        )


@dataclass
class Got:
    tokens: list[int] = field(default_factory=list)
    finish: Optional[str] = None
    stop_reason: Any = None
    error: Optional[str] = None


@dataclass
class Run:
    results: dict[str, Got]
    core: EngineCore
    executor: PagedFakeExecutor
    requests: dict[str, Request]  # the scheduler's request objects, kept past their end
    steps: list[SchedulerOutput]


def make_core(async_scheduling: bool, executor_kw: Optional[dict] = None, **config: Any) -> EngineCore:
    cfg = make_config(**config)
    cfg.scheduler_config.async_scheduling = async_scheduling
    return EngineCore(cfg, lambda c: PagedFakeExecutor(c, vocab=VOCAB, **(executor_kw or {})))


def record_steps(core: EngineCore) -> list[SchedulerOutput]:
    """Every SchedulerOutput the scheduler hands out, in order."""
    steps: list[SchedulerOutput] = []
    schedule = core.scheduler.schedule

    def recording() -> SchedulerOutput:
        so = schedule()
        steps.append(so)
        return so

    core.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


def run(
    specs: list[Spec],
    async_scheduling: bool,
    eos: Optional[int],
    executor_kw: Optional[dict] = None,
    max_calls: int = 3000,
    **config: Any,
) -> Run:
    core = make_core(async_scheduling, executor_kw, **config)
    steps = record_steps(core)
    executor = core.executor
    results: dict[str, Got] = {}
    requests: dict[str, Request] = {}
    call = 0
    while call <= max(s.arrive for s in specs) or core.has_unfinished_requests():
        assert call < max_calls, "the core does not drain"
        for s in specs:
            if s.arrive == call:
                core.add_request(EngineCoreRequest(s.rid, s.prompt, s.params(), eos, 0.0, priority=s.priority))
                requests[s.rid] = core.scheduler.get_request(s.rid)
            if s.abort_at == call:
                core.abort_requests([s.rid])
        outputs = core.step() if core.has_unfinished_requests() else {}
        for batch in outputs.values():
            for out in batch.outputs:
                got = results.setdefault(out.request_id, Got())
                assert got.finish is None, f"{out.request_id!r} got an output after it finished"
                got.tokens.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    got.finish = str(out.finish_reason)
                    got.stop_reason = out.stop_reason
                    got.error = out.error
        assert core.scheduler.num_steps_in_flight == len(core.batch_queue) <= 2
        for r in core.scheduler.requests.values():
            assert 0 <= r.num_output_placeholders <= len(core.batch_queue)
        call += 1
    return Run(results, core, executor, requests, steps)


def check_drained(r: Run) -> None:
    assert_no_leak(r.core)
    assert not r.core.batch_queue and not r.executor.unread
    assert all(req.num_output_placeholders == 0 for req in r.requests.values())
    assert r.core.max_steps_in_flight_seen <= 2 and r.executor.max_unread_seen <= 2


def expected(s: Spec, eos: Optional[int], max_model_len: int) -> tuple[list[int], str, Optional[int]]:
    return reference_tokens(
        s.prompt, s.max_tokens, max_model_len, eos, s.ignore_eos, s.stop_token_ids, s.min_tokens, VOCAB
    )


def compare(specs: list[Spec], sync: Run, asyn: Run, eos: Optional[int]) -> None:
    """Tokens, finish reason and stop reason: async == sync == the engine-free reference (an aborted request:
    a prefix of its reference, in both)."""
    cap = sync.core.scheduler.max_model_len
    assert asyn.core.scheduler.max_model_len == cap
    for s in specs:
        ref, reason, stop_reason = expected(s, eos, cap)
        a, b = sync.results.get(s.rid, Got()), asyn.results.get(s.rid, Got())
        if s.abort_at is not None and s.abort_at >= s.arrive:
            for got in (a, b):
                assert got.tokens == ref[: len(got.tokens)], s.rid
                assert got.finish in (None, reason)
            continue
        assert (b.tokens, b.finish, b.stop_reason) == (a.tokens, a.finish, a.stop_reason), s.rid
        assert (a.tokens, a.finish, a.stop_reason) == (ref, reason, stop_reason), s.rid


def prompt_of(family: int, length: int, tail: int) -> list[int]:
    """Requests of one family share a prefix; `tail` (0: none) makes the last token differ."""
    p = [(family * 13 + i * 5 + 1) % VOCAB for i in range(length)]
    if tail:
        p[-1] = (p[-1] + tail) % VOCAB
    return p


# ---------------------------------------------------------------------- the property
request_specs = st.lists(
    st.fixed_dictionaries(
        {
            "arrive": st.integers(0, 10),
            "len": st.integers(1, 20),
            "family": st.integers(0, 3),
            "tail": st.integers(0, 2),
            "max_tokens": st.integers(1, 16),
            "priority": st.integers(0, 2),
            "ignore_eos": st.booleans(),
            "stop": st.sampled_from([(), (), (5,), (11, 40)]),
            "min_tokens": st.sampled_from([0, 0, 2]),
            "abort_at": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 25)),
        }
    ),
    min_size=1,
    max_size=7,
)

workloads = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "num_blocks": st.one_of(st.integers(3, 10), st.integers(3, 30)),
        "budget": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 6),
        "threshold": st.sampled_from([0, 0, 3]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "mode": st.sampled_from(["recompute", "swap"]),
        "cpu_blocks": st.integers(0, 16),
        "prefix": st.booleans(),
        "max_model_len": st.integers(6, 40),
        "eos": st.one_of(st.none(), st.integers(0, VOCAB - 1)),
        "requests": request_specs,
    }
)


def build(w: dict) -> tuple[list[Spec], dict[str, Any]]:
    config = dict(
        num_gpu_blocks=w["num_blocks"] + 1,
        block_size=w["block_size"],
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        max_model_len=w["max_model_len"],
        policy=w["policy"],
        preemption_mode=w["mode"],
        enable_prefix_caching=w["prefix"],
        num_cpu_blocks=w["cpu_blocks"],
        long_prefill_token_threshold=w["threshold"],
    )
    cap = min(w["max_model_len"], w["num_blocks"] * w["block_size"])
    specs = []
    for i, r in enumerate(w["requests"]):
        length = max(1, min(r["len"], cap - 1))
        specs.append(
            Spec(
                rid=f"r{i}",
                prompt=prompt_of(r["family"], length, r["tail"]),
                max_tokens=r["max_tokens"],
                arrive=r["arrive"],
                priority=r["priority"],
                ignore_eos=r["ignore_eos"],
                stop_token_ids=r["stop"],
                min_tokens=min(r["min_tokens"], r["max_tokens"]),
                abort_at=r["abort_at"],
            )
        )
    return specs, config


@settings(max_examples=max_examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_async_scheduling_gives_the_synchronous_tokens_and_drains_clean(w: dict) -> None:
    specs, config = build(w)
    eos = w["eos"]
    if min(config["max_model_len"], w["num_blocks"] * w["block_size"]) < 2:
        return
    sync = run(specs, False, eos, **config)
    asyn = run(specs, True, eos, **config)
    compare(specs, sync, asyn, eos)
    check_drained(sync)
    check_drained(asyn)
    assert sync.executor.num_async_steps == 0
    assert (asyn.executor.num_async_steps > 0) == (sync.executor.num_steps > 0)
    if asyn.executor.max_unread_seen == 2:
        event("two steps in flight")
    if any(so.blocks_to_swap_out for so in asyn.steps):
        event("swap out")
    if any(nr.num_computed_tokens and not nr.output_token_ids for so in asyn.steps for nr in so.scheduled_new_reqs):
        event("prefix cache hit")
    if any(r.num_preemptions for r in asyn.requests.values()):
        event("preemption")
    if any(g.finish == "stop" for g in asyn.results.values()):
        event("stopped (eos / stop token)")


# ---------------------------------------------------------------------- how a placeholder appears to the runner
def decode_specs(n: int = 2, max_tokens: int = 5) -> list[Spec]:
    return [Spec(f"d{i}", prompt_of(i, 3 + i, 0), max_tokens, ignore_eos=True) for i in range(n)]


def test_a_request_whose_last_token_is_in_flight_is_scheduled_as_a_cached_one_token_step_at_its_position() -> None:
    r = run(decode_specs(), True, None)
    seen_placeholder = 0
    position = {s.rid: len(s.prompt) for s in decode_specs()}  # of each request's first sampled token
    for so in r.steps:
        new = {nr.req_id: nr for nr in so.scheduled_new_reqs}
        for nr in new.values():  # a request joins with its known tokens only
            assert nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id] <= len(nr.prompt_token_ids) + len(
                nr.output_token_ids
            )
        c = so.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            assert so.num_scheduled_tokens[rid] == 1 and computed == position[rid]
            position[rid] += 1
            seen_placeholder += 1
    # Steps after the prefill: every decode is a cached request at its placeholder's position.
    assert seen_placeholder == sum(s.max_tokens - 1 for s in decode_specs())
    compare(decode_specs(), run(decode_specs(), False, None), r, None)
    check_drained(r)


def test_the_placeholder_position_is_the_one_the_device_sampled_into() -> None:
    """Step N+1 schedules each decode at num_computed_tokens == the index of step N's (unknown) token."""
    core = make_core(True)
    steps = record_steps(core)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), None, 0.0))
    req = core.scheduler.get_request("a")
    assert core.step() == {}  # the pipeline starts: step 1 launched, nothing to read yet
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == 3
    out = core.step()  # step 2 launched on step 1's token, then step 1 read
    so2 = steps[1]
    assert so2.scheduled_cached_reqs.req_ids == ["a"] and so2.scheduled_cached_reqs.num_computed_tokens == [3]
    assert so2.num_scheduled_tokens == {"a": 1} and not so2.scheduled_new_reqs
    assert out[0].outputs[0].new_token_ids == [paged_next_token([1, 2, 3], VOCAB)]
    assert req.num_output_placeholders == 1  # step 2's token
    assert req.num_computed_tokens == 4 and req.num_tokens == 4


def test_max_tokens_requests_leave_the_batch_at_the_synchronous_step() -> None:
    """No step runs past max_tokens or max_model_len counting tokens in flight: each request is scheduled in
    exactly as many steps as without async scheduling (no wasted row)."""
    specs = decode_specs(3, 6) + [Spec("long", prompt_of(5, 8, 0), 100, ignore_eos=True)]

    def rows(r: Run) -> dict[str, int]:
        counts: dict[str, int] = {}
        for so in r.steps:
            for rid in so.num_scheduled_tokens:
                counts[rid] = counts.get(rid, 0) + 1
        return counts

    sync, asyn = run(specs, False, None, max_model_len=16), run(specs, True, None, max_model_len=16)
    compare(specs, sync, asyn, None)
    assert rows(asyn) == rows(sync)
    assert asyn.results["long"].finish == "length" and len(asyn.results["long"].tokens) == 16 - 8


def test_a_request_ended_by_eos_is_in_the_next_step_whose_token_for_it_is_dropped() -> None:
    prompt = prompt_of(1, 4, 0)
    eos = paged_next_token(prompt + [paged_next_token(prompt, VOCAB)], VOCAB)  # its second token
    specs = [Spec("e", prompt, 10), Spec("other", prompt_of(2, 4, 0), 6, ignore_eos=True)]
    asyn = run(specs, True, eos)
    sync = run(specs, False, eos)
    compare(specs, sync, asyn, eos)
    assert asyn.results["e"].tokens[-1] == eos and len(asyn.results["e"].tokens) == 2
    ran = [i for i, so in enumerate(asyn.steps) if "e" in so.num_scheduled_tokens]
    assert len(ran) == 3  # prefill, the step sampling EOS, and one more already scheduled when EOS came back
    assert "e" in asyn.steps[ran[-1] + 1].finished_req_ids
    assert len([so for so in sync.steps if "e" in so.num_scheduled_tokens]) == 2
    check_drained(asyn)


def test_an_id_reused_right_after_its_request_ended_gets_its_own_tokens() -> None:
    """The ended request's row is still in the step in flight; the new request with its id must not take that
    step's token (the scheduler checks the request object, the worker drops the old row and adds the new one)."""
    prompt = prompt_of(1, 4, 0)
    eos = paged_next_token(prompt, VOCAB)  # its first token ends it
    core = make_core(True)
    core.add_request(EngineCoreRequest("x", prompt, SamplingParams(max_tokens=8), eos, 0.0))
    core.add_request(
        EngineCoreRequest("keep", prompt_of(2, 3, 0), SamplingParams(max_tokens=8, ignore_eos=True), eos, 0.0)
    )
    got: list[tuple[list[int], Any]] = []
    readded = False
    while core.has_unfinished_requests():
        for batch in core.step().values():
            for o in batch.outputs:
                if o.request_id == "x":
                    got.append((list(o.new_token_ids), o.finish_reason))
                    if o.finish_reason is not None and not readded:
                        assert core.batch_queue  # the ended request's next step is in flight
                        core.add_request(EngineCoreRequest("x", [3, 4], SamplingParams(max_tokens=3), None, 0.0))
                        readded = True
    second, _, _ = reference_tokens([3, 4], 3, 256, None, vocab=VOCAB)
    assert got[0] == ([eos], FinishReason.STOP)
    assert [t for toks, _ in got[1:] for t in toks] == second and got[-1][1] == FinishReason.LENGTH
    assert_no_leak(core)


# ---------------------------------------------------------------------- when the core runs synchronously
def test_must_sync_covers_grammars_speculative_decoding_and_rope_recompute() -> None:
    s = Scheduler(make_config())
    assert not s.must_sync()
    s.add_request(Request("p", [1, 2], SamplingParams(max_tokens=2), None, 0.0))
    assert not s.must_sync()
    req = Request("g", [1, 2], SamplingParams(max_tokens=2), None, 0.0)
    req.structured_output_request = object()  # type: ignore[assignment] -- only its presence matters here
    s.add_request(req)
    assert s.must_sync()
    s.finish_requests("g", RequestStatus.FINISHED_ABORTED)  # the last constrained request leaves: async again
    assert not s.must_sync()
    cfg = make_config()
    cfg.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert Scheduler(cfg).must_sync()
    s = Scheduler(make_config())
    s.rope_recompute_at = 8
    assert s.must_sync()


def test_a_batch_that_must_sync_first_finishes_the_steps_in_flight_then_runs_synchronously(monkeypatch) -> None:
    specs = decode_specs(2, 8)
    core = make_core(True)
    for s in specs:
        core.add_request(EngineCoreRequest(s.rid, s.prompt, s.params(), None, 0.0))
    core.step()
    core.step()
    assert len(core.batch_queue) == 1
    monkeypatch.setattr(core.scheduler, "must_sync", lambda: True)
    before = core.executor.num_async_steps
    core.step()  # finishes the step in flight, launches nothing
    assert not core.batch_queue and core.executor.num_async_steps == before
    core.step()  # the plain synchronous step
    assert core.executor.num_async_steps == before and not core.executor.unread
    assert all(r.num_output_placeholders == 0 for r in core.scheduler.requests.values())
    monkeypatch.undo()
    while core.has_unfinished_requests():
        core.step()
    assert core.executor.num_async_steps > before  # overlapping again once allowed


def test_allow_overlap_false_drains_then_steps_synchronously() -> None:
    core = make_core(True)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    core.step()
    core.step()
    assert len(core.batch_queue) == 1
    core.step(allow_overlap=False)
    assert not core.batch_queue
    n = core.executor.num_async_steps
    core.step(allow_overlap=False)
    assert core.executor.num_async_steps == n and not core.batch_queue


def test_the_engine_process_steps_synchronously_while_a_request_awaits_stop_verdicts() -> None:
    from vllm_lite.core.engine_core_proc import EngineCoreProc

    calls: list[dict] = []
    core = type("Core", (), {"async_scheduling": True, "step": lambda self, **kw: calls.append(kw) or {}})()
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.engine_core = core
    proc._verdict_ids = set()
    proc._step()
    proc._verdict_ids = {"x"}
    proc._step()
    assert calls == [{}, {"allow_overlap": False}]
    core.async_scheduling = False
    proc._step()
    assert calls[-1] == {}  # a core without async scheduling (or another engine) is stepped as before


def test_the_sync_path_never_uses_the_non_blocking_call_nor_placeholders() -> None:
    r = run(decode_specs(3, 5), False, None)
    assert r.executor.num_async_steps == 0 and r.core.max_steps_in_flight_seen == 0
    assert all(not so.scheduled_cached_reqs.req_ids or True for so in r.steps)
    assert r.core.scheduler.num_steps_in_flight == 0


# ---------------------------------------------------------------------- drains: utilities, shutdown
def test_a_utility_call_drains_the_steps_in_flight_and_their_outputs_come_with_the_next_steps() -> None:
    specs = decode_specs(2, 6)
    core = make_core(True)
    for s in specs:
        core.add_request(EngineCoreRequest(s.rid, s.prompt, s.params(), None, 0.0))
    got: dict[str, list[int]] = {}

    def collect(outputs: dict) -> None:
        for batch in outputs.values():
            for o in batch.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)

    collect(core.step())
    collect(core.step())
    assert core.batch_queue
    core.call_utility("reset_prefix_cache", [])
    assert not core.batch_queue and not core.executor.unread
    assert core.call_utility("ping", []) is True
    while core.has_unfinished_requests():
        collect(core.step())
    assert got == {s.rid: expected(s, None, 256)[0] for s in specs}


def test_read_only_utilities_do_not_drain() -> None:
    core = make_core(True)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    core.step()
    for method in ("ping", "get_stats", "get_model_facts"):
        core.call_utility(method, [])
        assert len(core.batch_queue) == 1, method
    core.call_utility("get_num_free_blocks", [])
    assert not core.batch_queue


def test_shutdown_drains_the_steps_in_flight() -> None:
    core = make_core(True)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    core.step()
    core.step()
    core.shutdown()
    assert not core.batch_queue and not core.executor.unread and core.executor.shut_down


def test_an_abort_while_the_step_is_in_flight_drops_its_token_and_leaks_nothing() -> None:
    core = make_core(True)
    steps = record_steps(core)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    core.add_request(EngineCoreRequest("b", [4, 5], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0))
    core.step()
    core.step()
    req = core.scheduler.get_request("a")
    core.abort_requests(["a"])
    outs = core.step()
    assert all(o.request_id != "a" for b in outs.values() for o in b.outputs)
    while core.has_unfinished_requests():
        core.step()
    assert req.num_output_placeholders == 0
    assert any("a" in so.finished_req_ids for so in steps)
    assert_no_leak(core)


# ---------------------------------------------------------------------- failed steps
def fails_for(rid: str, after: int):
    """A step fails whenever it runs `rid` past position `after` (alone too: it is the culprit)."""

    def rule(so: SchedulerOutput) -> Optional[BaseException]:
        n = so.num_scheduled_tokens.get(rid)
        if n is None:
            return None
        computed = None
        for nr in so.scheduled_new_reqs:
            if nr.req_id == rid:
                computed = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        if rid in c.req_ids:
            computed = c.num_computed_tokens[c.req_ids.index(rid)]
        assert computed is not None
        return RuntimeError(f"{rid} broke") if computed + n > after else None

    return rule


@pytest.mark.parametrize("late", [False, True], ids=["at_launch", "at_get_output"])
@pytest.mark.parametrize("victim", ["d0", "d1"])
def test_a_failed_step_is_recovered_with_the_synchronous_tokens(late: bool, victim: str) -> None:
    specs = decode_specs(3, 7)
    kw = {"fail_when": fails_for(victim, 6), "late": late}
    sync = run(specs, False, None, executor_kw=kw)
    asyn = run(specs, True, None, executor_kw=kw)
    for s in specs:
        a, b = sync.results[s.rid], asyn.results[s.rid]
        assert (b.tokens, b.finish) == (a.tokens, a.finish), s.rid
    assert asyn.results[victim].finish == "error" and "broke" in asyn.results[victim].error
    assert all(asyn.results[s.rid].finish == "length" for s in specs if s.rid != victim)
    check_drained(asyn)


def test_blocks_a_step_in_flight_would_fill_are_not_prefix_cached_before_it_ran() -> None:
    """Step N's update must not cache the block step N+1 writes: N+1 may fail at launch (here: its request's second
    prompt token), and a later request sharing the prefix would read a slot nothing ever wrote. (Found by the
    random failure test below.)"""
    specs = [Spec("a", [1, 6], 1), Spec("b", [1, 6, 11], 1)]
    config = dict(num_gpu_blocks=5, block_size=1, max_num_batched_tokens=1, max_num_seqs=1, max_model_len=6)
    kw = {"fail_when": fails_for("a", 1)}
    for async_scheduling in (False, True):
        r = run(specs, async_scheduling, None, executor_kw=kw, **config)
        assert r.results["a"].finish == "error"
        assert (r.results["b"].tokens, r.results["b"].finish) == (expected(specs[1], None, 6)[0], "length")
        check_drained(r)


@settings(max_examples=max_examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads, victim=st.integers(0, 6), after=st.integers(1, 30), late=st.booleans())
def test_failed_steps_in_random_workloads_recover_as_synchronously(w: dict, victim: int, after: int, late: bool):
    w = dict(w, mode="recompute")  # a failed step that swapped blocks out is fatal in both modes
    specs, config = build(w)
    if min(config["max_model_len"], w["num_blocks"] * w["block_size"]) < 2:
        return
    kw = {"fail_when": fails_for(f"r{victim % len(specs)}", after), "late": late}
    sync = run(specs, False, w["eos"], executor_kw=kw, **config)
    asyn = run(specs, True, w["eos"], executor_kw=kw, **config)
    for s in specs:
        a, b = sync.results.get(s.rid, Got()), asyn.results.get(s.rid, Got())
        if s.abort_at is not None and s.abort_at >= s.arrive:
            continue
        assert (b.tokens, b.finish, b.stop_reason) == (a.tokens, a.finish, a.stop_reason), s.rid
    if any(g.finish == "error" for g in asyn.results.values()):
        event("a request failed")
    check_drained(asyn)


# ---------------------------------------------------------------------- flag and config
def test_the_flag_defaults_to_auto_and_round_trips_through_the_cli() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).async_scheduling is None  # vLLM's auto
    on = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--async-scheduling"]))
    assert on.async_scheduling is True
    off = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--no-async-scheduling"]))
    assert off.async_scheduling is False
    assert EngineArgs(model="m", async_scheduling=True).async_scheduling is True  # LLM(..., async_scheduling=True)


def test_engine_args_carry_the_flag_into_the_scheduler_config() -> None:
    from vllm_lite.testing.checkpoints import get_checkpoint

    model = get_checkpoint("llama")
    cfg = EngineArgs(model=model, device="cpu", async_scheduling=True).create_engine_config()
    assert cfg.scheduler_config.async_scheduling is True
    assert EngineArgs(model=model, device="cpu").create_engine_config().scheduler_config.async_scheduling is False
    off = EngineArgs(model=model, device="cpu", async_scheduling=False).create_engine_config()
    assert off.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling.*speculative"):
        EngineArgs(
            model=model,
            device="cpu",
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()


@pytest.mark.parametrize(
    "change, what",
    [
        (
            lambda c: setattr(c, "speculative_config", SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
            "spec",
        ),
        (lambda c: setattr(c.parallel_config, "tensor_parallel_size", 2), "tensor_parallel_size > 1"),
        (lambda c: setattr(c.model_config, "runner_type", "pooling"), "pooling"),
    ],
    ids=["speculative", "tensor_parallel", "pooling"],
)
def test_async_scheduling_with_an_unsupported_feature_is_refused_at_config_time(change, what: str) -> None:
    cfg = make_config()
    change(cfg)
    verify_async_scheduling(cfg)  # off: anything goes
    cfg.scheduler_config.async_scheduling = True
    with pytest.raises(ValueError, match=f"async_scheduling: async scheduling does not support .*{what}"):
        verify_async_scheduling(cfg)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineCore(cfg, lambda c: PagedFakeExecutor(c))


def test_the_core_logs_whether_async_scheduling_is_on(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        make_core(True)
        make_core(False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("async scheduling:")]
    assert lines == ["async scheduling: on", "async scheduling: off"]


# ---------------------------------------------------------------------- executors
def test_the_uniproc_executor_passes_non_block_to_the_worker() -> None:
    from vllm_lite.worker.executor import UniProcExecutor

    calls: list[tuple] = []
    ex = UniProcExecutor.__new__(UniProcExecutor)
    ex.worker = type("W", (), {"execute_model": lambda self, so, **kw: calls.append((so, kw)) or "out"})()
    so = SchedulerOutput.empty()
    assert ex.execute_model(so) == "out" and ex.execute_model(so, non_block=True) == "out"
    assert calls == [(so, {}), (so, {"non_block": True})]


def test_the_tensor_parallel_executor_refuses_non_block() -> None:
    from vllm_lite.worker.multiproc_executor import MultiprocExecutor

    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    with pytest.raises(NotImplementedError, match="async scheduling"):
        ex.execute_model(SchedulerOutput.empty(), non_block=True)


@pytest.mark.parametrize(
    "device, change, requested, expected",
    [
        ("cuda", None, None, True),  # auto: on for CUDA
        ("cpu", None, None, False),  # auto: off on CPU (the forward holds the thread; nothing to overlap)
        ("cuda", "spec", None, False),  # auto steps aside for what it cannot run with
        ("cuda", "tp", None, False),
        ("cuda", "pooling", None, False),
        ("cuda", None, False, False),  # explicit off
        ("cpu", None, True, True),  # explicit on, anywhere
    ],
)
def test_auto_turns_async_scheduling_on_for_cuda_where_nothing_blocks_it(device, change, requested, expected) -> None:
    """resolve_async_scheduling: vLLM's three-way flag (the device is set on a CPU-built config: nothing runs)."""
    import torch

    from vllm_lite.config import resolve_async_scheduling
    from vllm_lite.testing.checkpoints import get_checkpoint

    cfg = EngineArgs(model=get_checkpoint("llama"), device="cpu").create_engine_config()
    cfg.device_config.device = torch.device(device)
    if change == "spec":
        cfg.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    elif change == "tp":
        cfg.parallel_config.tensor_parallel_size = 2
    elif change == "pooling":
        cfg.model_config.runner_type = "pooling"
    resolve_async_scheduling(cfg, requested)
    assert cfg.scheduler_config.async_scheduling is expected


def test_asking_for_async_scheduling_with_what_blocks_it_still_names_the_field() -> None:
    import torch

    from vllm_lite.config import resolve_async_scheduling
    from vllm_lite.testing.checkpoints import get_checkpoint

    cfg = EngineArgs(model=get_checkpoint("llama"), device="cpu").create_engine_config()
    cfg.device_config.device = torch.device("cuda")
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel_size"):
        resolve_async_scheduling(cfg, True)
