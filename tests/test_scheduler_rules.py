"""The scheduler's rules one at a time, on a real Scheduler and KVCacheManager with made-up requests (no model).

Where tests/test_scheduler.py walks whole scenarios, these pin the edges a broken rule would cross: each setting
on its bound, where a finished or aborted request can be, which requests a step may admit after it preempted,
the order victims are picked in, what the first output carries, several tokens in one step, and a grammar's
life in the scheduler (WAITING_FOR_FSM, its bitmask row, a refused token) driven by a scripted matcher.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_lite.config import SpeculativeConfig
from vllm_lite.core.messages import FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.testing.scheduler_driver import (
    ControlledGrammars,
    ScriptedMatcher,
    fake_runner_output,
    make_request,
    outputs_by_id,
    run_to_completion,
    step,
    tight_scheduler,
)
from vllm_lite.worker.step import LogprobsTensors, ModelRunnerOutput


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "section, field, value, message",
    [
        (
            "cache_config",
            "num_gpu_blocks",
            1,
            r"^cache_config\.num_gpu_blocks must be set to an integer >= 2 before the scheduler is built, got 1\.$",
        ),
        ("cache_config", "num_gpu_blocks", 4.0, r"num_gpu_blocks must be set to an integer >= 2 .* got 4\.0\.$"),
        ("cache_config", "preemption_mode", "drop", r"^preemption_mode must be 'recompute' or 'swap', got 'drop'\.$"),
        ("scheduler_config", "policy", "lifo", r"^scheduling policy must be 'fcfs' or 'priority', got 'lifo'\.$"),
        (
            "scheduler_config",
            "max_num_batched_tokens",
            0,
            r"^scheduler_config\.max_num_batched_tokens must be a positive integer, got 0\.$",
        ),
        (
            "scheduler_config",
            "max_num_seqs",
            0,
            r"^scheduler_config\.max_num_seqs must be a positive integer, got 0\.$",
        ),
        ("scheduler_config", "max_num_seqs", 2.0, r"max_num_seqs must be a positive integer, got 2\.0\.$"),
        (
            "scheduler_config",
            "max_model_len",
            0,
            r"^scheduler_config\.max_model_len must be a positive integer, got 0\.$",
        ),
        (
            "scheduler_config",
            "long_prefill_token_threshold",
            -1,
            r"^long_prefill_token_threshold must be a non-negative integer, got -1\.$",
        ),
        ("scheduler_config", "long_prefill_token_threshold", 1.0, r"non-negative integer, got 1\.0\.$"),
    ],
)
def test_each_bad_setting_is_refused_with_its_own_message(section, field, value, message):
    cfg = make_config()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ValueError, match=message):
        Scheduler(cfg)


def test_each_setting_on_its_bound_is_accepted_and_kept(caplog):
    cfg = make_config(
        num_gpu_blocks=2,
        block_size=1,
        max_num_batched_tokens=1,
        max_num_seqs=1,
        max_model_len=1,
        long_prefill_token_threshold=0,
        policy="priority",
        preemption_mode="swap",
    )
    cfg.cache_config.num_cpu_blocks = None  # no swap space given: a pool of 0 host blocks
    with caplog.at_level(logging.WARNING, logger="vllm_lite.scheduler"):
        s = Scheduler(cfg)
    assert (s.block_size, s.policy, s.preemption_mode) == (1, "priority", "swap")
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.long_prefill_token_threshold) == (1, 1, 0)
    assert s.max_model_len == 1 and s.num_total_blocks == 1 and s.num_free_blocks == 1
    assert s.kv_cache_manager.host_pool.get_num_free_blocks() == 0
    assert (s.kv_cache_manager.block_size, s.kv_cache_manager.enable_caching) == (1, True)
    assert caplog.records == []  # the cache holds exactly max_model_len tokens: no warning


def test_a_cache_smaller_than_max_model_len_caps_it_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_lite.scheduler"):
        s = Scheduler(make_config(num_gpu_blocks=4, block_size=4, max_model_len=13))
    assert s.max_model_len == 12
    (rec,) = caplog.records
    assert rec.getMessage() == (
        "KV cache holds only 12 tokens (3 blocks of 4), less than max_model_len=13: requests are capped at 12 tokens"
    )


def test_the_kv_cache_follows_the_caching_switch_and_the_models_sliding_window():
    cfg = make_config(enable_prefix_caching=False)
    cfg.model_config.hf_config = {"num_hidden_layers": 2, "sliding_window": 8}
    kv = Scheduler(cfg).kv_cache_manager
    assert (kv.enable_caching, kv.sliding_window) == (False, 8)
    assert Scheduler(make_config()).kv_cache_manager.sliding_window is None


# ---------------------------------------------------------------------- add_request
def test_add_request_refusals_name_the_request_and_the_rule():
    s = Scheduler(make_config(max_model_len=8))
    with pytest.raises(TypeError, match=r"^request must be a Request, got str\.$"):
        s.add_request("a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^request 'e': prompt_token_ids is empty\.$"):
        s.add_request(make_request("e", []))
    with pytest.raises(ValueError, match=r"^request 'l': 9 tokens exceed max_model_len=8 \(the smaller of"):
        s.add_request(make_request("l", 9))
    running = make_request("r", 2)
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match=r"^request 'r': status must be WAITING to be added, got RUNNING\.$"):
        s.add_request(running)
    done = make_request("d", 2)
    done.status = RequestStatus.FINISHED_ABORTED
    with pytest.raises(ValueError, match="got FINISHED_ABORTED"):
        s.add_request(done)
    s.add_request(make_request("full", 8))  # exactly max_model_len tokens fit
    with pytest.raises(ValueError, match=r"^request_id 'full' is already in the scheduler\.$"):
        s.add_request(make_request("full", 2))
    assert s.get_num_unfinished_requests() == 1 and list(s.requests) == ["full"]


# ---------------------------------------------------------------------- finish_requests
def test_a_string_id_is_one_request_not_its_characters():
    s = Scheduler(make_config())
    for rid in ("ab", "a", "b"):
        s.add_request(make_request(rid, 3))
    (done,) = s.finish_requests("ab", RequestStatus.FINISHED_ABORTED)
    assert done.request_id == "ab" and done.status == RequestStatus.FINISHED_ABORTED
    assert sorted(s.requests) == ["a", "b"] and [r.request_id for r in s.waiting] == ["a", "b"]


def test_finish_requests_reaches_a_request_wherever_it_is_and_tells_the_worker_only_of_its_own():
    s = tight_scheduler(preemption_mode="swap", num_cpu_blocks=8, max_num_seqs=3)
    grammars = ControlledGrammars(s)
    s.add_request(make_request("run", 7, start=0))
    s.add_request(make_request("swp", 7, start=100))
    step(s)
    step(s)
    step(s)  # "run" needs a third block: "swp" is swapped out
    s.add_request(make_request("wait", 3, start=300))
    s.add_request(make_request("fsm", 3, start=400, structured_outputs=StructuredOutputsParams(regex="a")))
    assert s.get_request("swp").status == RequestStatus.SWAPPED
    assert s.get_request("fsm").status == RequestStatus.WAITING_FOR_FSM
    assert s.make_stats().num_waiting_reqs == 3  # swapped + waiting + compiling
    done = s.finish_requests(["run", "swp", "wait", "fsm", "run", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["run", "swp", "wait", "fsm"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert grammars.futures[0].cancelled()
    assert not s.running and not s.waiting and not s.swapped and not s.has_unfinished_requests()
    assert s.num_free_blocks == s.num_total_blocks
    assert s.kv_cache_manager.host_pool.get_num_free_blocks() == 8
    assert s.make_stats().num_waiting_reqs == 0
    so = s.schedule()
    assert so.finished_req_ids == {"run"}  # "swp" was already dropped when swapped; the others never ran
    assert so.num_scheduled_tokens == {} and not s.has_finished_requests()


def test_an_id_reused_after_its_request_finished_is_not_dropped_twice_from_the_worker():
    s = Scheduler(make_config(max_num_seqs=1))
    s.add_request(make_request("a", 3, max_tokens=1))
    s.add_request(make_request("busy", 3, start=300, max_tokens=3))
    step(s)  # a finishes; the worker drops it at the next step
    assert s.schedule().finished_req_ids == {"a"}
    s.add_request(make_request("a", 3, start=500))  # the same id again, waiting behind "busy"
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not s.has_finished_requests() and s.schedule().finished_req_ids == set()


def test_finishing_a_preempted_request_takes_it_out_of_the_waiting_queue():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    step(s)  # b preempted by recompute
    assert s.get_request("b").status == RequestStatus.PREEMPTED
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert not s.waiting and list(s.requests) == ["a"]


# ---------------------------------------------------------------------- the step's budget
def test_a_request_with_nothing_left_to_run_is_skipped_and_the_next_still_runs():
    s = Scheduler(make_config(max_num_batched_tokens=6))
    s.add_request(make_request("a", 2))
    s.add_request(make_request("b", 10, start=300))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 2, "b": 4}
    # No update in between: a has run every token it has; b's prompt goes on.
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 6}
    assert so.scheduled_cached_reqs.req_ids == ["b"]


def test_the_last_token_of_the_budget_is_spent_by_a_decode_and_by_an_admission():
    s = Scheduler(make_config(max_num_batched_tokens=2))
    s.add_request(make_request("a", 1))
    s.add_request(make_request("b", 1, start=300))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # b is admitted on the one token left
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # b decodes on the one token left


def test_nothing_runs_beyond_the_budget_and_a_spent_budget_admits_no_one():
    s = Scheduler(make_config(max_num_batched_tokens=5))
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 1, start=300))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 5} and so.total_num_scheduled_tokens == 5
    assert [r.request_id for r in s.waiting] == ["b"]


def test_long_prefill_threshold_also_cuts_a_swapped_in_or_admitted_chunk_and_max_model_len_caps_the_rest():
    s = Scheduler(make_config(long_prefill_token_threshold=3, max_num_batched_tokens=64, max_model_len=12))
    s.add_request(make_request("a", 8))
    chunks = []
    while s.get_request("a").num_output_tokens == 0:
        so, _ = step(s)
        chunks.append(so.num_scheduled_tokens["a"])
    assert chunks == [3, 3, 2]


# ---------------------------------------------------------------------- preemption
def test_after_a_victim_earlier_in_the_batch_the_next_request_is_not_skipped():
    s = Scheduler(
        make_config(num_gpu_blocks=7, block_size=4, max_model_len=16, policy="priority", enable_prefix_caching=False)
    )
    s.add_request(make_request("low", 4, start=0, priority=9))
    s.add_request(make_request("mid", 7, start=100, priority=0))
    s.add_request(make_request("hi", 4, start=200, priority=0))
    step(s)  # low 4+1, mid 7+1, hi 4+1 tokens: 2 + 2 + 2 blocks = all 6
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"low": 1, "mid": 1, "hi": 1}
    # mid (9 tokens) needs a third block: low, earlier in the batch and lowest priority, steps aside, and hi,
    # right after mid, still runs this step.
    so, _ = step(s)
    assert so.finished_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"mid": 1, "hi": 1}
    assert so.scheduled_cached_reqs.req_ids == ["mid", "hi"]


def test_a_step_that_preempts_admits_no_waiting_request():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    s.add_request(make_request("small", 1, start=300))
    so, _ = step(s)  # b preempted: even a 1-token request waits for the next step
    assert so.finished_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in s.waiting] == ["b", "small"]  # the victim goes back in front


def test_among_equal_arrival_times_the_later_added_request_is_the_victim():
    for policy in ("fcfs", "priority"):
        s = tight_scheduler(policy=policy)
        s.add_request(make_request("first", 7, start=0, arrival=1.0))
        s.add_request(make_request("second", 7, start=100, arrival=1.0))
        step(s)
        step(s)
        so, _ = step(s)
        assert so.finished_req_ids == {"second"}, policy
        assert s.get_request("second").num_preemptions == 1 and s.get_request("first").num_preemptions == 0


def test_priority_victims_go_by_priority_before_arrival():
    s = tight_scheduler(policy="priority")
    s.add_request(make_request("early_low", 7, start=0, priority=5, arrival=1.0))
    s.add_request(make_request("late_high", 7, start=100, priority=1, arrival=2.0))
    step(s)
    step(s)
    so, _ = step(s)
    assert so.finished_req_ids == {"early_low"} and so.num_scheduled_tokens == {"late_high": 1}


def test_a_swapped_request_that_does_not_fit_holds_back_waiting_ones():
    s = tight_scheduler(preemption_mode="swap", num_cpu_blocks=8, max_num_seqs=4)
    s.add_request(make_request("a", 7, start=0, max_tokens=9))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    so, _ = step(s)
    assert s.get_request("b").status == RequestStatus.SWAPPED
    # a now holds 3 blocks; b needs 3 to come back (only 1 free); a 1-token request would fit but must wait.
    s.add_request(make_request("tiny", 1, start=300))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.blocks_to_swap_in == [] and [r.request_id for r in s.waiting] == ["tiny"]


def _swapped_with_room() -> Scheduler:
    """b is swapped out after three steps; d has finished since, so b fits again (4 free blocks, b needs 3)."""
    s = Scheduler(
        make_config(
            num_gpu_blocks=8,
            block_size=4,
            max_model_len=16,
            enable_prefix_caching=False,
            preemption_mode="swap",
            num_cpu_blocks=8,
        )
    )
    s.add_request(make_request("a", 7, start=0, max_tokens=9))
    s.add_request(make_request("d", 9, start=200, max_tokens=3))
    s.add_request(make_request("b", 7, start=100, max_tokens=9))
    for _ in range(3):
        step(s)
    assert s.get_request("b").status == RequestStatus.SWAPPED and s.get_request("d") is None
    assert s.num_free_blocks == 4
    return s


def test_a_swapped_request_comes_back_once_there_is_room():
    so, _ = step(_swapped_with_room())
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and len(so.blocks_to_swap_in) == 2


def test_swapped_requests_respect_max_num_seqs():
    s = _swapped_with_room()
    s.max_num_seqs = 1  # a alone fills the batch: b must not come back, room or not
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1} and so.blocks_to_swap_in == []
    assert s.get_request("b").status == RequestStatus.SWAPPED


def test_a_swapped_in_request_is_charged_to_the_budget_before_waiting_ones():
    s = _swapped_with_room()
    s.max_num_batched_tokens = 3
    s.add_request(make_request("w", 5, start=300))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "w": 1}


def _four_small() -> Scheduler:
    """4 usable blocks, four 3-token requests: all cross into a second block at step 3."""
    s = tight_scheduler()
    for i in range(4):
        s.add_request(make_request(f"r{i}", 3, start=100 * i, max_tokens=9))
    return s


def test_every_preemption_is_counted_in_the_step_and_on_the_request():
    s = _four_small()
    step(s)
    step(s)
    so, outs = step(s)  # r0 takes r3's block, r1 takes r2's
    assert so.finished_req_ids == {"r2", "r3"} and [r.request_id for r in s.waiting] == ["r2", "r3"]
    assert outs[0].scheduler_stats.num_preemptions == 2


def test_a_request_preempted_twice_says_so():
    s = _four_small()
    r3 = s.get_request("r3")
    run_to_completion(s)
    assert r3.num_preemptions == 2 and s._arrival_order == {}  # finished requests leave no trace behind


def test_two_requests_swapped_in_one_step_come_back_oldest_first():
    s = Scheduler(
        make_config(
            num_gpu_blocks=5,
            block_size=4,
            max_model_len=16,
            enable_prefix_caching=False,
            preemption_mode="swap",
            num_cpu_blocks=8,
        )
    )
    for i in range(4):
        s.add_request(make_request(f"r{i}", 3, start=100 * i, max_tokens=9))
    for _ in range(3):
        step(s)
    assert [r.request_id for r in s.swapped] == ["r2", "r3"]


def test_a_recomputed_request_keeps_its_first_schedule_time():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0, max_tokens=3))
    s.add_request(make_request("b", 7, start=100, max_tokens=4))
    step(s)
    b = s.get_request("b")
    first_ts, first_hit = b.scheduled_ts, b.num_cached_tokens
    assert first_hit == 0 and first_ts > 0.0
    run_to_completion(s)
    assert b.num_preemptions == 1
    assert b.scheduled_ts == first_ts and b.num_cached_tokens == 0


def test_a_resumed_request_keeps_its_first_hit_length_and_first_schedule_time():
    s = tight_scheduler(enable_prefix_caching=True)
    s.add_request(make_request("warm", 4, start=0, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("b", 7, start=100, max_tokens=9))
    s.add_request(make_request("a", list(range(0, 4)) + [50, 51, 52], max_tokens=9))
    step(s)
    a = s.get_request("a")
    assert a.num_cached_tokens == 4
    first_ts = a.scheduled_ts
    assert first_ts >= a.queued_ts > 0.0
    # a, the later arrival, is preempted when b needs a block; it comes back (with no hit left) once b is done.
    saw_preempt = False
    for _ in range(40):
        so, _ = step(s)
        if "a" in so.finished_req_ids:
            saw_preempt = True
        if saw_preempt and any(r.req_id == "a" for r in so.scheduled_new_reqs):
            break
    else:
        pytest.fail("a was never preempted and re-admitted")
    assert a.num_preemptions == 1
    assert a.num_cached_tokens == 4 and a.scheduled_ts == first_ts


# ---------------------------------------------------------------------- what the worker is sent
def test_a_new_request_reaches_the_worker_with_its_eos_params_and_blocks():
    s = Scheduler(make_config(block_size=4))
    req = make_request("a", 6, eos=3, temperature=0.5)
    s.add_request(req)
    so = s.schedule()
    (nr,) = so.scheduled_new_reqs
    assert nr.eos_token_id == 3 and nr.sampling_params is req.sampling_params
    assert nr.block_ids == s.kv_cache_manager.get_block_ids("a") and len(nr.block_ids) == 2
    assert nr.prompt_token_ids == list(range(100, 106)) and nr.output_token_ids == []
    assert nr.num_computed_tokens == 0 and req.num_computed_tokens == 6


def test_a_running_request_gets_new_block_ids_only_when_it_crosses_a_block():
    s = Scheduler(make_config(block_size=4))
    s.add_request(make_request("a", 3))
    step(s)  # 3 prompt tokens + 1 sampled: one block, full after the next step
    so, _ = step(s)
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    so, _ = step(s)  # position 4 opens a second block
    assert so.scheduled_cached_reqs.new_block_ids == [[s.kv_cache_manager.get_block_ids("a")[1]]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [4]


# ---------------------------------------------------------------------- outputs
def test_only_the_first_output_carries_queue_and_schedule_times_and_hits_are_never_negative():
    s = Scheduler(make_config())
    req = make_request("a", 3, max_tokens=3)
    s.add_request(req)
    got = run_to_completion(s)["a"]
    assert [o.queued_ts for o in got] == [req.queued_ts, 0.0, 0.0] and req.queued_ts > 0.0
    assert [o.scheduled_ts for o in got] == [req.scheduled_ts, 0.0, 0.0] and req.scheduled_ts >= req.queued_ts
    assert [o.num_cached_tokens for o in got] == [0, 0, 0]


def test_a_prompt_logprobs_chunk_carries_no_times_and_the_first_token_does():
    s = Scheduler(make_config(max_num_batched_tokens=4))
    req = make_request("a", 6, prompt_logprobs=1)
    s.add_request(req)
    plp = LogprobsTensors(torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2), torch.ones(4, dtype=torch.int64))
    so = s.schedule()
    mro = fake_runner_output(s, so)
    mro.prompt_logprobs_dict["a"] = plp
    (chunk,) = s.update_from_output(so, mro)[0].outputs
    assert chunk.new_token_ids == [] and (chunk.queued_ts, chunk.scheduled_ts) == (0.0, 0.0)
    _, outs = step(s)
    first = outputs_by_id(outs)["a"]
    assert first.new_token_ids == [7] and (first.queued_ts, first.scheduled_ts) == (req.queued_ts, req.scheduled_ts)


def test_several_tokens_in_one_step_stop_at_the_first_stop_token():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3, eos=2, stop_token_ids=[9], max_tokens=10))
    so = s.schedule()
    mro = ModelRunnerOutput(["a"], {"a": 0}, [[5, 9, 6, 2]])
    outs = s.update_from_output(so, mro)
    (o,) = outs[0].outputs
    assert o.new_token_ids == [5, 9] and o.finish_reason == FinishReason.STOP and o.stop_reason == 9
    assert s.get_request("a") is None and s.num_free_blocks == s.num_total_blocks


def test_a_mid_prompt_chunk_emits_nothing_even_if_the_runner_returns_a_token():
    s = Scheduler(make_config(max_num_batched_tokens=4))
    s.add_request(make_request("a", 10))
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, [[5]]))
    assert outs == {} and s.get_request("a").output_token_ids == []


def test_a_request_id_reused_after_an_abort_is_untouched_by_the_old_step():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3))
    so = s.schedule()
    mro = fake_runner_output(s, so)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    fresh = make_request("a", 3, start=500)
    s.add_request(fresh)
    assert s.update_from_output(so, mro) == {}
    assert fresh.output_token_ids == [] and fresh.status == RequestStatus.WAITING


def test_a_second_update_for_the_same_step_changes_nothing():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3))
    so = s.schedule()
    mro = fake_runner_output(s, so)
    assert outputs_by_id(s.update_from_output(so, mro))["a"].new_token_ids == [7]
    assert s.update_from_output(so, mro) == {}
    assert s.get_request("a").output_token_ids == [7]


def test_step_counters_go_to_the_lowest_client_and_gauges_to_every_client():
    s = Scheduler(make_config(block_size=4))
    s.add_request(make_request("warm", 4, start=0, max_tokens=1))
    run_to_completion(s)
    s.add_request(make_request("a", 5, start=0, client_index=3))
    s.add_request(make_request("b", 5, start=0, client_index=1))
    _, outs = step(s)
    assert set(outs) == {1, 3}
    counted, gauges = outs[1].scheduler_stats, outs[3].scheduler_stats
    assert (counted.prefix_cache_queries, counted.prefix_cache_hits) == (10, 8)
    assert (gauges.prefix_cache_queries, gauges.prefix_cache_hits, gauges.num_preemptions) == (0, 0, 0)
    assert gauges.num_running_reqs == counted.num_running_reqs == 2
    assert gauges.num_total_blocks == counted.num_total_blocks == s.num_total_blocks


def test_make_stats_can_peek_without_consuming_the_counters():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    s.schedule()  # preempts b
    peek = s.make_stats(reset=False)
    assert peek.num_preemptions == 1 and peek.step_counter == 3
    assert s.make_stats().num_preemptions == 1
    assert s.make_stats().num_preemptions == 0


# ---------------------------------------------------------------------- stop rules
def test_min_tokens_lets_eos_count_on_the_first_token_past_it():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3, eos=2, min_tokens=2))
    got = run_to_completion(s, lambda r: 2)["a"]
    assert [t for o in got for t in o.new_token_ids] == [2, 2] and got[-1].finish_reason == FinishReason.STOP


def test_without_max_tokens_a_request_runs_to_max_model_len_exactly():
    s = Scheduler(make_config(max_model_len=12))
    s.add_request(make_request("a", 5, max_tokens=None))
    got = run_to_completion(s)["a"]
    assert sum(len(o.new_token_ids) for o in got) == 7 and got[-1].finish_reason == FinishReason.LENGTH


def test_a_stop_token_within_min_tokens_is_kept_and_generation_goes_on():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3, stop_token_ids=[4], min_tokens=3, max_tokens=9))
    got = run_to_completion(s, lambda r: [4, 4, 6, 4][r.num_output_tokens])["a"]
    assert [t for o in got for t in o.new_token_ids] == [4, 4, 6, 4]
    assert got[-1].finish_reason == FinishReason.STOP and got[-1].stop_reason == 4


# ---------------------------------------------------------------------- structured outputs
_JSON = StructuredOutputsParams(json={"type": "object"})


def test_a_constrained_request_waits_outside_the_queue_until_its_grammar_is_ready():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, structured_outputs=_JSON))
    s.add_request(make_request("free", 3, start=300))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"free"}
    assert s.get_request("g").status == RequestStatus.WAITING_FOR_FSM and not s.waiting
    s.wait_for_grammar(0.0)  # returns at once: nothing is ready
    grammars.compile(0, ScriptedMatcher([5, 6], eos=2))
    so, _ = step(s, lambda r: 7)
    assert "g" in so.num_scheduled_tokens
    assert so.structured_output_request_ids == {"g": 0}  # its prompt completes this step: it samples
    row = so.grammar_bitmask[0]
    assert row[0] == 1 << 5 and not row[1:].any()


def test_only_constrained_requests_that_sample_get_a_bitmask_row():
    s = Scheduler(make_config(max_num_batched_tokens=4))
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 6, eos=2, structured_outputs=_JSON))
    grammars.compile(0, ScriptedMatcher([5], eos=2))
    so, _ = step(s)  # a mid-prompt chunk samples nothing
    assert so.structured_output_request_ids == {} and so.grammar_bitmask is None
    s.add_request(make_request("free", 1, start=300))
    so, outs = step(s, lambda r: 5 if r.request_id == "g" else 7)
    assert so.structured_output_request_ids == {"g": 0} and so.grammar_bitmask.shape[0] == 1
    assert outputs_by_id(outs)["g"].new_token_ids == [5]


def test_two_constrained_requests_get_their_own_rows_in_batch_order():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g0", 3, structured_outputs=_JSON))
    s.add_request(make_request("g1", 3, start=300, structured_outputs=_JSON))
    grammars.compile(0, ScriptedMatcher([33], eos=2))
    grammars.compile(1, ScriptedMatcher([4], eos=2))
    so = s.schedule()
    assert so.structured_output_request_ids == {"g0": 0, "g1": 1}
    rows = so.grammar_bitmask
    assert rows.shape == (2, 32)
    assert (rows[0, 1], rows[1, 0]) == (1 << 1, 1 << 4) and rows[0, 0] == 0 and rows[1, 1] == 0


def test_a_ready_grammar_joins_the_queue_while_an_earlier_one_still_compiles():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("slow", 3, structured_outputs=_JSON))
    s.add_request(make_request("quick", 3, start=300, structured_outputs=_JSON))
    grammars.compile(1, ScriptedMatcher([5], eos=2))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"quick"}
    assert s.get_request("slow").status == RequestStatus.WAITING_FOR_FSM
    assert s.make_stats().num_waiting_reqs == 1


def test_a_grammar_that_fails_to_compile_finishes_its_request_with_the_error_at_its_frontend():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("bad", 3, structured_outputs=_JSON, client_index=2))
    grammars.fail(0, "invalid json: nope")
    so = s.schedule()
    assert so.num_scheduled_tokens == {}
    outs = s.update_from_output(so, ModelRunnerOutput.empty())
    (o,) = outs[2].outputs
    assert (o.request_id, o.new_token_ids, o.finish_reason, o.error) == (
        "bad",
        [],
        FinishReason.ERROR,
        "invalid json: nope",
    )
    assert not s.has_unfinished_requests() and not s.has_finished_requests()
    assert s.update_from_output(s.schedule(), ModelRunnerOutput.empty()) == {}  # reported once


def test_a_token_the_grammar_refuses_fails_the_request_and_logs_that_the_mask_forbade_it(caplog):
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, structured_outputs=_JSON, max_tokens=5))
    s_params = s.get_request("g").sampling_params
    grammars.compile(0, ScriptedMatcher([5, 6], eos=2))
    with caplog.at_level(logging.ERROR, logger="vllm_lite.scheduler"):
        got = run_to_completion(s, lambda r: 5 if r.num_output_tokens == 0 else 40)["g"]
    out = [t for o in got for t in o.new_token_ids]
    assert out == [5, 40] and got[-1].finish_reason == FinishReason.ERROR
    assert got[-1].error == "structured outputs: sampled token 40 is not allowed by the grammar"
    (rec,) = caplog.records
    assert rec.getMessage() == (
        "request g: its grammar refused sampled token 40 after 1 accepted tokens; its mask forbids that token "
        f"(1 tokens allowed), sampling params {s_params}"
    )


def test_a_refused_token_past_the_masks_width_is_reported_as_forbidden(caplog):
    s = Scheduler(make_config())  # vocab 1000: 32 words, 1024 bits
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, structured_outputs=_JSON))
    grammars.compile(0, ScriptedMatcher([5], eos=2))
    with caplog.at_level(logging.ERROR, logger="vllm_lite.scheduler"):
        got = run_to_completion(s, lambda r: 1024)["g"]
    assert got[-1].finish_reason == FinishReason.ERROR
    (rec,) = caplog.records
    assert "sampled token 1024 after 0 accepted tokens; its mask forbids that token (1 tokens allowed)" in (
        rec.getMessage()
    )


def test_a_refused_token_the_mask_allowed_is_logged_as_the_backends_fault(caplog):
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, structured_outputs=_JSON))
    matcher = ScriptedMatcher([65], eos=2)
    matcher.accept_tokens = lambda ids: False  # type: ignore[method-assign]
    grammars.compile(0, matcher)
    with caplog.at_level(logging.ERROR, logger="vllm_lite.scheduler"):
        run_to_completion(s, lambda r: 65)
    (rec,) = caplog.records
    assert rec.getMessage().startswith(
        "request g: its grammar refused sampled token 65 after 0 accepted tokens; its mask allows that token "
        "(1 tokens allowed), sampling params "
    )


def test_eos_that_ends_the_grammar_finishes_the_request_even_when_eos_is_ignored():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, ignore_eos=True, structured_outputs=_JSON, max_tokens=10))
    grammars.compile(0, ScriptedMatcher([5], eos=2))
    got = run_to_completion(s, lambda r: 5 if r.num_output_tokens == 0 else 2)["g"]
    assert [t for o in got for t in o.new_token_ids] == [5, 2]
    assert got[-1].finish_reason == FinishReason.STOP and got[-1].error is None


def test_a_grammar_complete_before_eos_runs_on_until_eos():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    s.add_request(make_request("g", 3, eos=2, structured_outputs=_JSON, max_tokens=10))
    grammars.compile(0, ScriptedMatcher([5, 6], eos=2, complete_at_end=True))
    got = run_to_completion(s, lambda r: [5, 6, 2][r.num_output_tokens])["g"]
    assert [t for o in got for t in o.new_token_ids] == [5, 6, 2] and got[-1].finish_reason == FinishReason.STOP
    assert [len(o.new_token_ids) for o in got] == [1, 1, 1]


def test_a_token_equal_to_eos_does_not_finish_a_grammar_that_is_not_terminated():
    s = Scheduler(make_config())
    grammars = ControlledGrammars(s)
    # The script itself contains the EOS id; accepting it does not terminate the grammar.
    s.add_request(make_request("g", 3, eos=2, ignore_eos=True, structured_outputs=_JSON, max_tokens=3))
    grammars.compile(0, ScriptedMatcher([2, 5, 6], eos=2))
    got = run_to_completion(s, lambda r: [2, 5, 6][r.num_output_tokens])["g"]
    assert [t for o in got for t in o.new_token_ids] == [2, 5, 6] and got[-1].finish_reason == FinishReason.LENGTH


def _tight_with_a_grammar_request() -> tuple[Scheduler, ScriptedMatcher]:
    """tight_scheduler() holding "a" (7 tokens) and "g" (7 tokens, its grammar compiled: 5, 6, 8, 9, 10, 11, then EOS 2),
    which collide at their third block: "g", the later arrival, is the one preempted."""
    s = tight_scheduler()
    grammars = ControlledGrammars(s)
    s.add_request(make_request("a", 7, start=0, max_tokens=4))
    s.add_request(make_request("g", 7, start=100, eos=2, structured_outputs=_JSON, max_tokens=6))
    matcher = ScriptedMatcher([5, 6, 8, 9, 10, 11], eos=2)
    grammars.compile(0, matcher)
    return s, matcher


def test_a_request_resumed_after_preemption_has_its_matcher_resynced_to_its_kept_outputs(caplog):
    s, matcher = _tight_with_a_grammar_request()
    script = iter(range(0, 100))
    seen_preempt = False
    resynced_to = None
    for _ in range(40):
        so, _ = step(s, lambda r: matcher.script[r.num_output_tokens] if r.request_id == "g" else next(script))
        if "g" in so.finished_req_ids:
            seen_preempt = True
            matcher.reset()  # as if the preempted matcher had drifted: resync must restore it
        if seen_preempt and any(r.req_id == "g" for r in so.scheduled_new_reqs):
            resynced_to = list(s.get_request("g").output_token_ids)
            assert matcher.accepted == resynced_to[: len(matcher.accepted)]
            break
    assert seen_preempt and resynced_to
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_resumed_request_whose_outputs_no_longer_fit_its_grammar_is_logged(caplog):
    s, matcher = _tight_with_a_grammar_request()
    step(s, lambda r: 5 if r.request_id == "g" else 7)
    step(s, lambda r: 6 if r.request_id == "g" else 7)
    so, _ = step(s)
    assert so.finished_req_ids == {"g"}  # preempted by recompute, outputs [5, 6] kept
    matcher.reset()
    matcher.script = [99] * 6  # the grammar no longer takes the kept outputs
    with caplog.at_level(logging.ERROR, logger="vllm_lite.scheduler"):
        while not any(r.req_id == "g" for r in so.scheduled_new_reqs):
            so, _ = step(s, lambda r: 99 if r.request_id == "g" else 7)
    assert [r.getMessage() for r in caplog.records] == ["request g: its kept output tokens no longer match its grammar"]


def test_waiting_for_grammar_blocks_only_while_a_grammar_compiles():
    s = Scheduler(make_config())
    calls = []
    s.structured_output_manager.wait_for_grammar = calls.append  # type: ignore[method-assign]
    s.wait_for_grammar(5.0)
    assert calls == []
    ControlledGrammars(s)
    s.add_request(make_request("g", 3, structured_outputs=_JSON))
    s.wait_for_grammar(5.0)
    assert calls == [5.0]


# ---------------------------------------------------------------------- speculative decoding
def _spec(k: int = 3, **cfg) -> Scheduler:
    config = make_config(**cfg)
    config.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    return Scheduler(config)


def _verify(s: Scheduler, so, sampled: dict[str, list[int]], proposed: dict[str, list[int]]):
    """A verification step's runner output: per request its emitted tokens and its next drafts."""
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        ids,
        {r: i for i, r in enumerate(ids)},
        [sampled.get(r, []) for r in ids],
        spec_token_ids=[proposed.get(r, []) for r in ids],
    )
    return s.update_from_output(so, mro)


