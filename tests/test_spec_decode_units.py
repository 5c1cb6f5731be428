"""Speculative decoding building blocks: the n-gram proposer, the rejection sampler and the stats counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lite.spec_decode import draft_budget
from vllm_lite.spec_decode.draft_budget import DraftBudget
from vllm_lite.spec_decode.draft_length import AdaptiveDraftLength
from vllm_lite.spec_decode.metrics import METRIC_NAMES, SpecDecodingStats
from vllm_lite.spec_decode.ngram_proposer import NgramProposer
from vllm_lite.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    greedy_verify,
    rejection_sample,
    rejection_sample_rows,
)
from vllm_lite.testing.chi_square import chi_square_pvalue
from vllm_lite.testing.spec_outputs import assert_same_recording, record_requests, recording_batches
from vllm_lite.worker.spec_decode_step import penalties_with_drafts

# A distribution test fails when its p-value is below this; every draw is seeded, so the outcome is fixed.
SIGNIFICANCE = 1e-3


# ---------------------------------------------------------------------------------------------- draft budget
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_steps(budget: DraftBudget, clock: FakeClock, b: int, drafts: int, seconds: float, n: int = 3) -> None:
    """n decode steps of b requests with `drafts` drafts each taking `seconds` (as the runner reports them)."""
    for _ in range(n):
        budget.step_ended()
        clock.now += seconds
        budget.step_started(b, b, b + drafts, drafts)


def test_gain_rule_leaves_batch_one_alone_and_needs_the_prior_gain_before_costs_are_known() -> None:
    budget = DraftBudget(5)
    assert budget.should_search(1) and budget.trim(["a"], np.array([1])).tolist() == [1]
    ids = ["a", "b", "c", "d"]
    assert budget.min_gain(4) == draft_budget.PRIOR_GAIN_PER_REQUEST
    # acceptance 0.5 (the prior): 1 draft brings 0.5 expected tokens, under 0.5 * 4 requests -> a plain step
    assert budget.trim(ids, np.array([1, 0, 0, 0])).tolist() == [0, 0, 0, 0]
    assert budget.trim(ids, np.array([4, 0, 0, 0])).tolist() == [4, 0, 0, 0]  # 2.0 expected: verified


def test_gain_rule_prices_verify_steps_with_the_measured_step_times() -> None:
    clock = FakeClock()
    budget = DraftBudget(5, clock=clock)
    ids = ["a", "b", "c", "d"]
    timed_steps(budget, clock, 4, 0, 0.010)  # plain steps: 10 ms
    timed_steps(budget, clock, 4, 8, 0.020)  # verify steps: 20 ms, twice a plain step
    assert budget.min_gain(4) == pytest.approx(1.0 + draft_budget.MARGIN)
    assert budget.trim(ids, np.array([5, 5, 3, 0])).tolist() == [5, 5, 3, 0]  # 6.5 expected >= 4 * 1.5
    assert budget.trim(ids, np.array([5, 4, 0, 0])).tolist() == [0, 0, 0, 0]  # 4.5 expected: a plain step
    assert budget.min_gain(4) == pytest.approx(0.020 * (1 - draft_budget.STALE_DECAY) / 0.010 - 1 + draft_budget.MARGIN)
    for _ in range(50):  # kept plain again and again by that price: it falls until a verify step re-measures it
        budget.trim(ids, np.array([5, 4, 0, 0]))
    assert budget.trim(ids, np.array([5, 4, 0, 0])).tolist() == [5, 4, 0, 0]
    timed_steps(budget, clock, 4, 8, 0.020, n=1)  # one dear verify step restores the price at once
    assert budget.min_gain(4) == pytest.approx(1.0 + draft_budget.MARGIN)
    timed_steps(budget, clock, 4, 8, 0.010, n=1)  # a cheaper one moves it by COST_WEIGHT only
    assert budget._verify[4] == pytest.approx(0.020 - draft_budget.COST_WEIGHT * 0.010)
    # Not recorded: an idle engine's gap, a step with a prefill chunk, a step where not every request sampled.
    timed_steps(budget, clock, 4, 0, 10.0, n=1)
    timed_steps(budget, clock, 4, 0, 0.001, n=1)
    budget.step_started(4, 4, 60, 0)
    budget.step_started(3, 4, 4, 0)
    plain = 0.8 * 0.010 + 0.2 * 0.001
    assert budget._plain[4] == pytest.approx(plain)
    cheap = DraftBudget(5, clock=clock)  # verification as cheap as a plain step: only the margin is asked
    timed_steps(cheap, clock, 4, 0, 0.010)
    timed_steps(cheap, clock, 4, 8, 0.009)
    assert cheap.min_gain(4) == pytest.approx(draft_budget.MARGIN)
    assert cheap.trim(ids, np.array([5, 0, 0, 0])).tolist() == [5, 0, 0, 0]  # 2.5 expected >= 4 * 0.5


def test_gain_rule_times_a_plain_step_when_only_verify_steps_ran() -> None:
    clock = FakeClock()
    budget = DraftBudget(5, clock=clock)
    timed_steps(budget, clock, 2, 4, 0.010)
    assert budget.trim(["a", "b"], np.array([5, 5])).tolist() == [0, 0]  # once: a plain step to time
    timed_steps(budget, clock, 2, 0, 0.008, n=1)
    assert budget.trim(["a", "b"], np.array([5, 5])).tolist() == [5, 5]


def test_failed_lookups_back_off_and_a_growing_batch_looks_again() -> None:
    budget = DraftBudget(5)
    ids = ["a", "b", "c"]
    skipped = []
    assert budget.should_search(3)
    for _ in range(6):
        budget.trim(ids, np.zeros(3, dtype=np.int64))  # the lookup found nothing worth a verify step
        n = 0
        while not budget.should_search(3):
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, 16], skipped  # doubling after each failed look, up to MAX_SKIP
    budget.trim(ids, np.zeros(3, dtype=np.int64))
    assert not budget.should_search(3)
    assert budget.should_search(4), "a new request joined: look at once"
    assert budget.trim(ids + ["d"], np.array([5, 5, 5, 5])).tolist() == [5, 5, 5, 5]
    assert budget.should_search(4), "a verified step resets the back-off"


def test_gain_rule_sidelines_failing_requests_and_retries_them() -> None:
    budget = DraftBudget(5)
    ids = ["bad", "good"]
    for _ in range(5):
        budget.observe(ids, np.array([5, 5]), np.array([0, 5]))
    assert budget.acceptance("bad") < draft_budget.MIN_ACCEPTANCE
    assert budget.trim(["bad"], np.array([5])).tolist() == [5]  # alone: always proposes
    sat_out = 0
    while budget.trim(ids, np.array([3, 3])).tolist() == [0, 3]:
        sat_out += 1
        assert sat_out < 100, "a sidelined request must retry after a while"
    assert sat_out >= 2
    budget.forget(["bad"])
    assert budget.acceptance("bad") == draft_budget.PRIOR_ACCEPTANCE


def test_draft_budget_disable_by_batch_size_and_bad_settings() -> None:
    budget = DraftBudget(3, disable_by_batch_size=3)
    assert budget.trim(["a", "b"], np.array([2, 2])).tolist() == [2, 2]
    assert budget.trim(["a", "b", "c"], np.array([2, 2, 2])).tolist() == [0, 0, 0]
    assert not budget.should_search(3)
    assert budget.trim(["a"], np.array([3]), num_running=3).tolist() == [0]  # counts running, not sampling, rows
    off = DraftBudget(5, disable_by_batch_size=8, gain_rule=False)
    assert off.trim(list("abcd"), np.array([1, 1, 1, 1])).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        DraftBudget(3, disable_by_batch_size=1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DraftBudget(0)
    with pytest.raises(ValueError, match="one count per request"):
        budget.trim(["a"], np.array([1, 2]))


# ---------------------------------------------------------------------------------------------- n-gram proposer
def naive_ngram(history: list[int], k: int, min_n: int, max_n: int, max_model_len: int | None) -> list[int]:
    """The definition, token by token: longest n first, most recent earlier occurrence, the k tokens after it."""
    length = len(history)
    budget = k if max_model_len is None else max(0, min(k, max_model_len - length))
    for n in range(max_n, min_n - 1, -1):
        suffix = history[length - n :] if n <= length else None
        if suffix is None:
            continue
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + budget]
    return []


@settings(max_examples=150, deadline=None)
@given(
    histories=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=6),
    k=st.integers(1, 6),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    max_model_len=st.one_of(st.none(), st.integers(1, 36)),
)
def test_ngram_matches_naive_reference(histories, k, min_n, extra_n, max_model_len) -> None:
    expected = [naive_ngram(h, k, min_n, min_n + extra_n, max_model_len) for h in histories]
    for row_search_max_batch in (0, 64):  # the vectorised [B, W] search, then the per-request substring search
        proposer = NgramProposer(k, min_n, min_n + extra_n, max_model_len)
        proposer.row_search_max_batch = row_search_max_batch
        assert proposer.propose_lists(histories) == expected


# Token ids whose int64 bytes overlap when shifted (256 = 00 01 00.., 65536 = 00 00 01 ..): a byte search over the
# history finds matches that straddle tokens, which the per-request search must skip.
@settings(max_examples=150, deadline=None)
@given(
    histories=st.lists(st.lists(st.sampled_from([0, 1, 256, 257, 65536, 2**32]), max_size=30), min_size=1, max_size=4),
    k=st.integers(1, 4),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 2),
)
def test_ngram_row_search_ignores_matches_that_straddle_tokens(histories, k, min_n, extra_n) -> None:
    proposer = NgramProposer(k, min_n, min_n + extra_n)
    assert proposer.row_search_max_batch >= len(histories)  # this batch takes the per-request search
    assert proposer.propose_lists(histories) == [naive_ngram(h, k, min_n, min_n + extra_n, None) for h in histories]


def test_ngram_row_search_straddling_byte_match() -> None:
    # [1, 0]'s 16 bytes (01, 15 zeros) occur at byte offset 1 of [256, 0, 512]: not a token match.
    assert NgramProposer(2, 2, 2).propose_lists([[256, 0, 512, 7, 1, 0]]) == [[]]
    # ... and the search goes on before it to the real, earlier occurrence.
    assert NgramProposer(2, 2, 2).propose_lists([[1, 0, 9, 256, 0, 512, 7, 1, 0]]) == [[9, 256]]


@settings(max_examples=60, deadline=None)
@given(
    histories=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5),
    sampling=st.lists(st.booleans(), min_size=5, max_size=5),
    max_model_len=st.one_of(st.none(), st.integers(31, 36)),
)
def test_spec_step_small_batch_proposals_equal_the_vectorised_path(histories, sampling, max_model_len) -> None:
    """SpecDecodeStep's per-row path (propose_row on the persistent buffer's rows, lists out) proposes what the
    vectorised [B, W] path proposes, batch rule included; propose_row alone is the naive definition."""
    from types import SimpleNamespace

    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    rng = np.random.default_rng(len(histories))
    buf = rng.integers(0, 3, size=(8, 40)).astype(np.int64)  # junk past each row's history
    rows = np.sort(rng.choice(8, size=len(histories), replace=False))
    for r, h in zip(rows, histories):
        buf[r, : len(h)] = h
    num_tokens = np.zeros(8, dtype=np.int64)
    num_tokens[rows] = [len(h) for h in histories]
    batch = SimpleNamespace(token_ids=buf, num_tokens=num_tokens)
    n = len(histories)
    inputs = SimpleNamespace(num_reqs=n, num_tokens=n, req_ids=[f"r{i}" for i in range(n)], rows=rows)
    s_idx = np.nonzero(sampling[: len(histories)])[0]
    outs = []
    for row_search_max_batch in (64, 0):
        step = SpecDecodeStep.__new__(SpecDecodeStep)
        step.proposer = NgramProposer(4, 1, 3, max_model_len)
        step.proposer.row_search_max_batch = row_search_max_batch
        step.budget = DraftBudget(4)
        step.draft, step.lengths, step.disable_by_batch_size, step._step_drafts = None, None, None, 0
        outs.append(step.propose(batch, inputs, s_idx))
    assert outs[0] == outs[1]
    proposer = NgramProposer(4, 1, 3, max_model_len)
    for r, h in zip(rows, histories):
        assert proposer.propose_row(buf[r], len(h)) == naive_ngram(h, 4, 1, 3, max_model_len)


def test_ngram_reads_only_each_rows_history_in_a_persistent_buffer() -> None:
    """The runner passes its [max_num_reqs, max_model_len] buffer: stale tokens past num_tokens must not match."""
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 3, size=n).tolist() for n in (5, 17, 0, 9, 12)]
    buf = rng.integers(0, 3, size=(len(histories), 40)).astype(np.int32)  # junk everywhere
    for i, h in enumerate(histories):
        buf[i, : len(h)] = h
    for row_search_max_batch in (0, 64):
        proposer = NgramProposer(4, 1, 3)
        proposer.row_search_max_batch = row_search_max_batch
        proposal = proposer.propose(buf, np.array([len(h) for h in histories]))
        assert proposal.to_lists() == [naive_ngram(h, 4, 1, 3, None) for h in histories]
        assert proposal.draft_token_ids.shape == (5, 4)
        assert (proposal.draft_token_ids[np.arange(4)[None, :] >= proposal.num_draft_tokens[:, None]] == -1).all()


@pytest.mark.parametrize(
    ("history", "k", "min_n", "max_n", "expected"),
    [
        ([1, 2, 3, 4, 5], 3, 1, 3, []),  # no earlier occurrence of any suffix
        ([5, 5, 5], 4, 2, 2, [5]),  # the occurrence ends right before the suffix's last token: one token follows
        ([1, 2, 3, 4, 1, 2], 5, 2, 2, [3, 4, 1, 2]),  # k longer than what follows
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),  # the most recent occurrence wins
        ([9, 1, 2, 7, 3, 1, 2, 8, 9, 1, 2], 2, 2, 3, [7, 3]),  # the longest n wins over a more recent shorter one
        ([9, 1, 2, 7, 3, 1, 2, 8, 9, 1, 2], 2, 2, 2, [8, 9]),  # ... and without it the most recent 2-gram
        ([4, 4], 3, 2, 3, []),  # too short for an earlier 2-gram
        ([], 3, 1, 1, []),
    ],
)
def test_ngram_edge_cases(history, k, min_n, max_n, expected) -> None:
    assert NgramProposer(k, min_n, max_n).propose_lists([history]) == [expected]
    assert naive_ngram(history, k, min_n, max_n, None) == expected


def test_ngram_proposal_stops_at_max_model_len() -> None:
    history = [1, 2, 3, 4, 1, 2]
    assert NgramProposer(5, 2, 2, max_model_len=8).propose_lists([history]) == [[3, 4]]
    assert NgramProposer(5, 2, 2, max_model_len=6).propose_lists([history]) == [[]]


def test_draft_lengths_halve_after_full_rejections_and_grow_after_full_acceptances() -> None:
    lengths = AdaptiveDraftLength(6, probe_interval=3)
    ids = ["a", "b", "c", "d"]
    assert lengths.lengths(ids).tolist() == [6, 6, 6, 6]  # unknown requests propose the most
    # a: all rejected; b: all accepted; c: partly accepted; d: no drafts this step.
    lengths.observe(ids, np.array([6, 6, 6, 0]), np.array([0, 6, 2, 0]))
    assert lengths.lengths(ids).tolist() == [3, 6, 6, 6]
    lengths.observe(ids[:1], np.array([3]), np.array([0]))
    assert lengths.lengths(ids[:1]).tolist() == [1]
    lengths.observe(ids[:1], np.array([1]), np.array([0]))
    # Backed off to none: plain steps, then one probe token after probe_interval of its steps.
    assert [lengths.for_step(ids[:2]).tolist() for _ in range(3)] == [[0, 6], [0, 6], [1, 6]]
    lengths.observe(ids[:1], np.array([1]), np.array([0]))  # a failed probe: the next one comes twice as late
    assert [int(lengths.for_step(ids[:1])[0]) for _ in range(6)] == [0, 0, 0, 0, 0, 1]
    lengths.observe(ids[:1], np.array([1]), np.array([1]))  # a probe that holds: growing again
    lengths.observe(ids[:1], np.array([3]), np.array([3]))
    assert lengths.lengths(ids[:1]).tolist() == [5]
    lengths.observe(ids[:1], np.array([5]), np.array([0]))
    lengths.observe(ids[:1], np.array([2]), np.array([0]))
    lengths.observe(ids[:1], np.array([1]), np.array([0]))  # not a probe: the first interval again
    assert [int(lengths.for_step(ids[:1])[0]) for _ in range(3)] == [0, 0, 1]
    lengths.forget(["a"])
    assert lengths.for_step(ids[:1]).tolist() == [6]  # forgotten: neither backed off nor counting
    with pytest.raises(ValueError, match="num_accepted"):
        lengths.observe(["a"], np.array([2]), np.array([3]))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AdaptiveDraftLength(0)


@pytest.mark.parametrize(("k", "lo", "hi"), [(0, 1, 2), (2, 0, 2), (2, 3, 2)])
def test_ngram_rejects_bad_settings(k, lo, hi) -> None:
    with pytest.raises(ValueError):
        NgramProposer(k, lo, hi)


# ---------------------------------------------------------------------------------------------- rejection sampler
def random_probs(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=gen).pow(3).softmax(dim=-1)


def naive_greedy(drafts: list[int], target: torch.Tensor) -> list[int]:
    """What non-speculative greedy decoding emits, one position at a time, while it agrees with the drafts."""
    out = []
    for i, token in enumerate(drafts):
        best = int(target[i].argmax())
        out.append(best)
        if best != token:
            return out
    out.append(int(target[len(drafts)].argmax()))
    return out


@pytest.mark.parametrize("path", ["point_masses", "draft_probs", "greedy_verify"])
def test_greedy_rows_emit_exactly_what_greedy_decoding_emits(path) -> None:
    gen = torch.Generator().manual_seed(1)
    b, k, v = 64, 4, 12
    target = random_probs(gen, b, k + 1, v)
    best = target[:, :k].argmax(dim=2)
    agree = torch.rand((b, k), generator=gen) < 0.7
    drafts = torch.where(agree, best, torch.randint(0, v, (b, k), generator=gen))
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    if path == "greedy_verify":  # the all-greedy fast path reads logits: any order-preserving map of the probs
        out = greedy_verify(target.log(), drafts, num_draft)
    else:
        draft_probs = random_probs(gen, b, k, v) if path == "draft_probs" else None
        out = rejection_sample(drafts, num_draft, draft_probs, target, torch.ones(b, dtype=torch.bool))
    for i in range(b):
        expected = naive_greedy(drafts[i, : num_draft[i]].tolist(), target[i])
        row = out.output_token_ids[i].tolist()
        assert row[: len(expected)] == expected
        assert row[len(expected) :] == [PLACEHOLDER_TOKEN_ID] * (k + 1 - len(expected))
        assert int(out.num_accepted[i]) == len(expected) - 1


@pytest.mark.parametrize("k", [0, 1, 4])
def test_prefix_kept_on_the_host_equals_the_torch_ops(k) -> None:
    """CPU verification keeps the accepted prefix in numpy; the torch version (other devices) must agree."""
    from vllm_lite.spec_decode.rejection_sampler import _keep_matching_prefix_host, _keep_matching_prefix_torch

    gen = torch.Generator().manual_seed(3)
    b, v = 200, 3  # a small vocabulary: many drafts agree, whole rows accepted too
    sampled = torch.randint(0, v, (b, k + 1), generator=gen)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    host = _keep_matching_prefix_host(sampled, drafts, num_draft)
    ref = _keep_matching_prefix_torch(sampled, drafts, num_draft)
    assert host.output_token_ids.dtype == ref.output_token_ids.dtype == torch.int64
    assert torch.equal(host.output_token_ids, ref.output_token_ids)
    assert torch.equal(host.num_accepted, ref.num_accepted)
    if k:
        assert 0 < int((ref.num_accepted == num_draft).sum()) < b  # both whole and partial acceptances occurred


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_argmax_picks_what_torch_argmax_picks(dtype) -> None:
    """The greedy verification's argmax (numpy on CPU) must pick torch's token, ties and NaN included (first one),
    or greedy outputs would differ from plain decoding's."""
    from vllm_lite.spec_decode.rejection_sampler import _argmax_last

    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 4, (3, 5, 64), generator=gen).to(dtype)  # few values: many ties
    x[0, 1, [5, 9]] = float("nan")
    x[1, 2] = float("-inf")
    got = _argmax_last(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(_argmax_last(x[:, 1:4]), x[:, 1:4].argmax(dim=-1))  # a strided view


def test_greedy_rows_do_not_depend_on_random_rows_beside_them() -> None:
    gen = torch.Generator().manual_seed(2)
    b, k, v = 16, 3, 10
    target = random_probs(gen, b, k + 1, v)
    drafts = target[:, :k].argmax(dim=2)
    drafts[::3, 1] = (drafts[::3, 1] + 1) % v
    num_draft = torch.full((b,), k)
    greedy = torch.arange(b) % 2 == 0
    mixed = rejection_sample(drafts, num_draft, None, target, greedy)
    alone = rejection_sample(drafts, num_draft, None, target, torch.ones(b, dtype=torch.bool))
    assert torch.equal(mixed.output_token_ids[greedy], alone.output_token_ids[greedy])


def emitted_distributions_match(out, target: torch.Tensor, draft_tokens: torch.Tensor) -> None:
    """The first emitted token follows p_1; given x_1 accepted the second follows p_2; given both, the bonus p_3."""
    tokens = out.output_token_ids
    v = target.shape[-1]
    conditioned = torch.ones(tokens.shape[0], dtype=torch.bool)
    for pos in range(target.shape[0]):
        counts = torch.bincount(tokens[conditioned, pos], minlength=v)
        assert int(counts.sum()) > 2000, "too few draws reach this position for the test to have power"
        pvalue = chi_square_pvalue(counts, target[pos])
        assert pvalue > SIGNIFICANCE, f"position {pos}: counts {counts.tolist()} vs {target[pos].tolist()}"
        if pos < draft_tokens.shape[1]:
            conditioned &= tokens[:, pos] == draft_tokens[:, pos]


TARGET = torch.tensor(
    [
        [0.35, 0.25, 0.2, 0.15, 0.05],
        [0.1, 0.5, 0.05, 0.05, 0.3],
        [0.2, 0.2, 0.2, 0.2, 0.2],
    ]
)


def test_point_mass_drafts_keep_the_target_distribution_with_seeded_rows() -> None:
    """n-gram proposals (q = point mass), every row with its own seeded generator."""
    b, k = 12000, 2
    drafts = torch.tensor([[0, 1]]).expand(b, k)
    target = TARGET.expand(b, -1, -1)
    generators = {i: torch.Generator().manual_seed(1000 + i) for i in range(b)}
    out = rejection_sample(drafts, torch.full((b,), k), None, target, torch.zeros(b, dtype=torch.bool), generators)
    emitted_distributions_match(out, TARGET, drafts)


def test_draft_model_proposals_keep_the_target_distribution() -> None:
    """A draft distribution q unlike p; the draft tokens are drawn from q, as a draft model does."""
    b, k = 30000, 2
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.3, 0.3, 0.3, 0.05, 0.05]])
    gen = torch.Generator().manual_seed(3)
    drafts = torch.stack([torch.multinomial(q[i], b, replacement=True, generator=gen) for i in range(k)], dim=1)
    with torch.random.fork_rng(devices=[]):  # unseeded rows use the global stream: fix it, then restore it
        torch.manual_seed(4)
        out = rejection_sample(
            drafts, torch.full((b,), k), q.expand(b, -1, -1), TARGET.expand(b, -1, -1), torch.zeros(b, dtype=torch.bool)
        )
    emitted_distributions_match(out, TARGET, drafts)


