"""The V1 scheduler on a real KV cache manager, driven by a fake model runner that picks each sampled token."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_lite.core.messages import FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.testing.scheduler_driver import fake_runner_output, make_request, outputs_by_id, step, tight_scheduler
from vllm_lite.worker.step import LogprobsTensors, ModelRunnerOutput


# ---------------------------------------------------------------------- budget and chunking
def test_long_prompt_is_chunked_to_the_token_budget():
    s = Scheduler(make_config(max_num_batched_tokens=8))
    s.add_request(make_request("a", 20))
    chunks = []
    for _ in range(3):
        so, outs = step(s)
        chunks.append(so.num_scheduled_tokens["a"])
        assert so.total_num_scheduled_tokens <= 8
        if len(chunks) < 3:
            assert outs == {}  # mid-prompt: nothing sampled, nothing emitted
    assert chunks == [8, 8, 4]
    assert outputs_by_id(outs)["a"].new_token_ids == [7]
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.num_computed_tokens == [20]


def test_decode_and_prefill_chunk_share_one_step():
    s = Scheduler(make_config(max_num_batched_tokens=8))
    s.add_request(make_request("a", 4))
    step(s)
    s.add_request(make_request("b", 20, start=500))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [5, 7]


def test_long_prefill_token_threshold_caps_each_chunk():
    s = Scheduler(make_config(max_num_batched_tokens=64, long_prefill_token_threshold=5))
    s.add_request(make_request("a", 12))
    s.add_request(make_request("b", 3, start=300))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}


def test_max_num_seqs_limits_running_requests():
    s = Scheduler(make_config(max_num_seqs=2))
    for i in range(4):
        s.add_request(make_request(f"r{i}", 3, start=10 * i))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert s.make_stats().num_waiting_reqs == 2


def test_request_never_runs_past_max_model_len():
    s = Scheduler(make_config(max_model_len=10, max_num_batched_tokens=64))
    s.add_request(make_request("a", 8, max_tokens=100))
    finish = None
    total = []
    while s.has_unfinished_requests():
        so, outs = step(s)
        total.append(so.num_scheduled_tokens.get("a", 0))
        o = outputs_by_id(outs).get("a")
        if o is not None and o.finished:
            finish = o
    # 8 prompt tokens sample the 9th; one decode samples the 10th, which ends the request at max_model_len.
    assert total == [8, 1]
    assert s.kv_cache_manager.num_free_blocks == s.num_total_blocks
    assert finish.finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------------- ordering
def test_fcfs_admits_in_arrival_order():
    s = Scheduler(make_config(max_num_seqs=1))
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 3, start=ord(rid), max_tokens=1))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["a", "b", "c"]


def test_priority_policy_admits_smallest_priority_value_then_earliest():
    s = Scheduler(make_config(max_num_seqs=1, policy="priority"))
    s.add_request(make_request("low", 3, priority=5, max_tokens=1))
    s.add_request(make_request("high1", 3, priority=0, max_tokens=1, start=50))
    s.add_request(make_request("high2", 3, priority=0, max_tokens=1, start=90))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["high1", "high2", "low"]


# ---------------------------------------------------------------------- preemption
def test_fcfs_preempts_latest_arrival():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)  # both prefill (2 blocks each), each samples 1 -> 8 tokens
    step(s)  # position 7 fits in block 2 for both
    so, outs = step(s)  # a needs a 3rd block: b, the later arrival, is preempted
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids("b") == []
    assert next(iter(s.waiting)) is b
    assert outs[0].scheduler_stats.num_preemptions == 1


def test_priority_preempts_largest_priority_value_even_if_already_scheduled():
    s = tight_scheduler(policy="priority")
    s.add_request(make_request("a", 6, start=0, priority=1))
    s.add_request(make_request("b", 7, start=100, priority=0))
    step(s)
    step(s)
    # a (7 tokens) fits; b (9 tokens) needs a block: the victim is a, scheduled earlier this step.
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.total_num_scheduled_tokens == 1
    assert so.finished_req_ids == {"a"}
    assert s.get_request("a").status == RequestStatus.PREEMPTED
    assert so.scheduled_cached_reqs.req_ids == ["b"]


def test_priority_preempts_the_requester_itself_when_it_is_lowest():
    s = tight_scheduler(policy="priority")
    s.add_request(make_request("a", 7, start=0, priority=3))
    s.add_request(make_request("b", 7, start=100, priority=0))
    step(s)
    step(s)
    # Both need a 3rd block; a asks first but is itself the lowest priority, so it steps aside for b.
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.finished_req_ids == {"a"}
    assert s.get_request("a").status == RequestStatus.PREEMPTED
    assert outs[0].scheduler_stats.num_preemptions == 1


def test_recompute_round_trip_resends_prompt_and_outputs():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0, max_tokens=3))
    s.add_request(make_request("b", 7, start=100, max_tokens=10))
    gen = itertools.count(500)
    tokens = lambda r: next(gen)  # noqa: E731
    step(s, tokens)
    step(s, tokens)
    so, _ = step(s, tokens)
    assert so.finished_req_ids == {"b"}
    b = s.get_request("b")
    b_outputs = list(b.output_token_ids)
    assert len(b_outputs) == 2
    resumed = None
    while resumed is None:
        so, _ = step(s, tokens)
        resumed = next((r for r in so.scheduled_new_reqs if r.req_id == "b"), None)
    assert resumed.prompt_token_ids == list(range(100, 107))
    assert resumed.output_token_ids == b_outputs
    assert resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == 9  # prompt + both outputs are recomputed
    assert s.get_request("b").num_preemptions == 1
    while s.has_unfinished_requests():
        step(s, tokens)
    assert s.num_free_blocks == s.num_total_blocks


def test_swap_round_trip_restores_blocks_and_progress():
    s = tight_scheduler(preemption_mode="swap", num_cpu_blocks=8)
    s.add_request(make_request("a", 7, start=0, max_tokens=3))
    s.add_request(make_request("b", 7, start=100, max_tokens=10))
    step(s)
    step(s)
    b_blocks = s.kv_cache_manager.get_block_ids("b")
    so, _ = step(s)
    b = s.get_request("b")
    assert b.status == RequestStatus.SWAPPED
    assert so.finished_req_ids == {"b"}
    assert [d for d, _ in so.blocks_to_swap_out] == b_blocks
    host = [h for _, h in so.blocks_to_swap_out]
    b_outputs = list(b.output_token_ids)
    assert b.num_computed_tokens == 8 and b.num_tokens == 9
    # a finishes after its third token; then b comes back.
    swapped_in = None
    while swapped_in is None:
        so, _ = step(s)
        if so.blocks_to_swap_in:
            swapped_in = so
    assert [h for h, _ in swapped_in.blocks_to_swap_in] == host
    (nr,) = swapped_in.scheduled_new_reqs
    assert nr.req_id == "b" and nr.num_computed_tokens == 8
    assert nr.block_ids[: len(host)] == [d for _, d in swapped_in.blocks_to_swap_in]
    assert nr.output_token_ids == b_outputs
    assert swapped_in.num_scheduled_tokens == {"b": 1}
    assert s.kv_cache_manager.host_pool.get_num_free_blocks() == 8
    while s.has_unfinished_requests():
        step(s)
    assert s.num_free_blocks == s.num_total_blocks


def test_swap_falls_back_to_recompute_when_host_space_is_full():
    s = tight_scheduler(preemption_mode="swap", num_cpu_blocks=1)
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    so, _ = step(s)
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and so.blocks_to_swap_out == []
    assert b.num_computed_tokens == 0


# ---------------------------------------------------------------------- prefix caching
def test_prefix_cache_hit_across_requests_skips_full_blocks():
    s = Scheduler(make_config(block_size=4))
    shared = list(range(10))
    s.add_request(make_request("a", shared + [50, 51], max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(make_request("b", shared + [60, 61, 62]))
    so, outs = step(s)
    (nr,) = so.scheduled_new_reqs
    assert nr.num_computed_tokens == 8  # blocks [0..3], [4..7]; block 3 differs
    assert so.num_scheduled_tokens == {"b": 5}
    stats = outs[0].scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 8)
    assert s.get_request("b").num_cached_tokens == 8


def test_prefix_cache_hit_on_a_running_request_shares_its_blocks():
    s = Scheduler(make_config(block_size=4))
    s.add_request(make_request("a", 9))
    step(s)
    s.add_request(make_request("b", 9))
    so, _ = step(s)
    nr = so.scheduled_new_reqs[0]
    assert nr.num_computed_tokens == 8
    assert nr.block_ids[:2] == s.kv_cache_manager.get_block_ids("a")[:2]


def test_cache_salt_separates_prefix_cache_entries():
    s = Scheduler(make_config(block_size=4))
    s.add_request(make_request("a", 9, cache_salt="x", max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(make_request("b", 9, cache_salt="y"))
    s.add_request(make_request("c", 9, cache_salt="x"))
    so, _ = step(s)
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert computed == {"b": 0, "c": 8}


def test_lru_eviction_reuses_oldest_freed_blocks_first():
    s = Scheduler(make_config(num_gpu_blocks=6, block_size=4))  # 5 usable
    s.add_request(make_request("a", 8, start=0, max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    s.add_request(make_request("b", 8, start=100, max_tokens=1))
    while s.has_unfinished_requests():
        step(s)
    # c needs 3 blocks: the never-used block, then a's (freed first), leaving b's cached.
    s.add_request(make_request("c", 12, start=200, max_tokens=1))
    step(s)
    kv = s.kv_cache_manager
    assert kv.get_computed_blocks(make_request("pa", list(range(0, 8)) + [1]))[1] == 0
    assert kv.get_computed_blocks(make_request("pb", list(range(100, 108)) + [1]))[1] == 8


def test_reset_prefix_cache_only_when_idle():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 9, max_tokens=2))
    step(s)
    assert s.reset_prefix_cache() is False
    while s.has_unfinished_requests():
        step(s)
    assert s.reset_prefix_cache() is True
    s.add_request(make_request("b", 9))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


# ---------------------------------------------------------------------- stop conditions
def _run_one(req: Request, token_fn, **cfg):
    s = Scheduler(make_config(**cfg))
    s.add_request(req)
    got, last = [], None
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        _, outs = step(s, token_fn)
        o = outputs_by_id(outs).get(req.request_id)
        if o is not None:
            got += o.new_token_ids
            last = o
    return s, got, last


def test_eos_stops_with_stop_reason_none():
    seq = iter([5, 6, 2, 9])
    s, got, last = _run_one(make_request("a", 3, eos=2), lambda r: next(seq))
    assert got == [5, 6, 2]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason is None
    assert s.num_free_blocks == s.num_total_blocks


def test_ignore_eos_runs_to_max_tokens():
    _, got, last = _run_one(make_request("a", 3, eos=2, ignore_eos=True, max_tokens=4), lambda r: 2)
    assert got == [2, 2, 2, 2] and last.finish_reason == FinishReason.LENGTH


def test_stop_token_ids_stop_and_set_stop_reason():
    seq = iter([5, 42, 9])
    _, got, last = _run_one(make_request("a", 3, stop_token_ids=[42]), lambda r: next(seq))
    assert got == [5, 42]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason == 42


def test_min_tokens_defers_eos_and_stop_tokens():
    _, got, last = _run_one(
        make_request("a", 3, eos=2, stop_token_ids=[3], min_tokens=3), lambda r: 2 + r.num_output_tokens % 2
    )
    assert got == [2, 3, 2]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason is None


def test_max_tokens_caps_with_length():
    _, got, last = _run_one(make_request("a", 3, max_tokens=5), lambda r: 1)
    assert len(got) == 5 and last.finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_with_length():
    _, got, last = _run_one(make_request("a", 6, max_tokens=None), lambda r: 1, max_model_len=9)
    assert len(got) == 3 and last.finish_reason == FinishReason.LENGTH


def test_eos_wins_over_length_on_the_same_token():
    _, got, last = _run_one(make_request("a", 3, eos=2, max_tokens=1), lambda r: 2)
    assert got == [2] and last.finish_reason == FinishReason.STOP


# ---------------------------------------------------------------------- abort
def test_abort_frees_blocks_and_tells_the_worker():
    s = Scheduler(make_config(max_num_batched_tokens=8))
    s.add_request(make_request("a", 20))
    step(s)
    assert s.num_free_blocks < s.num_total_blocks
    done = s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a"] and done[0].status == RequestStatus.FINISHED_ABORTED
    assert s.num_free_blocks == s.num_total_blocks
    assert not s.has_unfinished_requests()
    assert s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED) == []
    assert s.has_finished_requests()
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.num_scheduled_tokens == {}
    assert not s.has_finished_requests()


def test_abort_while_step_in_flight_emits_nothing():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4, start=300))
    so = s.schedule()
    mro = fake_runner_output(s, so)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, mro)
    assert set(outputs_by_id(outs)) == {"b"}
    assert s.kv_cache_manager.get_block_ids("a") == []


def test_abort_of_waiting_request_never_sent_to_worker():
    s = Scheduler(make_config(max_num_seqs=1))
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4, start=300))
    step(s)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    so = s.schedule()
    assert so.finished_req_ids == set() and s.get_num_unfinished_requests() == 1


def test_finish_requests_rejects_unfinished_status():
    s = Scheduler(make_config())
    with pytest.raises(ValueError, match="finished_status"):
        s.finish_requests("a", RequestStatus.RUNNING)


# ---------------------------------------------------------------------- outputs and stats
def test_outputs_grouped_by_client_with_logprob_rows():
    s = Scheduler(make_config())
    s.add_request(make_request("a", 3, client_index=0, logprobs=1))
    s.add_request(make_request("b", 3, client_index=2, start=50))
    so = s.schedule()
    outs = s.update_from_output(so, fake_runner_output(s, so, logprobs=True))
    assert set(outs) == {0, 2}
    (a,) = outs[0].outputs
    (b,) = outs[2].outputs
    idx = list(so.num_scheduled_tokens).index("a")
    assert a.new_logprobs.logprob_token_ids.tolist() == [[idx]]
    assert b.new_logprobs is None  # b did not ask for logprobs
    assert outs[0].scheduler_stats.num_running_reqs == 2


def test_prompt_logprobs_chunk_is_emitted_without_new_tokens():
    s = Scheduler(make_config(max_num_batched_tokens=4))
    s.add_request(make_request("a", 10, prompt_logprobs=1))
    so = s.schedule()
    mro = fake_runner_output(s, so)
    plp = LogprobsTensors(torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2), torch.ones(4, dtype=torch.int64))
    mro.prompt_logprobs_dict["a"] = plp
    outs = s.update_from_output(so, mro)
    (o,) = outs[0].outputs
    assert o.new_token_ids == [] and o.new_prompt_logprobs_tensors is plp and not o.finished


def test_make_stats_reports_usage_and_resets_counters():
    s = tight_scheduler()
    s.add_request(make_request("a", 7, start=0))
    s.add_request(make_request("b", 7, start=100))
    step(s)
    step(s)
    s.schedule()  # preempts b; no update, so the counters are still pending
    stats = s.make_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 1
    assert stats.num_total_blocks == 4 and stats.num_free_blocks == 1
    assert stats.kv_cache_usage == pytest.approx(0.75)
    assert stats.num_preemptions == 1
    assert s.make_stats().num_preemptions == 0


# ---------------------------------------------------------------------- validation
def test_add_request_validates_input():
    s = Scheduler(make_config(max_model_len=16))
    with pytest.raises(TypeError, match="Request"):
        s.add_request("a")  # type: ignore[arg-type]
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("long", 17))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("empty", []))


def test_scheduler_requires_block_counts_and_valid_modes():
    cfg = make_config()
    cfg.cache_config.num_gpu_blocks = None
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(cfg)
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(make_config(preemption_mode="drop"))
    with pytest.raises(ValueError, match="policy"):
        Scheduler(make_config(policy="lifo"))


def test_max_model_len_is_capped_by_kv_cache_capacity():
    s = Scheduler(make_config(num_gpu_blocks=3, block_size=4, max_model_len=100))
    assert s.max_model_len == 8
    with pytest.raises(ValueError, match="max_model_len=8"):
        s.add_request(make_request("a", 9))
    s.add_request(make_request("b", 6, max_tokens=50))
    while s.has_unfinished_requests():
        _, outs = step(s)
    assert s.num_free_blocks == 2


# ---------------------------------------------------------------------- end to end on the real model runner
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_real_model_greedy_tokens_unchanged_by_preemption_and_prefix_hits(mode, monkeypatch):
    """A cramped cache (preemptions, swaps) with prefix caching gives the same greedy tokens as a roomy one."""
    import json
    import os

    from vllm_lite import LLM
    from vllm_lite.testing.checkpoints import get_checkpoint

    path = get_checkpoint("llama")
    hf = json.load(open(os.path.join(path, "config.json")))
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    block_bytes = 2 * hf["num_hidden_layers"] * 4 * kv_heads * head_dim * 4  # float32, block_size 4
    shared = [(j * 13) % 150 + 7 for j in range(16)]
    prompts = [[(i * 37 + j * 11) % 200 + 5 for j in range(n)] for i, n in enumerate([5, 20, 33, 9, 40])]
    prompts += [shared + [i + 3] * (i + 1) for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(**kw) -> list[list[int]]:
        llm = LLM(model=path, multiprocess=False, dtype="float32", max_model_len=64, block_size=4, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    reference = run(enable_prefix_caching=False)
    preemptions: list[int] = []
    original = Scheduler._preempt

    def counting(self, req, swap_out):
        preemptions.append(len(swap_out))
        original(self, req, swap_out)
        preemptions[-1] = len(swap_out) - preemptions[-1]  # > 0 when this preemption swapped

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    cramped = run(
        preemption_mode=mode,
        kv_cache_memory_bytes=block_bytes * 30,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        swap_space=block_bytes * 40 / (1 << 30),
    )
    assert cramped == reference
    assert preemptions, "the cramped run never preempted: the test lost its point"
    if mode == "swap":
        assert any(n > 0 for n in preemptions)


# ---------------------------------------------------------------------- host fast paths (issue #14)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_full_block_is_cached_exactly_when_its_step_comes_back(async_scheduling: bool) -> None:
    """update_from_output skips cache_blocks while no new block is full: the cached count must still follow
    the computed tokens block for block, through a chunked prompt and the decodes after it."""
    cfg = make_config(max_num_batched_tokens=6)
    cfg.scheduler_config.async_scheduling = async_scheduling
    sched = Scheduler(cfg)
    req = make_request("a", 9, max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    kv = sched.kv_cache_manager
    pending = []
    seen = set()
    while sched.has_unfinished_requests() or pending:
        if sched.has_unfinished_requests():
            so = sched.schedule()
            ids = list(so.num_scheduled_tokens)
            pending.append((so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[7] for _ in ids])))
        if async_scheduling and len(pending) < 2 and sched.has_unfinished_requests():
            continue
        so, mro = pending.pop(0)
        sched.update_from_output(so, mro)
        if sched.get_request("a") is None:
            break
        known = min(req.num_computed_tokens - sched._scheduled_later(req), req.num_tokens)
        assert kv.num_cached_block.get("a", 0) == known // 4
        seen.add(known // 4)
    assert seen >= set(range(1, 7))  # blocks 1..6 each became cached at some step


def test_full_blocks_are_cached_exactly_when_they_fill_through_preemption_and_recompute():
    """The cache_blocks fast path with preemption (recompute) and prefix-cache hits on readmission: after each
    step every running request has exactly its full computed blocks registered, no fewer (skipped) and the
    recomputed request gets its earlier blocks back from the cache."""
    s = Scheduler(make_config(num_gpu_blocks=9, block_size=4, max_model_len=32, max_num_batched_tokens=64))
    kv = s.kv_cache_manager
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 6, start=10 * i, max_tokens=14, ignore_eos=True))
    preemptions = hits = 0
    while s.has_unfinished_requests():
        _, outs = step(s)
        preemptions += sum(o.scheduler_stats.num_preemptions for o in outs.values())
        hits += sum(o.scheduler_stats.prefix_cache_hits for o in outs.values())
        for req in s.running:
            full = min(req.num_computed_tokens, req.num_tokens) // 4
            assert kv.num_cached_block.get(req.request_id, 0) == min(full, len(kv.get_blocks(req.request_id)))
    assert preemptions > 0
    assert hits > 0  # a preempted request found its own blocks again


def test_full_blocks_are_cached_exactly_when_they_fill_through_spec_decode_rollbacks():
    """Speculative decoding: each verified step keeps one of its three drafts and rolls the others back; a block
    counts as full only over the accepted tokens, so after each step exactly the blocks full of kept tokens are
    registered (none holding a rejected draft, none skipped by the cache_blocks fast path)."""
    from vllm_lite.config import SpeculativeConfig

    cfg = make_config(block_size=4, max_model_len=64)
    cfg.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    s = Scheduler(cfg)
    kv = s.kv_cache_manager
    s.add_request(make_request("a", 5, max_tokens=30, ignore_eos=True))
    verified = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled, proposals = [], []
        for rid in ids:
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            verified += bool(drafts)
            sampled.append(drafts[:1] + [9])  # the first draft accepted, the rest rejected, one bonus token
            proposals.append([5, 6, 7])
        mro = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, spec_token_ids=proposals)
        s.update_from_output(so, mro)
        req = s.get_request("a")
        if req is not None:
            assert kv.num_cached_block.get("a", 0) == min(req.num_computed_tokens, req.num_tokens) // 4
    assert verified > 3
