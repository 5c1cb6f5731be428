"""Draft-model speculative decoding end to end (issue 20): a one-layer draft of a tiny float32 Llama (same
tokenizer) proposes, the target verifies. Greedy outputs and logprobs equal plain decoding (prefix caching,
chunked prefill, forced preemption, in-process, and a multiprocess engine with tensor-parallel ranks); the
target as its own draft gets every proposal accepted (which fails if the draft's KV cache ever misses a token)
and the vllm:spec_decode_* counters say exactly that; sampled requests (a real draft q, not a point mass) keep
the target's distribution.

Each comparison also asserts that drafts were accepted and (for the one-layer draft) rejected, so it cannot pass
by never speculating or by never exercising the rollback.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.testing.chi_square import chi_square_homogeneity_pvalue
from vllm_lite.testing.draft_checkpoints import get_target_and_draft
from vllm_lite.testing.spec_outputs import assert_same_outputs, token_counts, token_prompts

K = 3
# The distribution test fails below this p-value; its draws come from a fixed torch seed, so its outcome is fixed.
SIGNIFICANCE = 1e-3
PROMPTS = [
    [5, 6, 7, 8, 9, 10] * 3 + [5, 6, 7],
    [40, 41, 42, 43] * 4 + [40],
    [17, 1203, 845, 77, 1500, 9, 333, 1024, 64],
    [1999, 3, 1400, 250, 88],
]
# One block of the tiny Llama (3 layers) and its draft (1 layer): 16 tokens x 2 (K, V) x 2 heads x 16 dims x 4 bytes.
BLOCK_BYTES = (3 + 1) * 16 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    return get_target_and_draft("llama")


def _llm(target: str, draft: str | None = None, **kwargs: Any) -> LLM:
    spec = {"model": draft, "num_speculative_tokens": K} if draft else None
    kwargs.setdefault("multiprocess", False)
    kwargs.setdefault("kv_cache_memory_bytes", 4 << 20)
    if not kwargs["multiprocess"]:
        kwargs["disable_log_stats"] = True
    return LLM(model=target, dtype="float32", max_model_len=128, num_threads=1, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def base(models) -> Iterator[LLM]:
    llm = _llm(models[0])
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec(models) -> Iterator[LLM]:
    llm = _llm(*models)
    yield llm
    llm.shutdown()


def _total(llm: LLM) -> SpecDecodingStats:
    return llm.llm_engine.engine_core.engine_core.scheduler.spec.total


def test_draft_kv_cache_is_sized_with_the_target_on_the_same_block_ids(spec: LLM) -> None:
    """One block id addresses a block in every target layer's cache and every draft layer's: the budget is split
    by the bytes of both, and all caches have the same number of blocks."""
    runner = spec.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.kv_cache_bytes_per_block() == BLOCK_BYTES
    assert len(runner.kv_caches) == 3 + 1
    assert {c.shape[1] for c in runner.kv_caches} == {(4 << 20) // BLOCK_BYTES}


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)


def test_greedy_tokens_and_logprobs_equal_plain_decoding(base: LLM, spec: LLM) -> None:
    before = (_total(spec).num_draft_tokens, _total(spec).num_accepted_tokens)
    expected = base.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    got = spec.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert_same_outputs(expected, got, logprobs=True, text=False)
    drafted = _total(spec).num_draft_tokens - before[0]
    accepted = _total(spec).num_accepted_tokens - before[1]
    assert 0 < accepted < drafted, "the run must both accept and reject drafts to prove anything"


def test_proposal_lengths_back_off_after_rejected_drafts_and_outputs_stay_plain(base: LLM, spec: LLM) -> None:
    """Adaptive draft lengths: a request whose drafts were all rejected gets a shorter proposal next (fewer draft
    passes); proposals never exceed the length asked for; greedy outputs are still plain decoding's."""
    step = spec.llm_engine.engine_core.engine_core.executor.worker.model_runner.spec_decode
    asked_and_got: list[tuple[list[int], list[int]]] = []
    original = step.draft.propose

    def spy(batch, inputs, s_idx, is_driver, lengths=None):  # type: ignore[no-untyped-def]
        out = original(batch, inputs, s_idx, is_driver, lengths)
        asked_and_got.append((lengths.tolist(), [len(out[i]) for i in s_idx.tolist()]))
        return out

    step.draft.propose = spy
    try:
        got = spec.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    finally:
        del step.draft.propose
    assert_same_outputs(base.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False), got, logprobs=True, text=False)
    assert all(n <= m for asked, got_n in asked_and_got for m, n in zip(asked, got_n))
    assert any(m < K for asked, _ in asked_and_got for m in asked), "no request backed off after a rejection"
    assert any(m == K for asked, _ in asked_and_got for m in asked)