def test_draft_equal_to_target_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(5)
    b, k, v = 256, 4, 9
    target = random_probs(gen, b, k + 1, v)
    q = target[:, :k].clone()
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    generators = {i: torch.Generator().manual_seed(i) for i in range(0, b, 2)}
    out = rejection_sample(drafts, num_draft, q, target, torch.zeros(b, dtype=torch.bool), generators)
    assert torch.equal(out.num_accepted, num_draft)
    # A point mass on a token the target is sure of is accepted too; one the target rules out never is.
    sure = torch.nn.functional.one_hot(drafts, v).float()
    target_sure = torch.cat([sure, target[:, k:]], dim=1)
    out = rejection_sample(drafts, num_draft, None, target_sure, torch.zeros(b, dtype=torch.bool), generators)
    assert torch.equal(out.num_accepted, num_draft)
    target_never = torch.cat([(1.0 - sure) / (v - 1), target[:, k:]], dim=1)
    out = rejection_sample(drafts, num_draft, None, target_never, torch.zeros(b, dtype=torch.bool))
    assert int(out.num_accepted.max()) == 0
    rows_with_drafts = num_draft > 0
    assert (out.output_token_ids[rows_with_drafts, 0] != drafts[rows_with_drafts, 0]).all()


def test_seeded_row_is_reproducible_whatever_the_batch_around_it() -> None:
    gen = torch.Generator().manual_seed(6)
    b, k, v = 8, 3, 7
    target = random_probs(gen, b, k + 1, v)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    num_draft = torch.full((b,), k)
    random_rows = torch.zeros(b, dtype=torch.bool)
    first = rejection_sample(drafts, num_draft, None, target, random_rows, {3: torch.Generator().manual_seed(9)})
    # Alone, in a batch of one, and again in the full batch: the seeded row emits the same tokens.
    alone = rejection_sample(
        drafts[3:4], num_draft[3:4], None, target[3:4], random_rows[3:4], {0: torch.Generator().manual_seed(9)}
    )
    again = rejection_sample(drafts, num_draft, None, target, random_rows, {3: torch.Generator().manual_seed(9)})
    assert torch.equal(first.output_token_ids[3], alone.output_token_ids[0])
    assert torch.equal(first.output_token_ids[3], again.output_token_ids[3])


