"""EngineCore's bookkeeping around the step (no model): set-up from the executor's sizing, add/abort, the
step's outputs per frontend, failed steps, utility calls, shutdown and the periodic stats line.

The executor is `FakeExecutor` (a batch kept as the worker keeps it, tokens by a fixed rule), so each test
computes the tokens it expects with `fake_next_token` and runs in milliseconds.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Optional

import pytest

import vllm_lite.core.engine_core as engine_core_module
from vllm_lite.core.engine_core import EngineCore, _StatsLogger
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from vllm_lite.core.request import RequestStatus
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.core_harness import Result, assert_no_leak, drain, make_request
from vllm_lite.testing.fake_executor import FakeExecutor, fake_next_token
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.step import SchedulerOutput


def make_core(fail_when: Any = None, **config: Any) -> EngineCore:
    """An EngineCore over a small real scheduler/KV cache and a FakeExecutor (`fail_when` injects failures)."""

    def executor(vllm_config: Any) -> FakeExecutor:
        return FakeExecutor(vllm_config, fail_when=fail_when)

    return EngineCore(make_config(**config), executor)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_next_token(tokens))
    return tokens[len(prompt) :]


def greedy(max_tokens: int = 3, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def by_id(outputs: dict[int, EngineCoreOutputs]) -> dict[str, tuple[int, EngineCoreOutput]]:
    """request id -> (the client index its output went to, the output)."""
    return {o.request_id: (client, o) for client, batch in outputs.items() for o in batch.outputs}


# ---------------------------------------------------------------------- set-up
def test_the_executors_block_counts_size_the_kv_cache_and_reach_config_and_facts(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        core = make_core(num_gpu_blocks=40, num_cpu_blocks=8, block_size=4, preemption_mode="swap")
    cc = core.config.cache_config
    assert (cc.num_gpu_blocks, cc.num_cpu_blocks) == (40, 8)
    assert core.executor.initialized == (40, 8)
    assert core.scheduler.num_free_blocks == core.call_utility("get_num_total_blocks", []) > 0
    expected_facts = {
        "model": "fake",
        "max_model_len": 256,
        "block_size": 4,
        "num_gpu_blocks": 40,
        "vocab_size": 1000,
        "max_logprobs": 20,
        "generation_config": "auto",
    }
    assert {k: core.model_facts.get(k) for k in expected_facts} == expected_facts
    assert core.startup_time_s >= 0
    ready = [r.getMessage() for r in caplog.records if "engine core ready" in r.getMessage()]
    assert len(ready) == 1
    assert ready[0].startswith("engine core ready in ")
    assert ready[0].endswith("s: model=fake dtype=float32 kv_blocks=40 (block_size=4) swap_blocks=8")


def test_without_an_executor_class_the_parallel_config_picks_one_and_startup_time_is_measured(
    monkeypatch, clock: "_Clock"
) -> None:
    picked: list[Any] = []

    def get_executor_class(vllm_config: Any) -> type:
        picked.append(vllm_config)
        return FakeExecutor

    monkeypatch.setattr(engine_core_module, "get_executor_class", get_executor_class)
    clock.tick = 1.5  # each perf_counter() call moves 1.5 s: start and end of __init__
    cfg = make_config()
    core = EngineCore(cfg)
    assert picked == [cfg]
    assert isinstance(core.executor, FakeExecutor)
    assert core.startup_time_s == 1.5


def test_requests_are_checked_against_the_model_and_the_kv_caches_capacity() -> None:
    # 10 blocks of 4 tokens hold fewer tokens than the configured max_model_len (256): the cache's size caps it.
    cfg = make_config(num_gpu_blocks=10, block_size=4, max_model_len=256)
    cfg.model_config.max_logprobs = 7
    core = EngineCore(cfg, FakeExecutor)
    cap = core.scheduler.max_model_len
    assert cap < 256
    assert core.request_limits.max_model_len == cap
    assert core.request_limits.vocab_size == 1000
    assert core.request_limits.max_logprobs == 7
    with pytest.raises(ValueError, match="leaves no room to generate"):
        core.add_request(make_request("long", list(range(1, cap + 1)), greedy()))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        core.add_request(make_request("oov", [5, 1000], greedy()))
    with pytest.raises(ValueError, match="logprobs"):
        core.add_request(make_request("lp", [5], greedy(logprobs=8)))
    core.add_request(make_request("lp7", [5], greedy(logprobs=7)))
    core.abort_requests(["lp7"])
    assert not core.has_unfinished_requests()
    core.add_request(make_request("fits", list(range(1, cap)), greedy(max_tokens=1), eos_token_id=None))
    assert core.scheduler.get_num_unfinished_requests() == 1


# ---------------------------------------------------------------------- add / abort
def test_a_live_duplicate_id_is_refused_and_the_id_is_free_again_once_it_finished() -> None:
    core = make_core()
    core.add_request(make_request("dup", [1, 2, 3], greedy(max_tokens=1)))
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        core.add_request(make_request("dup", [4, 5], greedy()))
    results: dict[str, Result] = {}
    drain(core, results)
    assert results["dup"].token_ids == expected_tokens([1, 2, 3], 1)
    core.add_request(make_request("dup", [4, 5], greedy(max_tokens=1)))
    results = {}
    drain(core, results)
    assert results["dup"].token_ids == expected_tokens([4, 5], 1)


def test_the_frontends_tenant_salt_and_the_requests_fields_reach_the_scheduler() -> None:
    core = make_core()
    core.add_request(make_request("r", [1, 2], greedy(), client_index=3, priority=-2), tenant_salt=b"tenant")
    req = core.scheduler.get_request("r")
    assert req is not None
    assert (req.tenant_salt, req.client_index, req.priority) == (b"tenant", 3, -2)
    core.add_request(make_request("s", [1, 2], greedy()))
    assert core.scheduler.get_request("s").tenant_salt is None


def test_an_aborted_request_ends_aborted_frees_its_blocks_and_emits_nothing_more() -> None:
    core = make_core()
    free = core.scheduler.num_free_blocks
    core.add_request(make_request("a", [1, 2, 3, 4, 5], greedy(max_tokens=10)))
    core.add_request(make_request("b", [6, 7], greedy(max_tokens=2)))
    first = by_id(core.step())
    assert set(first) == {"a", "b"}
    req = core.scheduler.get_request("a")
    core.abort_requests(["a", "never-added"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert core.scheduler.get_request("a") is None
    results: dict[str, Result] = {}
    drain(core, results)
    assert "a" not in results
    assert results["b"].token_ids == expected_tokens([6, 7], 2)[1:]
    assert core.scheduler.num_free_blocks == free
    assert_no_leak(core)


# ---------------------------------------------------------------------- step
def test_a_step_with_nothing_to_do_returns_no_outputs_and_runs_no_step() -> None:
    core = make_core()
    assert core.step() == {}
    assert core.executor.steps == []
    assert not core.has_unfinished_requests()


def test_each_frontend_gets_only_its_own_requests_outputs_with_the_models_tokens() -> None:
    core = make_core()
    core.add_request(make_request("c0", [11, 12, 13], greedy(max_tokens=3), client_index=0))
    core.add_request(make_request("c2", [21, 22], greedy(max_tokens=2), client_index=2))
    assert core.has_unfinished_requests()
    outputs = core.step()
    assert sorted(outputs) == [0, 2]
    assert [o.request_id for o in outputs[0].outputs] == ["c0"]
    assert [o.request_id for o in outputs[2].outputs] == ["c2"]
    results: dict[str, Result] = {}
    for batch in outputs.values():
        for o in batch.outputs:
            results[o.request_id] = Result(list(o.new_token_ids))
    while core.has_unfinished_requests():
        for client, batch in core.step().items():
            for o in batch.outputs:
                assert client == {"c0": 0, "c2": 2}[o.request_id]
                results[o.request_id].token_ids += o.new_token_ids
                results[o.request_id].finish_reason = o.finish_reason
    assert results["c0"].token_ids == expected_tokens([11, 12, 13], 3)
    assert results["c2"].token_ids == expected_tokens([21, 22], 2)
    assert {r.finish_reason for r in results.values()} == {FinishReason.LENGTH}


def test_a_step_that_schedules_nothing_waits_briefly_for_a_grammar_and_a_busy_one_does_not(monkeypatch) -> None:
    core = make_core()
    waits: list[float] = []
    monkeypatch.setattr(core.scheduler, "wait_for_grammar", waits.append)
    core.add_request(make_request("r", [1, 2], greedy(max_tokens=2)))
    core.step()
    assert waits == []
    monkeypatch.setattr(core.scheduler, "schedule", SchedulerOutput.empty)
    assert core.step() == {}
    assert len(waits) == 1 and 0 < waits[0] <= 0.05


def _fail_for(rid: str, exc: Optional[BaseException] = None):
    def fail_when(so: SchedulerOutput) -> Optional[BaseException]:
        return (exc or RuntimeError(f"bad input in {rid}")) if rid in so.num_scheduled_tokens else None

    return fail_when


def test_a_request_that_breaks_the_step_ends_with_an_error_sent_to_its_own_frontend() -> None:
    core = make_core(fail_when=_fail_for("bad"))
    core.add_request(make_request("good", [1, 2, 3], greedy(max_tokens=2), client_index=0))
    core.add_request(make_request("bad", [4, 5], greedy(), client_index=1))
    outputs = core.step()
    got = by_id(outputs)
    client, bad = got["bad"]
    assert client == 1
    assert bad.finish_reason == FinishReason.ERROR and bad.new_token_ids == []
    assert "RuntimeError: bad input in bad" in bad.error
    assert got["good"][0] == 0 and got["good"][1].new_token_ids == expected_tokens([1, 2, 3], 1)
    assert outputs[1].outputs == [bad]
    # The failed step, then one probe per request, then the good request's replay: the step's own error
    # pins the whole batch as failing, so it is not run a second time.
    assert [sorted(so.num_scheduled_tokens) for so in core.executor.steps] == [
        ["bad", "good"],
        ["good"],
        ["bad"],
        ["good"],
    ]
    results: dict[str, Result] = {}
    drain(core, results)
    assert results["good"].token_ids == expected_tokens([1, 2, 3], 2)[1:]
    assert "bad" not in results
    assert_no_leak(core)


def test_the_error_output_joins_its_frontends_batch_when_that_frontend_has_other_outputs() -> None:
    core = make_core(fail_when=_fail_for("bad"))
    core.add_request(make_request("good", [1, 2, 3], greedy(max_tokens=2), client_index=4))
    core.add_request(make_request("bad", [4, 5], greedy(), client_index=4))
    outputs = core.step()
    assert list(outputs) == [4]
    assert [o.request_id for o in outputs[4].outputs] == ["good", "bad"]
    assert outputs[4].outputs[1].finish_reason == FinishReason.ERROR
    assert outputs[4].scheduler_stats is not None


def test_a_failure_no_request_explains_propagates_out_of_step() -> None:
    core = make_core(fail_when=lambda so: RuntimeError("the device is gone") if so.num_scheduled_tokens else None)
    core.add_request(make_request("a", [1, 2], greedy()))
    core.add_request(make_request("b", [3, 4], greedy()))
    with pytest.raises(RuntimeError, match="the device is gone"):
        core.step()


# ---------------------------------------------------------------------- utility calls
def test_utility_calls_answer_from_the_scheduler_and_an_unknown_one_names_the_known() -> None:
    core = make_core(num_gpu_blocks=30, max_num_batched_tokens=4, block_size=4)
    assert core.call_utility("ping", []) is True
    assert core.call_utility("get_num_total_blocks", []) == core.scheduler.num_total_blocks
    facts = core.call_utility("get_model_facts", [])
    assert facts == core.model_facts
    facts["model"] = "changed"
    assert core.model_facts["model"] == "fake"  # a copy: a caller cannot change the core's facts
    core.add_request(make_request("long", list(range(1, 11)), greedy()))
    assert core.call_utility("get_num_unfinished_requests", []) == 1
    assert core.step() == {}  # the first chunk of the prompt: no token, no outputs, counters not consumed
    free = core.call_utility("get_num_free_blocks", [])
    assert free == core.scheduler.num_free_blocks < core.scheduler.num_total_blocks
    stats = core.call_utility("get_stats", [])
    assert set(stats) == set(SchedulerStats.__struct_fields__)
    assert stats["num_running_reqs"] == 1 and stats["num_free_blocks"] == free
    assert stats["prefix_cache_queries"] == 10
    assert core.call_utility("get_stats", []) == stats  # peeking does not reset the step's counters
    with pytest.raises(ValueError) as e:
        core.call_utility("no_such_method", [1])
    msg = str(e.value)
    assert "unknown utility method 'no_such_method'" in msg
    assert "'get_stats'" in msg and "'ping'" in msg and "'reset_prefix_cache'" in msg


def test_reset_prefix_cache_utility_drops_cached_blocks_once_nothing_runs() -> None:
    core = make_core(block_size=4)
    prompt = list(range(1, 10))
    core.add_request(make_request("a", prompt, greedy(max_tokens=1)))
    drain(core, {})
    core.add_request(make_request("b", prompt, greedy(max_tokens=1)))
    hit = by_id(core.step())["b"][1]
    assert hit.num_cached_tokens == 8
    drain(core, {})
    assert core.call_utility("reset_prefix_cache", []) is True
    core.add_request(make_request("c", prompt, greedy(max_tokens=1)))
    assert by_id(core.step())["c"][1].num_cached_tokens == 0


def test_shutdown_stops_the_executor_and_the_grammar_pool() -> None:
    core = make_core()
    som = core.scheduler.structured_output_manager
    stopped: list[bool] = []
    som.shutdown = lambda: stopped.append(True)  # type: ignore[method-assign]
    core.shutdown()
    assert core.executor.shut_down
    assert stopped == [True]


# ---------------------------------------------------------------------- the periodic stats line
class _Clock:
    """`monotonic` reads `now`; `perf_counter` moves `tick` seconds at each call."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.tick = 0.0
        self._perf = 5000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        self._perf += self.tick
        return self._perf


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    """engine_core's clock, moved by hand (only that module's `time` name is replaced, and put back)."""
    c = _Clock()
    monkeypatch.setattr(engine_core_module, "time", SimpleNamespace(monotonic=c.monotonic, perf_counter=c.perf_counter))
    return c