def test_drafts_run_after_the_last_token_and_rejected_ones_are_computed_again():
    s = _spec()
    s.add_request(make_request("a", 4, max_tokens=20))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}
    _verify(s, so, {"a": [7]}, {"a": [8, 9, 10]})
    a = s.get_request("a")
    assert a.spec_token_ids == [8, 9, 10]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    outs = _verify(s, so, {"a": [8, 9, 11]}, {"a": [12]})  # two drafts held, the third replaced
    assert outputs_by_id(outs)["a"].new_token_ids == [8, 9, 11]
    assert a.num_tokens == 8 and a.num_computed_tokens == 7  # the rejected draft's slot is rewritten next step
    stats = outs[0].scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 2} and so.scheduled_spec_decode_tokens == {"a": [12]}


def test_the_budget_cuts_drafts_short_and_a_one_token_step_runs_none():
    s = _spec(max_num_batched_tokens=3)
    s.add_request(make_request("a", 3, max_tokens=20))
    _verify(s, s.schedule(), {"a": [7]}, {"a": [8, 9, 10]})
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [8, 9]}
    _verify(s, so, {"a": [8, 9, 5]}, {"a": [1, 2, 3]})
    s.max_num_batched_tokens = 1
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and so.scheduled_spec_decode_tokens == {}


