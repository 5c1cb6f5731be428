"""LoRA in the scheduler, on a real Scheduler and KV cache with made-up requests (no model).

vLLM V1's rule: at most max_loras distinct adapters among the requests that run; a waiting request whose
adapter would be one too many stays waiting (later requests may still go), running ones keep going. The
prefix cache keys blocks by adapter, so adapters share no KV with each other or with the base model.
"""

from __future__ import annotations

import pytest

from vllm_lite.config import LoRAConfig
from vllm_lite.core.kv_cache_utils import update_request_block_hashes
from vllm_lite.core.request import Request
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.testing.scheduler_driver import make_request, step


def _lora_request(rid: str, lora_id: int, prompt: int | list[int] = 6, **sp) -> Request:
    req = make_request(rid, prompt, **sp)
    if lora_id:
        req.lora_request = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")
    return req


def _scheduler(max_loras: int = 2, **kw) -> Scheduler:
    config = make_config(**kw)
    config.lora_config = LoRAConfig(max_loras=max_loras)
    return Scheduler(config)


def _distinct_loras(lora_of: dict[str, int], so) -> set[int]:
    return {lora_of[r] for r in so.num_scheduled_tokens} - {0}


def test_a_waiting_request_whose_adapter_is_one_too_many_waits_and_later_ones_go() -> None:
    sched = _scheduler(max_loras=2)
    lora_of = {"a": 1, "b": 2, "c": 3, "d": 1, "base": 0}
    for rid, lid in lora_of.items():
        sched.add_request(_lora_request(rid, lid, max_tokens=3))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "b", "d", "base"}  # c's adapter would be a third
    assert _distinct_loras(lora_of, so) == {1, 2}
    assert [r.request_id for r in sched.waiting] == ["c"]
    seen_c = False
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        assert len(_distinct_loras(lora_of, so)) <= 2
        running = {r.lora_int_id for r in sched.running} - {0}
        assert len(running) <= 2, running
        seen_c |= "c" in so.num_scheduled_tokens
    assert seen_c


def test_a_new_adapter_waits_until_a_running_one_finishes() -> None:
    sched = _scheduler(max_loras=1)
    sched.add_request(_lora_request("a", 1, max_tokens=4))
    step(sched)
    sched.add_request(_lora_request("b", 2, max_tokens=1))
    sched.add_request(_lora_request("a2", 1, max_tokens=1))  # behind b, but its adapter is running: it goes
    steps = []
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        steps.append(set(so.num_scheduled_tokens))
    assert "a2" in steps[0] and "b" not in steps[0]
    b_steps = [i for i, s in enumerate(steps) if "b" in s]
    a_steps = [i for i, s in enumerate(steps) if s & {"a", "a2"}]
    assert b_steps and min(b_steps) > max(a_steps)


def test_requests_of_the_base_model_are_not_limited() -> None:
    sched = _scheduler(max_loras=1)
    sched.add_request(_lora_request("a", 1))
    for i in range(5):
        sched.add_request(_lora_request(f"base{i}", 0))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", *(f"base{i}" for i in range(5))}


def test_block_hashes_are_keyed_by_adapter() -> None:
    prompt = list(range(100, 112))  # three full blocks of 4
    hashes = {}
    for rid, lid in (("base", 0), ("a", 1), ("b", 2), ("a-again", 1)):
        hashes[rid] = update_request_block_hashes(_lora_request(rid, lid, prompt), 4)
    assert hashes["a"] == hashes["a-again"]
    for x, y in (("base", "a"), ("base", "b"), ("a", "b")):
        assert not set(hashes[x]) & set(hashes[y]), (x, y)


def test_same_prompt_under_two_adapters_shares_no_cached_block() -> None:
    sched = _scheduler(max_loras=2)
    prompt = list(range(200, 213))
    sched.add_request(_lora_request("a", 1, prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    for rid, lid, hit in (("b", 2, 0), ("base", 0, 0), ("a-again", 1, 12)):
        req = _lora_request(rid, lid, prompt, max_tokens=1)
        sched.add_request(req)
        while sched.has_unfinished_requests():
            step(sched)
        assert req.num_cached_tokens == hit, (rid, req.num_cached_tokens)


def test_a_lora_request_is_refused_when_lora_is_off() -> None:
    sched = Scheduler(make_config())
    with pytest.raises(ValueError, match="enable_lora"):
        sched.add_request(_lora_request("a", 1))