def test_backed_off_requests_skip_draft_passes_then_catch_up_through_preemption() -> None:
    """A weak draft (the undamped target's first layer: ~3% accepted): requests back off to no drafts, so the
    draft skips their passes and its KV falls behind; after PROBE_INTERVAL plain steps each probes again, its
    catch-up pass starting where its draft KV ends (also after a forced preemption). Greedy tokens and logprobs
    equal plain decoding of that target."""
    target, draft = get_target_and_draft("llama", damping=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True)
    plain = _llm(target)
    try:
        expected = plain.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    finally:
        plain.shutdown()
    llm = _llm(target, draft, kv_cache_memory_bytes=12 * BLOCK_BYTES, max_num_batched_tokens=24)
    try:
        engine = llm.llm_engine.engine_core.engine_core
        step = engine.executor.worker.model_runner.spec_decode
        preempted: list[Any] = []
        original_preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda req, swap_out: (preempted.append(req), original_preempt(req, swap_out))
        caught_up: list[int] = []  # tokens in each catch-up pass that started behind the target
        original_propose = step.draft.propose

        def spy(batch, inputs, s_idx, is_driver, lengths=None):  # type: ignore[no-untyped-def]
            behind = {r: n for r, n in step.draft._behind.items() if r in inputs.req_ids}
            out = original_propose(batch, inputs, s_idx, is_driver, lengths)
            caught_up.extend(
                int(batch.num_tokens[batch.req_id_to_row[r]]) - n
                for r, n in behind.items()
                if r not in step.draft._behind
            )
            return out

        step.draft.propose = spy
        got = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        total = _total(llm)
    finally:
        llm.shutdown()
    assert_same_outputs(expected, got, logprobs=True, text=False)
    assert preempted, "the small KV cache should have forced a preemption"
    assert caught_up and max(caught_up) > K + 1, "no request caught up over the passes it skipped"
    assert total.num_drafts < len(PROMPTS) * 40 // 4, "backed-off requests should mostly decode without drafts"


def test_target_as_its_own_draft_still_accepts_everything_after_skipped_passes(base: LLM, models) -> None:
    """Proposal lengths forced to 0 on alternate 4-step windows (as a backed-off request's are): the draft skips
    those passes and must catch up over every token it missed, or its KV (the target's own weights here) would
    lack them and some proposal would be rejected."""
    llm = _llm(models[0], models[0])
    try:
        step = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.spec_decode
        real = step.lengths.for_step
        calls = [0]

        def windows(req_ids):  # type: ignore[no-untyped-def]
            calls[0] += 1
            lengths = real(req_ids)
            return lengths * 0 if (calls[0] // 4) % 2 else lengths

        step.lengths.for_step = windows
        params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True)
        got = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        total = _total(llm)
    finally:
        llm.shutdown()
    assert_same_outputs(base.generate(token_prompts(PROMPTS), params, use_tqdm=False), got, logprobs=True, text=False)
    assert calls[0] >= 8, "the run should span skipped and drafted windows"
    assert 0 < total.num_accepted_tokens == total.num_draft_tokens


def test_prefix_cache_hits_blocks_written_by_draft_steps(base: LLM, spec: LLM) -> None:
    """A prompt extending an earlier speculative run hits that run's blocks: the draft's KV in them (written by
    catch-up passes, rejected drafts rewritten) must be right, or its proposals and the counters would drift and,
    worse, a cached rejected token would change the target's continuation."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = spec.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)[0]
    extended = PROMPTS[0] + list(first.outputs[0].token_ids)[:30]
    follow = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    before = _total(spec).num_accepted_tokens
    got = spec.generate(token_prompts([extended]), follow, use_tqdm=False)
    assert got[0].num_cached_tokens >= 48, "the extended prompt should hit the blocks of the first run"
    assert _total(spec).num_accepted_tokens > before
    assert_same_outputs(
        base.generate(token_prompts([extended]), follow, use_tqdm=False), got, logprobs=True, text=False
    )


def test_penalised_and_grammar_requests_are_drafted_and_keep_their_outputs(base: LLM, spec: LLM) -> None:
    """Draft-model proposals for requests with penalties (counted per verified position) and a grammar (one
    bitmask row per position): tokens and logprobs are plain decoding's, and drafts were accepted."""
    regex = StructuredOutputsParams(regex="(ab|cd)+e")
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=-0.4, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=regex, logprobs=1),
    ]
    prompts = token_prompts(PROMPTS[:3])
    before = _total(spec).num_accepted_tokens
    expected = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(expected, got, logprobs=True, text=False)
    assert _total(spec).num_accepted_tokens > before


def test_forced_preemption_and_chunked_prefill_keep_greedy_outputs(base: LLM, models) -> None:
    """Room for 12 blocks and 24-token steps: prompts are chunked (the draft catches up chunk by chunk) and
    requests preempt each other (their lookahead slots included)."""
    llm = _llm(*models, kv_cache_memory_bytes=12 * BLOCK_BYTES, max_num_batched_tokens=24)
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        preempted = []
        original = sched._preempt
        sched._preempt = lambda req, swap_out: (preempted.append(req), original(req, swap_out))
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        got = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        accepted = _total(llm).num_accepted_tokens
    finally:
        llm.shutdown()
    assert preempted, "the small KV cache should have forced a preemption"
    assert accepted > 0
    assert_same_outputs(base.generate(token_prompts(PROMPTS), params, use_tqdm=False), got, text=False)