def test_a_victim_scheduled_earlier_in_the_step_loses_its_drafts_too():
    s = _spec(k=1, num_gpu_blocks=5, block_size=4, max_model_len=16, policy="priority", enable_prefix_caching=False)
    s.add_request(make_request("low", 6, start=0, priority=1))
    s.add_request(make_request("high", 8, start=100, priority=0))
    _verify(s, s.schedule(), {"low": [7], "high": [7]}, {"low": [5], "high": []})
    # low runs its 7th token + a draft (fits its second block); high, at 9 tokens, needs a third block: low goes.
    so = s.schedule()
    assert so.finished_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    assert so.scheduled_spec_decode_tokens == {}
    assert s.get_request("low").spec_token_ids == []


def test_several_tokens_in_one_step_take_their_own_logprob_rows():
    s = _spec()
    s.add_request(make_request("a", 3, logprobs=1))
    s.add_request(make_request("b", 3, start=300, logprobs=1))
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    lp = LogprobsTensors(
        torch.arange(4, dtype=torch.int64).view(4, 1), torch.zeros(4, 1), torch.ones(4, dtype=torch.int64)
    )
    mro = ModelRunnerOutput(ids, {"a": 0, "b": 1}, [[5, 6, 7], [8]], lp, logprobs_cu=[0, 3])
    outs = outputs_by_id(s.update_from_output(so, mro))
    assert outs["a"].new_logprobs.logprob_token_ids.tolist() == [[0], [1], [2]]
    assert outs["b"].new_logprobs.logprob_token_ids.tolist() == [[3]]


