"""best_of as vLLM defines it: generate best_of sequences, return the n with the highest cumulative logprob.

The oracle is the engine itself: child i of a seeded best_of request samples with
seed + i, so the same best_of sequences can be generated separately as n=1
requests and ranked by hand. A best_of that is dropped returns the first
sequence(s) instead, which the tests rule out by choosing seeds where the best
sequence is not the first.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import RequestOutputKind
from vllm_lite.testing.checkpoints import get_checkpoint

PROMPT = "The for statement is used to iterate over"
SAMPLE = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
BEST_OF = 4


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=256)
    yield engine
    engine.shutdown()


def _separate(llm: LLM, seed: int, count: int) -> list[tuple[list[int], float, str]]:
    """(token ids, cumulative logprob, text) of the samples child seed+i would draw, generated as n=1 requests."""
    params = [SamplingParams(seed=seed + i, logprobs=0, **SAMPLE) for i in range(count)]
    outs = llm.generate([PROMPT] * count, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob, o.outputs[0].text) for o in outs]


def _seed_where_first_is_not_best(llm: LLM, top: int) -> tuple[int, list[tuple[list[int], float, str]]]:
    """A seed whose top `top` samples (by cumulative logprob) are not samples 0..top-1, so ignoring best_of shows."""
    for seed in range(0, 400, BEST_OF):
        samples = _separate(llm, seed, BEST_OF)
        order = sorted(range(BEST_OF), key=lambda i: samples[i][1], reverse=True)
        if sorted(order[:top]) != list(range(top)):
            return seed, samples
    raise AssertionError("no seed found where best_of would change the answer")  # pragma: no cover


def test_n1_best_of_returns_the_sample_with_the_highest_cumulative_logprob(llm: LLM) -> None:
    seed, samples = _seed_where_first_is_not_best(llm, 1)
    best_ids, best_lp, best_text = max(samples, key=lambda s: s[1])
    (out,) = llm.generate(PROMPT, SamplingParams(n=1, best_of=BEST_OF, seed=seed, **SAMPLE), use_tqdm=False)
    (c,) = out.outputs
    assert c.index == 0
    assert list(c.token_ids) == best_ids
    assert c.text == best_text
    assert c.cumulative_logprob == pytest.approx(max(s[1] for s in samples), abs=1e-4)
    assert c.cumulative_logprob == pytest.approx(best_lp, abs=1e-4)
    assert c.logprobs is None  # the caller asked for none; ranking needed them only inside


def test_n2_best_of_returns_the_top_two_best_first_with_their_logprobs(llm: LLM) -> None:
    seed, samples = _seed_where_first_is_not_best(llm, 2)
    ranked = sorted(samples, key=lambda s: s[1], reverse=True)
    params = SamplingParams(n=2, best_of=BEST_OF, seed=seed, logprobs=1, **SAMPLE)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [list(c.token_ids) for c in out.outputs] == [s[0] for s in ranked[:2]]
    for c, (_, lp, _) in zip(out.outputs, ranked):
        assert c.cumulative_logprob == pytest.approx(lp, abs=1e-4)
        assert len(c.logprobs) == SAMPLE["max_tokens"]
        assert sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids)) == pytest.approx(lp, abs=1e-4)


def test_best_of_through_the_streaming_engine_emits_only_the_ranked_final(llm: LLM) -> None:
    """LLMEngine.step with DELTA output: one output, finished, holding the best sample's whole text."""
    seed, samples = _seed_where_first_is_not_best(llm, 1)
    best_ids, _, best_text = max(samples, key=lambda s: s[1])
    engine = llm.llm_engine
    params = SamplingParams(best_of=BEST_OF, seed=seed, output_kind=RequestOutputKind.DELTA, **SAMPLE)
    engine.add_request("bo-delta", PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "bo-delta"]
    (final,) = outs
    assert final.finished and len(final.outputs) == 1
    assert list(final.outputs[0].token_ids) == best_ids
    assert final.outputs[0].text == best_text


def test_best_of_through_async_llm_matches_llm(llm: LLM) -> None:
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    seed, samples = _seed_where_first_is_not_best(llm, 1)
    best_ids = max(samples, key=lambda s: s[1])[0]

    async def run() -> list:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=get_checkpoint("llama"), dtype="float32", max_model_len=256)
        )
        try:
            params = SamplingParams(best_of=BEST_OF, seed=seed, **SAMPLE)
            return [o async for o in engine.generate(PROMPT, params, "bo-async")]
        finally:
            engine.shutdown()

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished
    assert list(outs[0].outputs[0].token_ids) == best_ids


def test_best_of_rules_follow_vllm() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(best_of=2, temperature=0.0)
    assert SamplingParams(best_of=1, temperature=0.0).num_samples == 1
    assert SamplingParams(n=2, best_of=5).num_samples == 5
    assert SamplingParams(n=3).num_samples == 3
