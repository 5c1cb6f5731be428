"""`priority` through LLM, AsyncLLM and HTTP: with one sequence slot, the lower value runs first.

The order is read from what the engine reports, not from clocks: requests with the same prompt
share its blocks through the prefix cache, so whichever is admitted first computes the prompt
(0 cached tokens) and the later one finds it cached. Over HTTP, where outputs carry no cached-token
count, two prompts P (two full blocks) and P + more differ in what the second finds: P + more after
P hits both blocks (32 tokens); P after P + more hits one (the last token of P must run). With
max_num_seqs=1 a waiting request never overtakes a running one, so the multiprocess tests hold the
slot with a long request until both contenders are queued (seen in the scheduler's own counts),
then abort it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import RequestOutputKind
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.testing.waiting import async_wait_until, wait_until

BLOCK = 16
MAX_MODEL_LEN = 1024
ENGINE_KW: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 1,
    "scheduling_policy": "priority",
    "enable_prefix_caching": True,
}
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("llama")


def ids(start: int, n: int) -> list[int]:
    """A prompt of token ids of its own: no two tests' prompts share a first block."""
    return list(range(start, start + n))


BLOCKER = {"prompt_token_ids": ids(1900, 10)}  # not even one full block: it hits nothing


def greedy(n: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=kind)


# ---------------------------------------------------------------------------------------------------- LLM


def test_llm_generate_runs_lower_priority_values_first(path: str) -> None:
    prompt = {"prompt_token_ids": ids(1000, 2 * BLOCK + 8)}  # two full blocks and a partial one
    # In-process core: every request is queued before the first step, so arrival order is fixed.
    with LLM(model=path, multiprocess=False, **ENGINE_KW) as llm:
        by_priority = llm.generate([prompt] * 3, greedy(4), use_tqdm=False, priority=[2, 0, 1])
        by_arrival = llm.generate([prompt] * 3, greedy(4), use_tqdm=False, priority=[0, 0, 0])
    first_cached = 2 * BLOCK
    # Admitted first: computes the prompt; the others find its two full blocks cached.
    assert [o.num_cached_tokens for o in by_priority] == [first_cached, 0, first_cached]
    order = sorted(range(3), key=lambda i: by_priority[i].metrics.scheduled_ts)
    assert order == [1, 2, 0], "scheduled by priority value (core clock order)"
    for earlier, later in zip(order, order[1:]):  # one slot: each finished before the next started
        assert by_priority[earlier].metrics.last_token_ts <= by_priority[later].metrics.scheduled_ts
    # Equal priorities fall back to arrival; the prompt is cached now, so all hit it.
    order = sorted(range(3), key=lambda i: by_arrival[i].metrics.scheduled_ts)
    assert order == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(path: str):
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    srv = ServerThread(lambda: AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu", **ENGINE_KW)))
    yield srv
    srv.stop()


def num_waiting(server: ServerThread) -> int:
    return int(server.call(server.engine.get_stats)["num_waiting_reqs"])


def test_async_llm_schedules_the_lower_priority_value_first(server: ServerThread) -> None:
    llm = server.engine
    prompt = {"prompt_token_ids": ids(300, 2 * BLOCK + 8)}

    async def main() -> dict[str, Any]:
        running = asyncio.Event()

        async def run(rid: str, p: Any, params: SamplingParams, priority: int) -> Any:
            last = None
            async for out in llm.generate(p, params, rid, priority=priority):
                last = out
                running.set()
            return last

        blocker = asyncio.ensure_future(run("blocker", BLOCKER, greedy(900, RequestOutputKind.DELTA), 0))
        await asyncio.wait_for(running.wait(), DEADLINE_S)
        low = asyncio.ensure_future(run("low", prompt, greedy(4), 1))  # arrives first, but lower priority
        await wait_queued(1)
        high = asyncio.ensure_future(run("high", prompt, greedy(4), 0))
        await wait_queued(2)
        assert not blocker.done(), "the blocker finished before both contenders were queued"
        await llm.abort("blocker")
        return {"low": await low, "high": await high, "blocker": await blocker}

    async def wait_queued(n: int) -> None:
        async def queued() -> bool:
            return (await llm.get_stats())["num_waiting_reqs"] >= n

        await async_wait_until(queued, DEADLINE_S, f"{n} requests queued")

    got = server.call(main, timeout_s=DEADLINE_S * 3)
    assert got["blocker"].outputs[0].finish_reason == "abort"
    assert got["high"].num_cached_tokens == 0, "the higher priority (lower value) request was admitted first"
    assert got["low"].num_cached_tokens == 2 * BLOCK, "the lower priority one ran after it, on its cached prompt"
    assert got["high"].metrics.last_token_ts <= got["low"].metrics.scheduled_ts


def prefix_cache_hits(server: ServerThread) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return sum(s.value for s in samples if s.name == "vllm:prefix_cache_hits_total")


def test_http_priority_field_orders_the_queue(server: ServerThread) -> None:
    p = ids(600, 2 * BLOCK)  # exactly two full blocks
    p_more = p + ids(700, 10)
    url = server.base_url + "/v1/completions"
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    hits_before = prefix_cache_hits(server)
    with httpx.Client(timeout=DEADLINE_S) as client, ThreadPoolExecutor(2) as pool:
        blocker_body = {**body, "prompt": BLOCKER["prompt_token_ids"], "max_tokens": 900, "stream": True}
        with client.stream("POST", url, json=blocker_body) as blocker:
            assert blocker.status_code == 200
            lines = blocker.iter_lines()  # kept: dropping the iterator would close the stream
            assert next(lines).startswith("data: ")  # the blocker holds the one slot
            low = pool.submit(httpx.post, url, json={**body, "prompt": p_more, "priority": 1}, timeout=DEADLINE_S)
            wait_until(lambda: num_waiting(server) >= 1, DEADLINE_S, "the low-priority request queued")
            high = pool.submit(httpx.post, url, json={**body, "prompt": p, "priority": 0}, timeout=DEADLINE_S)
            wait_until(lambda: num_waiting(server) >= 2, DEADLINE_S, "both requests queued")
            del lines  # leaving the stream aborts the blocker; the slot goes to the lower priority value
        low_r, high_r = low.result(), high.result()
    assert low_r.status_code == 200 and high_r.status_code == 200, (low_r.text, high_r.text)
    assert low_r.json()["usage"]["completion_tokens"] == high_r.json()["usage"]["completion_tokens"] == 3
    hits = prefix_cache_hits(server) - hits_before
    # P first, then P + more finds both of P's blocks: 32. The other order would give 16.
    assert hits == 2 * BLOCK, f"{hits} prefix-cache hit tokens: the low-priority request was admitted first"