def _batch(n_tokens: list[int], stats: Optional[SchedulerStats]) -> EngineCoreOutputs:
    outs = [EngineCoreOutput(f"r{i}", list(range(n))) for i, n in enumerate(n_tokens)]
    return EngineCoreOutputs(outputs=outs, scheduler_stats=stats)


def _stats_lines(caplog) -> list[tuple]:
    return [r.args for r in caplog.records if r.getMessage().startswith("engine stats:")]


def test_the_stats_line_reports_rates_over_the_interval_and_counts_only_the_batch_with_counters(
    clock: _Clock, caplog
) -> None:
    log = _StatsLogger(10.0)
    counters = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=40,
        prefix_cache_hits=10,
        num_preemptions=1,
    )
    gauges = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25)
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        clock.now += 4
        # 30 scheduled tokens, 3 of them sampled (2 + 1): 27 prompt tokens.
        log.record(30, {0: _batch([2], counters), 1: _batch([1], gauges)})
        assert _stats_lines(caplog) == []  # 4 s < 10 s
        clock.now += 6
        log.record(4, {1: _batch([1, 1], None), 0: _batch([1], counters)})
    (args,) = _stats_lines(caplog)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine stats:")]
    assert line == (
        "engine stats: prompt_tput=2.8 tok/s gen_tput=0.6 tok/s running=3 waiting=2 kv_usage=25.0% "
        "prefix_cache_hit_rate=25.0% preemptions=2"
    )
    prompt_tput, gen_tput, running, waiting, kv, hit_rate, preemptions = args
    assert prompt_tput == pytest.approx((27 + 1) / 10)
    assert gen_tput == pytest.approx((3 + 3) / 10)
    assert (running, waiting) == (3, 2)
    assert kv == pytest.approx(25.0)
    assert hit_rate == pytest.approx(100 * 20 / 80)
    assert preemptions == 2
    assert (log.prompt_tokens, log.gen_tokens, log.queries, log.hits, log.preemptions) == (0, 0, 0, 0, 0)
    assert log.last_log == clock.now