def test_spec_counters_go_to_the_first_frontend_only():
    s = _spec()
    s.add_request(make_request("a", 3, client_index=0, max_tokens=20))
    s.add_request(make_request("b", 3, start=300, client_index=1, max_tokens=20))
    _verify(s, s.schedule(), {"a": [7], "b": [7]}, {"a": [1], "b": [1]})
    outs = _verify(s, s.schedule(), {"a": [1, 2], "b": [3]}, {})
    assert outs[0].scheduler_stats.spec_decoding_stats.num_drafts == 2
    assert outs[1].scheduler_stats.spec_decoding_stats is None
    assert s.make_stats().spec_decoding_stats is None  # consumed by the step


# ---------------------------------------------------------------------- pooling requests
def _pooling_request(rid: str, n: int, start: int = 0, client_index: int = 0) -> Request:
    return Request(
        rid, list(range(start, start + n)), None, None, 0.0, client_index=client_index, pooling_params=PoolingParams()
    )


def test_a_pooling_request_runs_its_whole_prompt_in_one_step_without_a_prefix_hit():
    s = Scheduler(make_config(block_size=4))
    s.add_request(make_request("warm", 8, start=0, max_tokens=1))
    run_to_completion(s)
    req = _pooling_request("p", 9, client_index=2)
    s.add_request(req)
    so = s.schedule()
    (nr,) = so.scheduled_new_reqs
    assert so.num_scheduled_tokens == {"p": 9} and nr.num_computed_tokens == 0
    assert nr.pooling_params is req.pooling_params
    pooled = torch.ones(3)
    mro = ModelRunnerOutput(["p"], {"p": 0}, [[]], pooler_output=[pooled])
    (o,) = s.update_from_output(so, mro)[2].outputs
    assert o.pooling_output is pooled and o.finish_reason == FinishReason.STOP and o.new_token_ids == []
    assert not s.has_unfinished_requests() and s.num_free_blocks == s.num_total_blocks


def test_a_pooling_request_finishing_does_not_hide_the_rest_of_the_batch():
    s = Scheduler(make_config())
    s.add_request(_pooling_request("p", 4))
    s.add_request(make_request("g", 3, start=300))
    so = s.schedule()
    mro = ModelRunnerOutput(["p", "g"], {"p": 0, "g": 1}, [[], [7]], pooler_output=[torch.ones(2), None])
    outs = outputs_by_id(s.update_from_output(so, mro))
    assert outs["p"].finish_reason == FinishReason.STOP and outs["g"].new_token_ids == [7]
    assert list(s.requests) == ["g"] and [r.request_id for r in s.running] == ["g"]


def test_a_pooling_request_waits_for_a_budget_that_holds_its_whole_prompt():
    s = Scheduler(make_config(max_num_batched_tokens=6))
    s.add_request(_pooling_request("p", 7))
    s.add_request(make_request("behind", 2, start=300))
    so = s.schedule()
    assert so.num_scheduled_tokens == {}  # never chunked; the queue behind it waits too (FCFS)
    s.max_num_batched_tokens = 7
    so = s.schedule()
    assert so.num_scheduled_tokens == {"p": 7}
