"""Seeded random sampling and its logprobs survive preemption by recompute, end to end.

The oracle is the same requests in an engine whose KV cache holds them all (no preemption): a seeded
request's tokens are a function of its seed and its own history only, so a request that is preempted,
recomputed and resumed must draw the same noise again and give the same tokens and logprobs.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import record_preemptions

NEW_TOKENS = 24
NUM_LOGPROBS = 3
LOGPROB_TOL = 1e-4  # recompute runs the prefix in other batches: float32 rounding only
ENGINE_KW: dict[str, Any] = {
    "dtype": "float32",
    "multiprocess": False,
    "block_size": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 24,
    "enable_prefix_caching": False,
    "preemption_mode": "recompute",
}


def params(i: int) -> SamplingParams:
    # Different warpers per request, so rows with top-k/top-p/min-p all resume their own stream.
    warp = [{}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}][i % 4]
    return SamplingParams(
        temperature=1.0, seed=1000 + i, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS, **warp
    )


def generate(llm: LLM) -> list[Any]:
    ids = llm.get_tokenizer()("The while statement is used for repeated execution", add_special_tokens=False)
    base = ids["input_ids"]
    prompts = [{"prompt_token_ids": base[: 6 + 3 * i]} for i in range(8)]
    return llm.generate(prompts, [params(i) for i in range(8)], use_tqdm=False)


@pytest.fixture(scope="module")
def runs() -> tuple[list[Any], list[Any], list[str], bool]:
    path = get_checkpoint("llama")
    mp = pytest.MonkeyPatch()
    try:
        with LLM(model=path, **ENGINE_KW) as llm:  # room for everything: nobody is preempted
            per_block = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.kv_cache_bytes_per_block()
            preempted_in_reference = record_preemptions(mp)
            reference = generate(llm)
            mp.undo()
        preempted = record_preemptions(mp)
        # 16 usable blocks of 4 tokens for 8 requests growing to 11-53 tokens: they must take turns.
        with LLM(model=path, kv_cache_memory_bytes=per_block * 17, **ENGINE_KW) as llm:
            squeezed = generate(llm)
            no_leak = llm.llm_engine.call_utility("get_num_free_blocks") == llm.llm_engine.call_utility(
                "get_num_total_blocks"
            )
    finally:
        mp.undo()
    assert not preempted_in_reference, "the reference run must not preempt"
    return reference, squeezed, preempted, no_leak


def test_the_small_cache_preempts_by_recompute_many_times(runs) -> None:
    _, _, preempted, no_leak = runs
    assert len(preempted) >= 5, f"only {len(preempted)} preemptions: the cache was not small enough"
    assert no_leak, "blocks leaked after preemptions"


def test_seeded_tokens_are_identical_with_and_without_preemption(runs) -> None:
    reference, squeezed, preempted, _ = runs
    for i, (ref, got) in enumerate(zip(reference, squeezed)):
        assert len(ref.outputs[0].token_ids) == NEW_TOKENS
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, (
            f"request {i} (preempted {preempted.count(got.request_id)}x)"
        )
    # Random sampling for real: the seeds give different streams.
    assert len({tuple(r.outputs[0].token_ids) for r in reference}) == len(reference)


def test_sample_logprobs_are_identical_with_and_without_preemption(runs) -> None:
    reference, squeezed, _, _ = runs
    for i, (ref, got) in enumerate(zip(reference, squeezed)):
        ref_lps, got_lps = ref.outputs[0].logprobs, got.outputs[0].logprobs
        assert ref_lps is not None and got_lps is not None and len(got_lps) == len(ref_lps) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(ref_lps, got_lps)):
            assert a.keys() == b.keys(), f"request {i} step {step}: logprob ids {list(b)} vs {list(a)}"
            for tid in a:
                assert a[tid].rank == b[tid].rank, f"request {i} step {step}: rank of {tid}"
                assert abs(a[tid].logprob - b[tid].logprob) < LOGPROB_TOL, f"request {i} step {step}: {tid}"
        assert got.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)