def test_the_stats_line_waits_for_the_interval_and_for_a_batch_with_stats(clock: _Clock, caplog) -> None:
    log = _StatsLogger(5.0)
    start = log.last_log
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        clock.now += 1
        log.record(1, {0: _batch([3], SchedulerStats())})  # more sampled than scheduled: no negative prompt count
        assert (log.prompt_tokens, log.gen_tokens) == (0, 3)
        assert _stats_lines(caplog) == []
        clock.now += 100
        log.record(2, {0: _batch([1], None)})  # no batch carried stats: nothing to report yet
        assert _stats_lines(caplog) == []
        assert log.last_log == start and (log.prompt_tokens, log.gen_tokens) == (1, 4)
        log.record(1, {0: _batch([1], SchedulerStats())})
        (args,) = _stats_lines(caplog)
        assert args[1] == pytest.approx(5 / 101)
        assert args[5] == 0.0  # no prefix-cache queries: a 0% hit rate, not a division by zero
        clock.now += 5  # exactly one interval later: due
        log.record(1, {0: _batch([1], SchedulerStats())})
        assert len(_stats_lines(caplog)) == 2
        clock.now += 4.9
        log.record(1, {0: _batch([1], SchedulerStats())})
        assert len(_stats_lines(caplog)) == 2


def test_the_core_feeds_each_steps_tokens_to_the_stats_line() -> None:
    core = make_core()
    core.add_request(make_request("r", [1, 2, 3, 4], greedy(max_tokens=2)))
    core.step()
    assert (core._stats_log.prompt_tokens, core._stats_log.gen_tokens) == (3, 1)
    core.step()
    assert (core._stats_log.prompt_tokens, core._stats_log.gen_tokens) == (3, 2)
