"""Async scheduling end to end (issue #14): `LLM(..., async_scheduling=True)` against the same engine with it off, on
the tiny float32 llama (CPU): identical tokens, finish reasons, logprobs and prompt logprobs for greedy, seeded
random, penalties, min_tokens, stop tokens (a request that stops while the next step already holds it) and LoRA;
and the runner really ran two steps in flight (a launch while the previous step's tokens were still unread).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest

from vllm_lite import SamplingParams
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter

PROMPTS = [
    [1, 5, 9, 20, 33],
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [7, 8],
    [40, 41, 42],
    [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [60, 61, 62, 63],
]


def _generate(
    async_scheduling: bool,
    params: list[SamplingParams],
    prompts: list[list[int]] = PROMPTS,
    loras: Optional[list[Optional[LoRARequest]]] = None,
    **kw: Any,
) -> tuple[list, int]:
    """Outputs (tokens, finish reason, logprobs, prompt logprobs per request) and how many launches found the
    previous step's tokens still unread."""
    from vllm_lite.entrypoints.llm import LLM

    args = dict(model=get_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=128, multiprocess=False)
    with LLM(async_scheduling=async_scheduling, **{**args, **kw}) as llm:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.executor.worker.model_runner
        preempt = core.scheduler._preempt

        def counted_preempt(*a: Any) -> Any:
            preemptions[0] += 1
            return preempt(*a)

        preemptions = [0]
        core.scheduler._preempt = counted_preempt
        assert runner.async_scheduling is async_scheduling
        overlapped = [0]
        orig = runner.execute_model

        def execute_model(so, non_block: bool = False):
            prev = runner._prev
            if non_block and prev is not None and prev.tokens is None:
                overlapped[0] += 1
            return orig(so, non_block=non_block) if non_block else orig(so)

        runner.execute_model = execute_model
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    _generate.preemptions = preemptions[0]  # type: ignore[attr-defined]
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), c.finish_reason, c.logprobs, o.prompt_logprobs))
    return res, overlapped[0]


def _check_same(params: list[SamplingParams], **kw: Any) -> list:
    sync, none = _generate(False, params, **kw)
    asyn, overlapped = _generate(True, params, **kw)
    assert none == 0 and overlapped > 0  # the async engine launched while a step was in flight
    assert [r[:2] for r in asyn] == [r[:2] for r in sync]
    assert [r[2] for r in asyn] == [r[2] for r in sync]  # logprobs (dicts of floats), exact
    assert [r[3] for r in asyn] == [r[3] for r in sync]
    return sync


def test_greedy_seeded_and_logprobs_are_identical() -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=7, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=14, ignore_eos=True),
    ]
    sync = _check_same(params)
    assert [len(r[0]) for r in sync] == [16, 12, 10, 7, 3, 14]
    assert sync[2][2] is not None and sync[2][3] is not None


def test_penalties_and_min_tokens_are_identical() -> None:
    first = _generate(False, [SamplingParams(temperature=0.0, max_tokens=1)], prompts=PROMPTS[:1])[0][0][0][0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[first]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    sync = _check_same(params, prompts=PROMPTS[:4])
    assert first not in sync[0][0][:4]


def test_requests_stopping_mid_batch_on_a_stop_token_are_identical() -> None:
    """A stop token ends a request at update(N) while step N+1 already runs it (its extra token is dropped); the
    others run on in batches the sync engine never had (float32 rows do not depend on their neighbours)."""
    base = _generate(False, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 6)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[base[i][0][2 + i]]) if i % 2 == 0 else
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i in range(6)
    ]  # fmt: skip
    sync = _check_same(params)
    assert [r[1] for r in sync] == ["stop", "length"] * 3
    assert [len(r[0]) for r in sync][::2] == [3, 5, 7]


def test_lora_requests_are_identical(tmp_path) -> None:
    llama = get_checkpoint("llama")
    loras = [
        LoRARequest(
            f"a{i}", i + 1, build_lora_adapter(llama, os.path.join(tmp_path, f"a{i}"), AdapterSpec(8, 16, seed=i))
        )
        for i in range(2)
    ]
    which = [loras[0], None, loras[1], loras[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 4
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    sync = _check_same(params, prompts=PROMPTS[:4], loras=which, **kw)
    base = _generate(False, params, prompts=PROMPTS[:4])[0]
    assert sync[0][0] != base[0][0]  # the adapters did change the tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_kv_cache_is_identical(mode: str) -> None:
    """9 blocks of 16 tokens for 6 requests of up to 92 tokens: requests are preempted (some while their token is
    in flight) and come back by recompute or swap-in."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=70, ignore_eos=True),
    ] * 3
    kw = dict(kv_cache_memory_bytes=9 * 12288, preemption_mode=mode, swap_space=0.01)  # tiny llama: 12288 B a block
    sync, _ = _generate(False, params, **kw)
    assert _generate.preemptions > 0  # type: ignore[attr-defined]
    asyn, overlapped = _generate(True, params, **kw)
    assert _generate.preemptions > 0 and overlapped > 0  # type: ignore[attr-defined]
    assert [r[:2] for r in asyn] == [r[:2] for r in sync]
    assert all(len(r[0]) == 70 for r in sync)


def test_bfloat16_same_batch_is_identical() -> None:
    """bf16 (the CPU prefill computes only the sampling rows past the last attention, logits_rows): the same
    batches run in both modes when nothing stops early, so the tokens are identical too."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ] * 3
    _check_same(params, dtype="bfloat16")