def test_rejection_sampler_rejects_mismatched_shapes() -> None:
    drafts, num_draft, greedy = (
        torch.zeros(2, 3, dtype=torch.long),
        torch.full((2,), 3),
        torch.zeros(2, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(drafts, num_draft, None, torch.full((2, 3, 5), 0.2), greedy)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(drafts, num_draft, torch.full((2, 3, 4), 0.25), torch.full((2, 4, 5), 0.2), greedy)
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(drafts, num_draft, None, torch.full((2, 4, 5), 0.2), greedy, {2: torch.Generator()})


# ---------------------------------------------------------------------------------------------- stats
def test_spec_decoding_stats_count_drafts_and_acceptances_per_position() -> None:
    one_by_one = SpecDecodingStats.new(3)
    for drafted, accepted in [(3, 2), (3, 0), (2, 2), (0, 0), (1, 1)]:
        if drafted:
            one_by_one.observe_draft(drafted, accepted)
    batched = SpecDecodingStats.new(3)
    batched.observe_batch(np.array([3, 3, 2, 0, 1]), np.array([2, 0, 2, 0, 1]))
    assert one_by_one == batched
    assert batched.counters() == {
        "vllm:spec_decode_num_drafts": 4,
        "vllm:spec_decode_num_draft_tokens": 9,
        "vllm:spec_decode_num_accepted_tokens": 5,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 2, 0],
    }
    assert set(METRIC_NAMES.values()) == set(batched.counters())
    assert batched.draft_acceptance_rate == pytest.approx(5 / 9)
    assert batched.mean_acceptance_length == pytest.approx(1 + 5 / 4)
    assert batched.acceptance_rate_per_pos == pytest.approx([0.75, 0.5, 0.0])
    total = SpecDecodingStats.new(3)
    total.merge(batched)
    total.merge(one_by_one)
    assert total.num_accepted_tokens_per_pos == [6, 4, 0] and total.num_drafts == 8
    with pytest.raises(ValueError):
        batched.observe_draft(2, 3)
    with pytest.raises(ValueError):
        batched.observe_batch(np.array([4]), np.array([1]))


def test_seeded_point_mass_rows_draw_once_per_emitted_token() -> None:
    """What seeded replay after preemption relies on: the generator moves by one [V] draw per emitted token,
    whatever was proposed, exactly as non-speculative sampling moves it."""
    gen = torch.Generator().manual_seed(7)
    b, k, v = 6, 3, 5
    target = random_probs(gen, b, k + 1, v)
    drafts = target[:, :k].argmax(dim=2)  # likely tokens, so some rows accept several
    generators = {i: torch.Generator().manual_seed(100 + i) for i in range(b)}
    out = rejection_sample(drafts, torch.full((b,), k), None, target, torch.zeros(b, dtype=torch.bool), generators)
    assert int(out.num_accepted.max()) > 0
    for i in range(b):
        replay = torch.Generator().manual_seed(100 + i)
        for _ in range(int(out.num_accepted[i]) + 1):
            torch.rand((v,), generator=replay)
        assert torch.equal(generators[i].get_state(), replay.get_state()), f"row {i}"


# ---------------------------------------------------------------------------------------------- draft-model rows
def test_rows_with_and_without_draft_probs_each_keep_their_rule() -> None:
    """`rejection_sample_rows`: rows with a draft q follow min(1, p/q) + residual (the target distribution holds);
    point-mass rows beside them keep the seeded coupling (the same tokens as verified alone); greedy rows are exact."""
    b, k = 16000, 2
    q = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.3, 0.3, 0.3, 0.05, 0.05]])
    gen = torch.Generator().manual_seed(7)
    drafts = torch.stack([torch.multinomial(q[i], b, replacement=True, generator=gen) for i in range(k)], dim=1)
    has_q = torch.arange(b) % 4 != 0
    greedy = torch.arange(b) % 8 == 4
    seeded = {i: torch.Generator().manual_seed(i) for i in range(0, b, 4)}  # the point-mass rows
    target = TARGET.expand(b, -1, -1)
    draft_probs = torch.where(has_q[:, None, None], q.expand(b, -1, -1), 0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        out = rejection_sample_rows(drafts, torch.full((b,), k), draft_probs, has_q, target, greedy, seeded)
    random_q = has_q & ~greedy
    emitted_distributions_match(_subset(out, random_q), TARGET, drafts[random_q])
    pm = (~has_q).nonzero().squeeze(1)
    alone = rejection_sample(
        drafts[pm],
        torch.full((len(pm),), k),
        None,
        target[pm],
        greedy[pm],
        {j: torch.Generator().manual_seed(int(r)) for j, r in enumerate(pm.tolist())},
    )
    assert torch.equal(out.output_token_ids[pm], alone.output_token_ids)
    g = greedy.nonzero().squeeze(1)
    for i in g[:50].tolist():
        expected = naive_greedy(drafts[i].tolist(), TARGET)
        assert out.output_token_ids[i, : len(expected)].tolist() == expected


def _subset(out, mask: torch.Tensor):
    return type(out)(output_token_ids=out.output_token_ids[mask], num_accepted=out.num_accepted[mask])


def test_penalty_tables_count_the_drafts_before_each_position() -> None:
    """Position j of a verified row is penalised as if drafts[:j] had been sampled: each listed token's count is its
    output count plus its occurrences among those drafts, and new draft tokens join the table."""
    token_ids = torch.tensor([[3, 5, 7, 3], [2, 4, 2, 2]])  # distinct tokens, padded by repeating entry 0
    counts = torch.tensor([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    drafts = torch.tensor([[5, 9, 5], [4, -1, -1]])
    num_draft = torch.tensor([3, 1])
    ids, got = penalties_with_drafts(token_ids, counts, drafts, num_draft)
    assert ids.shape == got.shape == (8, 7)
    for r in range(2):
        base = {int(t): float(c) for t, c in zip(token_ids[r], counts[r])}
        for j in range(4):
            seen = drafts[r, : min(j, int(num_draft[r]))].tolist()
            want = dict(base)
            for t in seen:
                want[t] = want.get(t, 0.0) + 1.0
            row = r * 4 + j
            table = {}
            for t, c in zip(ids[row].tolist(), got[row].tolist()):
                assert table.setdefault(t, c) == c, "copies of a token must carry one count"
            assert table == want, (r, j)


# ---------------------------------------------------------------------------------------------- recording a verify step
@settings(max_examples=80, deadline=None)
@given(
    reqs=record_requests(),
    data=st.data(),
)
def test_record_emitted_equals_one_record_sampled_per_column(reqs, data) -> None:
    """A verify step's emitted tokens recorded at once (record_emitted) leave the batch exactly as one
    record_sampled call per column does: token rows, counts (past max_model_len too), output counts, bad-word
    history and penalty tables; both the small-batch loop and the numpy form."""
    from vllm_lite.worker import spec_decode_step
    from vllm_lite.worker.spec_decode_step import record_emitted

    vocab, k = 32, 3
    small_batch = data.draw(st.sampled_from([0, 64]))
    batches, rng = recording_batches(reqs, vocab)
    rows = np.array(sorted(batches[0].req_id_to_row[f"r{i}"] for i in range(len(reqs))), dtype=np.int64)
    order = np.array(data.draw(st.permutations(list(range(len(rows))))), dtype=np.int64)
    rows = rows[order]
    num_emitted = np.array(data.draw(st.lists(st.integers(1, k + 1), min_size=len(rows), max_size=len(rows))))
    table = rng.integers(0, vocab, size=(len(rows), k + 1))
    table[np.arange(k + 1)[None, :] >= num_emitted[:, None]] = PLACEHOLDER_TOKEN_ID
    old, spec_decode_step.SMALL_BATCH = spec_decode_step.SMALL_BATCH, small_batch
    try:
        record_emitted(batches[0], rows, table, num_emitted)
    finally:
        spec_decode_step.SMALL_BATCH = old
    ref = batches[1]
    for j in range(int(num_emitted.max())):
        keep = num_emitted > j
        ref.record_sampled(rows[keep], table[keep, j])
    assert_same_recording(batches[0], ref, rows)


@settings(max_examples=80, deadline=None)
@given(b=st.integers(1, 20), k=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_host_prefix_match_loop_and_numpy_forms_equal_the_torch_form(b, k, seed) -> None:
    """greedy_verify_host's prefix match: the Python-list walk (small batches) and the numpy form give the
    device form's tokens and accepted counts."""
    from vllm_lite.spec_decode import rejection_sampler as rs

    rng = np.random.default_rng(seed)
    samples = rng.integers(0, 3, size=(b, k + 1))
    drafts = samples[:, :k].copy()  # agreeing drafts, each row's broken at a random place (or nowhere)
    cut = rng.integers(0, k + 1, size=b)
    drafts[np.arange(k)[None, :] == cut[:, None]] += 1
    num_draft = rng.integers(0, k + 1, size=b)
    drafts[np.arange(k)[None, :] >= num_draft[:, None]] = PLACEHOLDER_TOKEN_ID
    ref = rs._keep_matching_prefix_torch(
        torch.from_numpy(samples), torch.from_numpy(drafts), torch.from_numpy(num_draft)
    )
    for loop_max in (0, 64):
        old = rs.MATCH_LOOP_MAX_BATCH
        rs.MATCH_LOOP_MAX_BATCH = loop_max
        try:
            got = rs._match_prefix_np(samples, drafts, num_draft)
        finally:
            rs.MATCH_LOOP_MAX_BATCH = old
        assert torch.equal(got.output_token_ids, ref.output_token_ids)
        assert torch.equal(got.num_accepted, ref.num_accepted)


@settings(max_examples=60, deadline=None)
@given(lists=st.lists(st.lists(st.integers(0, 9), max_size=4), max_size=5))
def test_draft_table_lays_out_the_scheduled_drafts(lists) -> None:
    """SpecDecodeStep.draft_table: row i holds request i's drafts then -1 (K = the longest), counts their lengths;
    requests without an entry have none (the uniform shortcut and the general layout agree)."""
    from types import SimpleNamespace

    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    so = SimpleNamespace(scheduled_spec_decode_tokens={f"r{i}": d for i, d in enumerate(lists) if d})
    req_ids = [f"r{i}" for i in range(len(lists))]
    table, counts = SpecDecodeStep.draft_table(so, req_ids)
    k = max((len(d) for d in lists), default=0)
    assert table.shape == (len(lists), k) and table.dtype == np.int64 and counts.dtype == np.int64
    assert counts.tolist() == [len(d) for d in lists]
    assert table.tolist() == [d + [-1] * (k - len(d)) for d in lists]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=10),
    scheduled=st.lists(st.integers(0, 7), min_size=10, max_size=10),
    small_batch=st.sampled_from([0, 64]),
)
def test_logits_positions_pick_each_verified_token(counts, scheduled, small_batch) -> None:
    """SpecDecodeStep.logits_positions (small-batch loop and numpy form): row i lists the flat indices of request
    s_idx[i]'s last token and drafts (the last 1 + n of its query), then repeats its last one up to K + 1."""
    from types import SimpleNamespace

    from vllm_lite.worker import spec_decode_step
    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    s_idx = np.arange(0, 2 * len(counts), 2)  # every other request samples; the others run 0-7 prompt tokens
    num_scheduled = np.zeros(2 * len(counts), dtype=np.int64)
    num_scheduled[s_idx] = np.array(counts) + 1
    num_scheduled[s_idx + 1] = scheduled[: len(counts)]
    query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)]).astype(np.int32)
    num_draft = np.array(counts, dtype=np.int64)
    old, spec_decode_step.SMALL_BATCH = spec_decode_step.SMALL_BATCH, small_batch
    try:
        got = SpecDecodeStep.logits_positions(SimpleNamespace(query_start_loc=query_start_loc), s_idx, num_draft)
    finally:
        spec_decode_step.SMALL_BATCH = old
    k = max(counts)
    assert got.shape == (len(counts), k + 1) and got.dtype == np.int64
    for row, i, n in zip(got.tolist(), s_idx.tolist(), counts):
        own = list(range(query_start_loc[i + 1] - 1 - n, query_start_loc[i + 1]))
        assert row == own + [own[-1]] * (k - n)