def test_target_as_its_own_draft_accepts_everything_and_counts_it(base: LLM, models) -> None:
    """k = 3, 13 tokens each: after the prefill's token, three verified steps of 3 drafts + 1 bonus token, every
    draft accepted; the per-position counters and the vLLM series say exactly that."""
    llm = _llm(models[0], models[0])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=13, logprobs=1, ignore_eos=True)
        got = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        total = _total(llm)
    finally:
        llm.shutdown()
    assert_same_outputs(base.generate(token_prompts(PROMPTS), params, use_tqdm=False), got, logprobs=True, text=False)
    n = 3 * len(PROMPTS)
    assert total.counters() == {
        "vllm:spec_decode_num_drafts": n,
        "vllm:spec_decode_num_draft_tokens": K * n,
        "vllm:spec_decode_num_accepted_tokens": K * n,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [n] * K,
    }
    assert total.mean_acceptance_length == K + 1


def test_sampled_drafts_keep_the_target_distribution(base: LLM, spec: LLM) -> None:
    """Unseeded sampled requests get drafts sampled from the draft's softmax (a real q, accepted with min(1, p/q)).
    Chi-square homogeneity test at significance 1e-3 of the 2nd and 3rd tokens of 300 runs with speculation
    against 300 seeded runs without. The engine runs in this process: the global torch seed is fixed for the
    speculative runs (fork_rng restores the caller's stream), so the outcome is fixed."""
    n = 300
    prompt = token_prompts([PROMPTS[1]])
    with_spec = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    without = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    before = _total(spec).num_accepted_tokens
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        got = spec.generate(prompt * n, with_spec, use_tqdm=False)
    expected = base.generate(prompt * n, without, use_tqdm=False)
    assert _total(spec).num_accepted_tokens > before, "no sampled draft was accepted"
    for position in (1, 2):
        pvalue = chi_square_homogeneity_pvalue(token_counts(got, position), token_counts(expected, position))
        assert pvalue > SIGNIFICANCE, f"position {position}: p = {pvalue}"


@pytest.mark.slow
def test_multiprocess_tensor_parallel_engine_with_a_draft_equals_plain_decoding(base: LLM, models) -> None:
    """The core in its own process with TP=2 ranks: the draft is sharded like the target and runs on both ranks
    (rank 0 picks the drafts and broadcasts them each pass); outputs equal in-process TP=1 plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    llm = _llm(*models, multiprocess=True, tensor_parallel_size=2, device="cpu")
    try:
        got = llm.generate(token_prompts(PROMPTS[:2]), params, use_tqdm=False)
    finally:
        llm.shutdown()
    expected = base.generate(token_prompts(PROMPTS[:2]), params, use_tqdm=False)
    for x, y in zip(expected, got, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for px, py in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert px.keys() == py.keys()
            for tok in px:
                assert abs(px[tok].logprob - py[tok].logprob) <= 1e-4  # TP sums in another order


def test_draft_probs_name_their_rows_on_the_host() -> None:
    """SpecDecodeStep.draft_probs: q for the rows whose drafts are their sampled proposal's prefix, and has_q as a
    CPU tensor equal to "q's row is not all zero" (what the verification once read back from the device); greedy
    proposals, mismatched drafts and rows without drafts are point masses."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_lite.worker.draft_model import DraftModel, DraftProposal
    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    gen = torch.Generator().manual_seed(0)
    v = 7
    probs = torch.rand(3, v, generator=gen).softmax(dim=-1)
    proposals = {
        "sampled": DraftProposal([1, 2, 3], probs),
        "greedy": DraftProposal([4, 5], None),
        "mismatch": DraftProposal([1, 1], probs[:2]),
        "none": DraftProposal([6], probs[:1]),
        "short": DraftProposal([2, 3, 4], probs),
    }
    draft = SimpleNamespace(_proposals=proposals)
    draft.draft_probs = lambda *a: DraftModel.draft_probs(draft, *a)  # the method on a stand-in's proposals
    step = SpecDecodeStep.__new__(SpecDecodeStep)
    step.draft = draft
    req_ids = ["sampled", "greedy", "mismatch", "none", "short", "unknown"]
    drafts = np.array([[1, 2, 3], [4, 5, -1], [1, 2, -1], [-1, -1, -1], [2, 3, -1], [9, -1, -1]], dtype=np.int64)
    num_draft = np.array([3, 2, 2, 0, 2, 1], dtype=np.int64)
    q, has_q = step.draft_probs(req_ids, drafts, num_draft)
    assert q is not None and has_q is not None
    assert has_q.device.type == "cpu" and has_q.dtype == torch.bool
    assert has_q.tolist() == [True, False, False, False, True, False]
    assert torch.equal(has_q, q.flatten(1).sum(dim=1) > 0)
    assert torch.equal(q[0], probs) and torch.equal(q[4, :2], probs[:2]) and not q[4, 2].any()
    assert step.draft_probs(["greedy"], drafts[1:2], num_draft[1:2]) == (None, None)
