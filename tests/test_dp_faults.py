"""Faults under data parallelism (two private engine cores on CPU): aborts per rank, and one core killed.

An abort goes to the rank that owns the request and frees its blocks there while the other requests
on both ranks run on to the end, with the tokens they give when nothing is aborted. A core killed
with SIGKILL makes the whole client dead: the caller's next `step` raises EngineDeadError (the
client polls its cores' processes), it never hangs, and the surviving core is stopped on shutdown.
The kill test runs last: it ends the module's engine.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Iterator

import pytest

from vllm_lite import SamplingParams
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.llm_engine import LLMEngine
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.waiting import wait_until

BLOCK = 16
DEADLINE_S = 60.0
SURVIVOR_TOKENS = 24


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    args = EngineArgs(
        model=get_checkpoint("llama"),
        data_parallel_size=2,
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        max_num_seqs=8,
        enable_prefix_caching=False,  # every freed block is free, none kept for reuse
    )
    eng = LLMEngine.from_engine_args(args)
    yield eng
    eng.shutdown()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def rank_call(engine: LLMEngine, rank: int, method: str) -> Any:
    return engine.engine_core.clients[rank].call_utility(method)


def used_blocks(engine: LLMEngine, rank: int) -> int:
    return rank_call(engine, rank, "get_num_total_blocks") - rank_call(engine, rank, "get_num_free_blocks")


def run_to_end(engine: LLMEngine, finished: dict[str, Any]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out


def test_abort_on_each_rank_frees_its_blocks_there_and_the_others_run_on(engine: LLMEngine) -> None:
    long_prompt = list(range(100, 100 + 6 * BLOCK))  # six full blocks each, so a leak would show
    survivors = {f"s{i}": [200 + i, 300 + i, 400 + i] for i in range(2)}
    victims = {f"v{i}": [500 + i, *long_prompt] for i in range(2)}
    for rid, prompt in {**victims, **survivors}.items():
        n = 900 if rid in victims else SURVIVOR_TOKENS  # victims cannot end on their own before the checks
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(n))
    owner = {rid: engine.engine_core.core_for(rid) for rid in [*victims, *survivors]}
    assert {owner[r] for r in victims} == {0, 1} and {owner[r] for r in survivors} == {0, 1}, owner
    # Every victim has run its prefill (holds its blocks) before it is aborted.
    seen: dict[str, int] = {}
    finished: dict[str, Any] = {}
    while not all(seen.get(r, 0) >= 2 for r in victims):
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert all(used_blocks(engine, r) >= 6 for r in (0, 1))
    engine.abort_request(list(victims))
    # A core takes an abort before a later utility call of the same frontend: no waiting needed. The
    # survivors need at most two blocks each (3 + 24 tokens); the victims' seven are back on their rank.
    for rank in (0, 1):
        assert used_blocks(engine, rank) <= 2, f"rank {rank} still holds its aborted request's blocks"
    run_to_end(engine, finished)
    assert set(finished) <= set(survivors), f"aborted requests produced a finished output: {set(finished)}"
    for rid in survivors:
        out = finished[rid]
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == SURVIVOR_TOKENS
    for rank in (0, 1):
        assert rank_call(engine, rank, "get_num_unfinished_requests") == 0
        assert used_blocks(engine, rank) == 0, f"rank {rank} leaked blocks"
    # Same prompts with nothing aborted around them: the same tokens.
    for rid, prompt in survivors.items():
        engine.add_request(f"{rid}-again", {"prompt_token_ids": prompt}, greedy(SURVIVOR_TOKENS))
    again: dict[str, Any] = {}
    run_to_end(engine, again)
    for rid in survivors:
        assert again[f"{rid}-again"].outputs[0].token_ids == finished[rid].outputs[0].token_ids


def test_kill_9_of_one_core_raises_engine_dead_error_and_stops_the_other(engine: LLMEngine) -> None:
    for i in range(4):
        engine.add_request(f"k{i}", {"prompt_token_ids": [600 + i, 601, 602]}, greedy(200))
    owners = {engine.engine_core.core_for(f"k{i}") for i in range(4)}
    assert owners == {0, 1}
    engine.step()
    victim, survivor = (c.proc for c in engine.engine_core.clients)
    os.kill(victim.pid, signal.SIGKILL)

    raised: list[BaseException] = []
    done = threading.Event()

    def step_until_dead() -> None:
        try:
            while True:
                engine.step()
        except BaseException as e:  # noqa: BLE001 -- handed to the test thread
            raised.append(e)
        finally:
            done.set()

    # Stepping in a daemon thread: a hang fails the test at the deadline instead of stalling the suite.
    threading.Thread(target=step_until_dead, daemon=True, name="dp-step").start()
    assert done.wait(DEADLINE_S), "step() still blocked after one core was killed"
    assert isinstance(raised[0], EngineDeadError), raised
    assert engine.engine_core.is_dead
    with pytest.raises(EngineDeadError):
        engine.add_request("after", {"prompt_token_ids": [1, 2, 3]}, greedy(2))
    engine.shutdown()
    assert victim.exitcode == -9
    wait_until(lambda: not survivor.is_alive(), DEADLINE_S, "the surviving core stopped")