# ---------------------------------------------------------------------------------------------- host-side point masses
@pytest.mark.parametrize("mix", ["all_random", "all_greedy", "mixed"])
@pytest.mark.parametrize("rewind", [False, True])
def test_host_point_mass_matching_equals_the_device_form_and_leaves_seeded_streams_alike(
    mix, rewind, monkeypatch
) -> None:
    """match_sample_host (the runner's n-gram verification) emits the tokens `_match_sample` emits from the same
    global and seeded streams, with the drafts on the host; every seeded generator ends where the device form
    leaves it (one draw per emitted token), whether it draws position by position or all at once and rewinds."""
    from vllm_lite.spec_decode import rejection_sampler as rs

    monkeypatch.setattr(rs, "SEEDED_REWIND", rewind)
    gen = torch.Generator().manual_seed(11)
    b, k, v = 40, 4, 6  # a small vocabulary: drafts often agree, so prefixes of every length occur
    target = random_probs(gen, b, k + 1, v)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    greedy = {
        "all_random": torch.zeros(b, dtype=torch.bool),
        "all_greedy": torch.ones(b, dtype=torch.bool),
        "mixed": torch.arange(b) % 3 == 0,
    }[mix]

    def seeded() -> dict[int, torch.Generator]:
        return {i: torch.Generator().manual_seed(100 + i) for i in range(0, b, 2)}

    ref_gens, host_gens = seeded(), seeded()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        ref = rs._match_sample(drafts, num_draft, target, greedy, ref_gens)
        after_ref = torch.rand(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        got = rs.match_sample_host(
            target,
            drafts.numpy(),
            num_draft.numpy(),
            greedy,
            mix == "all_greedy",
            mix == "all_random",
            host_gens,
        )
        after_host = torch.rand(3)
    assert got.output_token_ids.device.type == "cpu" and got.output_token_ids.dtype == torch.int64
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(after_host, after_ref)  # the global stream advanced alike
    for i in ref_gens:  # each seeded stream is where one draw per emitted token leaves it
        assert torch.equal(host_gens[i].get_state(), ref_gens[i].get_state()), i
    if mix != "all_greedy":
        accepted = got.num_accepted[list(ref_gens)]
        assert 0 < int((accepted < num_draft[list(ref_gens)]).sum()), "no seeded row rejected: rewind untested"


def _sampled_metadata(s: int, greedy: np.ndarray, seeded: dict[int, torch.Generator]):
    from dataclasses import replace

    from vllm_lite.worker.sampling_metadata import SamplingMetadata

    all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
    md = SamplingMetadata(
        num_rows=s,
        all_greedy=all_greedy,
        all_random=all_random,
        greedy_mask=None if all_greedy or all_random else torch.from_numpy(greedy),
        temperature=torch.from_numpy(np.where(greedy, 1.0, 0.7).astype(np.float32)),
        top_k=torch.full((s,), 5),
        max_top_k=5,
        top_p=None,
        min_p=None,
        generators=seeded,
    )
    if not (all_greedy or all_random):
        md = replace(md, random_rows_host=np.nonzero(~greedy)[0].astype(np.int64))
        md.random_rows = torch.from_numpy(md.random_rows_host)
    return md


@pytest.mark.parametrize("mix", ["all_random", "mixed"])
def test_verify_matches_point_masses_on_the_host_without_copying_drafts(mix, monkeypatch) -> None:
    """SpecDecodeStep.verify on sampled n-gram rows: host tokens from match_sample_host and the mixed batch's random
    rows from the host's metadata, no device copy of the drafts (only penalties and draft-model q read them
    there): the tokens the device form (nonzero of the greedy mask, rejection_sample_rows) gives."""
    from dataclasses import replace

    from vllm_lite.worker import spec_decode_step as sds

    gen = torch.Generator().manual_seed(12)
    s, k, v = 6, 3, 9
    logits = torch.randn(s * (k + 1), v, generator=gen)
    greedy = np.arange(s) % 3 == 0 if mix == "mixed" else np.zeros(s, dtype=bool)
    drafts = torch.randint(0, v, (s, k), generator=gen).numpy()
    num_draft = np.array([3, 0, 1, 2, 3, 3], dtype=np.int64)

    def seeded() -> dict[int, torch.Generator]:
        return {i: torch.Generator().manual_seed(7 + i) for i in (0, 1, 4)}

    md = _sampled_metadata(s, greedy, seeded())
    md_ref = replace(md, random_rows_host=None, random_rows=None, generators=seeded())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        target, is_greedy = sds.target_distributions(logits, md_ref, None, k + 1)
        ref = rejection_sample_rows(
            torch.from_numpy(drafts), torch.from_numpy(num_draft), None, None, target, is_greedy, md_ref.generators
        )
    copied = []
    real_from_numpy = torch.from_numpy

    def spy(a):
        copied.append(a is drafts or a is num_draft)
        return real_from_numpy(a)

    monkeypatch.setattr(sds.torch, "from_numpy", spy)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        tokens, lp = sds.SpecDecodeStep.verify(logits, md, None, drafts, num_draft)
    monkeypatch.setattr(sds.torch, "from_numpy", real_from_numpy)
    assert lp is None
    assert not any(copied), "the drafts went to the device"
    assert torch.equal(tokens, ref.output_token_ids)
    for i, g in md.generators.items():
        assert torch.equal(g.get_state(), md_ref.generators[i].get_state()), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mix", ["all_random", "mixed"])
def test_cuda_seeded_rows_rewind_to_the_sequential_streams(mix) -> None:
    """On CUDA seeded rows draw every position, then rewind their generator (no host read per position): the same
    tokens as the sequential device form, and each CUDA generator left one draw per emitted token along."""
    from vllm_lite.spec_decode import rejection_sampler as rs

    assert rs.SEEDED_REWIND is None  # the device decides: rewind off the CPU
    gen = torch.Generator().manual_seed(13)
    b, k, v = 24, 4, 6
    target = random_probs(gen, b, k + 1, v).cuda()
    drafts = torch.randint(0, v, (b, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (b,), generator=gen)
    greedy = torch.zeros(b, dtype=torch.bool) if mix == "all_random" else torch.arange(b) % 3 == 0

    def seeded() -> dict[int, torch.Generator]:
        return {i: torch.Generator(device="cuda").manual_seed(200 + i) for i in range(0, b, 2)}

    ref_gens, host_gens = seeded(), seeded()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(5)
        ref = rs._match_sample(drafts.cuda(), num_draft.cuda(), target, greedy.cuda(), ref_gens)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.cuda.manual_seed(5)
        got = rs.match_sample_host(
            target,
            drafts.numpy(),
            num_draft.numpy(),
            greedy.cuda(),
            False,
            mix == "all_random",
            host_gens,
            None if mix == "all_random" else greedy.numpy(),
        )
    assert torch.equal(got.output_token_ids, ref.output_token_ids.cpu())
    for i in ref_gens:
        assert torch.equal(host_gens[i].get_state(), ref_gens[i].get_state()), i
