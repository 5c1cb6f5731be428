"""The greedy list path of a verify step (issue 20, the host cost of batch-1 n-gram speculation on CUDA): a few
all-greedy rows that no logits processor touches are verified with the scheduler's draft lists and recorded from
lists (GPUModelRunner._verified_greedy, SpecDecodeStep.verify_greedy, greedy_verify_lists, record_emitted_lists,
DraftBudget.observe on lists). Each piece must equal the table path it stands in for, and the engine must take it
(and still emit what plain decoding does, with every row's positions in one slice and gathered from a mixed batch).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import SamplingParams as Params
from vllm_lite.spec_decode import rejection_sampler as rs
from vllm_lite.spec_decode.draft_budget import DraftBudget
from vllm_lite.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, greedy_verify, greedy_verify_lists
from vllm_lite.testing.spec_outputs import (
    REPEATING,
    assert_same_outputs,
    assert_same_recording,
    record_requests,
    recording_batches,
    tiny_llm,
    token_prompts,
)
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.spec_decode_step import SpecDecodeStep, record_emitted, record_emitted_lists
from vllm_lite.worker.step import NewRequestData


# ---------------------------------------------------------------------------------------------- verification
@settings(max_examples=80, deadline=None)
@given(
    b=st.integers(1, 8),
    k=st.integers(0, 5),
    host_fast=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_verify_lists_emit_greedy_verifys_tokens(b, k, host_fast, seed) -> None:
    """Each row's emitted tokens are greedy_verify's row up to its placeholders, whatever the row's draft count
    (k or fewer) and whether the argmax runs through numpy (CPU fast path) or torch (the device form)."""
    gen = torch.Generator().manual_seed(seed)
    v = 4  # a small vocabulary: drafts often agree, whole rows are accepted too
    logits = torch.randn((b, k + 1, v), generator=gen)
    best = logits[:, :k].argmax(dim=2)
    agree = torch.rand((b, k), generator=gen) < 0.7
    drafts = torch.where(agree, best, torch.randint(0, v, (b, k), generator=gen))
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    lists = [drafts[i, : int(num_draft[i])].tolist() for i in range(b)]
    ref = greedy_verify(logits, drafts, num_draft)
    old, rs.HOST_FAST_PATHS = rs.HOST_FAST_PATHS, host_fast
    try:
        got = greedy_verify_lists(logits, lists)
    finally:
        rs.HOST_FAST_PATHS = old
    for i in range(b):
        row = ref.output_token_ids[i].tolist()
        assert got[i] == [t for t in row if t != PLACEHOLDER_TOKEN_ID]
        assert all(type(t) is int for t in got[i])


def test_greedy_verify_lists_rejects_more_drafts_than_positions() -> None:
    logits = torch.zeros((2, 3, 5))
    with pytest.raises(ValueError, match="at most 2 drafts"):
        greedy_verify_lists(logits, [[1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"\[1, k\+1, V\]"):
        greedy_verify_lists(logits, [[1]])


def test_verify_greedy_splits_the_flat_logits_by_row() -> None:
    """SpecDecodeStep.verify_greedy reads row i's positions at i*reps ..: a row's positions are its own."""
    v, reps = 6, 3
    logits = torch.full((2 * reps, v), -1.0)
    for pos, tok in enumerate([1, 2, 3, 4, 5, 0]):
        logits[pos, tok] = 1.0
    assert SpecDecodeStep.verify_greedy(logits, [[1, 2], [4]], reps) == [[1, 2, 3], [4, 5]]


# ---------------------------------------------------------------------------------------------- recording
@settings(max_examples=80, deadline=None)
@given(
    reqs=record_requests(),
    data=st.data(),
)
def test_record_emitted_lists_equals_record_emitted(reqs, data) -> None:
    """Emitted lists recorded row by row leave the batch as record_emitted's table does: token rows, counts (past
    max_model_len too), output counts, bad-word history and penalty tables (rows that track tokens included)."""
    vocab, k = 32, 3
    batches, rng = recording_batches(reqs, vocab)
    rows = [batches[0].req_id_to_row[f"r{i}"] for i in data.draw(st.permutations(list(range(len(reqs)))))]
    num_emitted = data.draw(st.lists(st.integers(1, k + 1), min_size=len(rows), max_size=len(rows)))
    table = rng.integers(0, vocab, size=(len(rows), k + 1))
    table[np.arange(k + 1)[None, :] >= np.array(num_emitted)[:, None]] = PLACEHOLDER_TOKEN_ID
    record_emitted_lists(batches[0], rows, [row[:n].tolist() for row, n in zip(table, num_emitted)])
    record_emitted(batches[1], np.array(rows, dtype=np.int64), table, np.array(num_emitted, dtype=np.int64))
    got, ref = batches
    assert np.array_equal(got.token_ids, ref.token_ids)
    assert_same_recording(got, ref, rows)


def test_record_emitted_lists_rejects_tokens_outside_the_vocabulary() -> None:
    batch = InputBatch(2, 16, 2, 8, torch.device("cpu"))
    batch.add_request(NewRequestData("r", [1, 2], [], Params(temperature=0.0), [1], 0, 2))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        record_emitted_lists(batch, [batch.req_id_to_row["r"]], [[3, 8]])


def test_budget_observe_takes_lists_as_it_takes_arrays() -> None:
    a, b = DraftBudget(4), DraftBudget(4)
    ids = ["x", "y", "z"]
    a.observe(ids, np.array([3, 0, 2]), np.array([1, 0, 2]))
    b.observe(ids, [3, 0, 2], [1, 0, 2])
    assert [a.acceptance(r) for r in ids] == [b.acceptance(r) for r in ids]
    assert a.acceptance("x") != a.acceptance("y"), "a verified row's average moved, a row without drafts did not"
    with pytest.raises(ValueError, match="one count per request"):
        b.observe(ids, [1, 2], [0, 0])


# ---------------------------------------------------------------------------------------------- the engine
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(**kwargs: Any) -> LLM:
    return tiny_llm(kv_cache_memory_bytes=4 << 20, **kwargs)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    base = _llm()
    with pytest.MonkeyPatch.context() as mp:  # drafts at every batch step (the batch rule is tested elsewhere)
        mp.setattr(SpecDecodeStep, "gain_rule", False)
        spec = _llm(speculative_config=SPEC)
    yield base, spec
    base.shutdown()
    spec.shutdown()


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    calls: dict[str, list] = {"greedy": [], "verify": []}
    greedy, verify = SpecDecodeStep.verify_greedy, SpecDecodeStep.verify

    def spy_greedy(logits: torch.Tensor, drafts: list[list[int]], reps: int) -> list[list[int]]:
        calls["greedy"].append((reps, [len(d) for d in drafts]))
        return greedy(logits, drafts, reps)

    def spy_verify(*a: Any, **kw: Any) -> Any:
        calls["verify"].append(1)
        return verify(*a, **kw)

    monkeypatch.setattr(SpecDecodeStep, "verify_greedy", staticmethod(spy_greedy))
    monkeypatch.setattr(SpecDecodeStep, "verify", staticmethod(spy_verify))
    return calls


def _accepted(llm: LLM) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.spec.total.num_accepted_tokens


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_requests_verify_through_lists_and_emit_plain_decodings_tokens(engines, monkeypatch, batch) -> None:
    """Greedy requests without logprobs verify on the list path (never SpecDecodeStep.verify) and emit what plain
    decoding does; batch 3 verifies rows with different draft counts (positions gathered, padding repeated)."""
    base, spec = engines
    calls = _spy(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    before = _accepted(spec)
    prompts = token_prompts(REPEATING[:batch])
    got = spec.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(base.generate(prompts, params, use_tqdm=False), got)
    assert _accepted(spec) > before, "no draft was accepted: the comparison proves nothing"
    assert calls["greedy"] and not calls["verify"]
    if batch > 1:
        assert any(min(counts) < reps - 1 for reps, counts in calls["greedy"]), "no step with mixed draft counts"


def test_logprobs_and_sampled_requests_verify_through_the_table_path(engines, monkeypatch) -> None:
    """What the greedy list path does not cover (logprobs, random rows) verifies through SpecDecodeStep.verify."""
    base, spec = engines
    calls = _spy(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    prompts = token_prompts(REPEATING[:1])
    assert_same_outputs(
        base.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False), logprobs=True
    )
    assert calls["verify"] and not calls["greedy"]
    calls["verify"].clear()
    # A random row (temperature > 0) that stays close enough to the repeating prompt for the lookup to find drafts
    # whatever the device's random streams (at 0.8 the H100's draws for seed 1 found none: nothing was verified).
    spec.generate(prompts, SamplingParams(temperature=0.1, max_tokens=24, seed=1, ignore_eos=True), use_tqdm=False)
    assert calls["verify"] and not calls["greedy"]


@pytest.mark.parametrize("batch", [1, 3])
def test_seeded_sampled_requests_emit_what_they_emit_without_speculation(engines, monkeypatch, batch) -> None:
    """Seeded random rows with n-gram drafts (point masses: one race draw per emitted token) verify on the table
    path and finish on lists (a few rows, no logprobs): the same tokens as plain decoding with the same seeds."""
    base, spec = engines
    calls = _spy(monkeypatch)
    params = [SamplingParams(temperature=0.1, max_tokens=32, seed=s, ignore_eos=True) for s in range(batch)]
    before = _accepted(spec)
    prompts = token_prompts(REPEATING[:batch])
    got = spec.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(base.generate(prompts, params, use_tqdm=False), got)
    assert _accepted(spec) > before, "no draft was accepted: the comparison proves nothing"
    assert calls["verify"] and not calls["greedy"]
