"""The batched sampler and its per-row state, checked against HF's logits processors and plain math."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.sampler import Sampler, compute_prompt_logprobs
from vllm_lite.worker.sampling_state import SamplingState

CPU = torch.device("cpu")
V = 64


def make_state(
    params: list[SamplingParams],
    vocab: int = V,
    prompts: Optional[list[list[int]]] = None,
    outputs: Optional[list[list[int]]] = None,
    eos: Optional[int] = None,
    rows: Optional[list[int]] = None,
    max_num_reqs: int = 64,
) -> tuple[SamplingState, np.ndarray]:
    state = SamplingState(max_num_reqs, vocab, 256, CPU)
    rows = rows if rows is not None else list(range(len(params)))
    for i, (row, p) in enumerate(zip(rows, params)):
        prompt = prompts[i] if prompts else [1, 2, 3]
        out = outputs[i] if outputs else []
        state.add_request(row, p, prompt, out, eos)
    return state, np.asarray(rows, dtype=np.int64)


def sample(state: SamplingState, rows: np.ndarray, logits: torch.Tensor, append: bool = True):
    out = Sampler()(logits, state.make_metadata(rows))
    if append:
        state.append_token_ids(rows, out.sampled_token_ids.numpy())
    return out


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warpers in vLLM V1's order: temperature -> min-p -> top-k -> top-p."""
    x = logits.clone().unsqueeze(0)
    ids = torch.zeros((1, 1), dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    return x[0]


def hf_penalize(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF repetition penalty over prompt+output, then OpenAI's frequency/presence over output."""
    x = logits.clone().unsqueeze(0)
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([prompt + output], dtype=torch.long)
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = x[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different tokens were filtered out"
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- basic sampling
def test_top_k_1_equals_greedy_on_random_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, V) * 3
    state, rows = make_state([SamplingParams(temperature=1.3, top_k=1)] * 16)
    greedy_state, _ = make_state([SamplingParams(temperature=0.0)] * 16)
    for _ in range(5):
        got = sample(state, rows, logits, append=False).sampled_token_ids
        assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(sample(greedy_state, rows, logits).sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_never_random_in_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, V)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=5.0) for i in range(8)]
    state, rows = make_state(params)
    random_rows_changed = False
    first = sample(state, rows, logits, append=False).sampled_token_ids
    for seed in range(20):
        torch.manual_seed(seed)
        got = sample(state, rows, logits, append=False).sampled_token_ids
        assert torch.equal(got[0::2], logits[0::2].argmax(-1))
        random_rows_changed |= not torch.equal(got[1::2], first[1::2])
    assert random_rows_changed, "random rows at temperature 5 never varied: sampling is not random"


def test_random_sampling_follows_the_softmax_distribution() -> None:
    torch.manual_seed(2)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5])
    n = 20000
    state, rows = make_state([SamplingParams(temperature=0.7)] * n, vocab=8, max_num_reqs=n)
    got = sample(state, rows, base.expand(n, 8).clone(), append=False).sampled_token_ids
    freq = torch.bincount(got, minlength=8).float() / n
    expected = (base / 0.7).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


# ---------------------------------------------------------------------- masks and bias
def test_logit_bias_plus_100_forces_its_token() -> None:
    torch.manual_seed(3)
    state, rows = make_state([SamplingParams(temperature=1.0, logit_bias={17: 100.0})] * 8)
    for _ in range(10):
        got = sample(state, rows, torch.randn(8, V) * 5).sampled_token_ids
        assert (got == 17).all()


def test_logit_bias_minus_100_suppresses_the_argmax_for_greedy() -> None:
    logits = torch.randn(4, V)
    top = logits.argmax(-1)
    state, rows = make_state([SamplingParams(temperature=0.0, logit_bias={int(t): -100.0}) for t in top])
    got = sample(state, rows, logits).sampled_token_ids
    assert (got != top).all()
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(got, second)


def test_single_token_bad_words_never_appear() -> None:
    torch.manual_seed(4)
    bad = [5, 9, 33]
    p = SamplingParams(temperature=1.0, _bad_words_token_ids=[[t] for t in bad])
    state, rows = make_state([p] * 16 + [SamplingParams(temperature=0.0, _bad_words_token_ids=[[5]])])
    logits = torch.randn(17, V)
    logits[:, bad] += 6.0  # make them the favourites
    for _ in range(20):
        got = sample(state, rows, logits).sampled_token_ids
        assert not np.isin(got[:16].numpy(), bad).any()
    assert got[16] != 5 and got[16] == logits[16].masked_fill(torch.arange(V) == 5, -1e9).argmax()


def test_multi_token_bad_word_bans_last_token_only_after_its_prefix() -> None:
    logits = torch.zeros(1, V)
    logits[0, 12] = 5.0  # the favourite is the bad word's last token
    p = SamplingParams(temperature=0.0, _bad_words_token_ids=[[7, 8, 12]])
    state, rows = make_state([p], outputs=[[3, 7, 8]])
    assert sample(state, rows, logits, append=False).sampled_token_ids.item() != 12
    state, rows = make_state([p], outputs=[[3, 7, 9]])
    assert sample(state, rows, logits, append=False).sampled_token_ids.item() == 12
    state, rows = make_state([p], outputs=[[8]])  # shorter than the prefix: no match
    assert sample(state, rows, logits, append=False).sampled_token_ids.item() == 12
    # The tail also advances through append_token_ids.
    state, rows = make_state([p], outputs=[[]])
    state.append_token_ids(rows, np.array([7]))
    state.append_token_ids(rows, np.array([8]))
    assert sample(state, rows, logits, append=False).sampled_token_ids.item() != 12


def test_allowed_token_ids_confine_output() -> None:
    torch.manual_seed(5)
    allowed = [2, 40, 41, 60]
    params = [SamplingParams(temperature=2.0, allowed_token_ids=allowed)] * 8 + [SamplingParams(temperature=2.0)] * 8
    state, rows = make_state(params)
    seen_outside = False
    for _ in range(30):
        got = sample(state, rows, torch.randn(16, V)).sampled_token_ids.numpy()
        assert np.isin(got[:8], allowed).all()
        seen_outside |= not np.isin(got[8:], allowed).all()
    assert seen_outside, "rows without allowed_token_ids were confined too"


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached() -> None:
    eos, stop = 0, 6
    logits = torch.zeros(1, V)
    logits[0, eos] = 9.0
    logits[0, stop] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], _all_stop_token_ids=[stop])
    state, rows = make_state([p], eos=eos)
    got = [sample(state, rows, logits).sampled_token_ids.item() for _ in range(4)]
    assert eos not in got[:3] and stop not in got[:3]
    assert got[3] == eos


def test_min_tokens_counts_outputs_restored_after_preemption() -> None:
    eos = 0
    logits = torch.zeros(1, V)
    logits[0, eos] = 9.0
    p = SamplingParams(temperature=0.0, min_tokens=3)
    state, rows = make_state([p], outputs=[[4, 5]], eos=eos)
    assert sample(state, rows, logits).sampled_token_ids.item() != eos
    assert sample(state, rows, logits).sampled_token_ids.item() == eos


# ---------------------------------------------------------------------- vs HF processors
PENALTY_CASES = [
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.7),
    SamplingParams(temperature=1.0, presence_penalty=1.5),
    SamplingParams(temperature=1.0, frequency_penalty=-0.8),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.9),
    SamplingParams(temperature=1.0),
]


def test_penalties_match_hf_repetition_and_openai_formulas() -> None:
    torch.manual_seed(6)
    n = len(PENALTY_CASES)
    prompts = [torch.randint(0, V, (10,)).tolist() for _ in range(n)]
    outputs = [torch.randint(0, V, (7,)).tolist() + [3, 3, 3] for _ in range(n)]
    state, rows = make_state(PENALTY_CASES, prompts=prompts, outputs=[o[:4] for o in outputs])
    # The rest arrives step by step, as in decoding.
    for j in range(4, 10):
        state.append_token_ids(rows, np.array([o[j] for o in outputs]))
    logits = torch.randn(n, V) * 4
    ours = Sampler.apply_logits_processors(logits, state.make_metadata(rows))
    for i, p in enumerate(PENALTY_CASES):
        ref = hf_penalize(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(ours[i], ref, atol=1e-5, rtol=1e-6)
    assert not torch.allclose(ours[4], logits[4]), "penalties had no effect"


WARPER_CASES = [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.5),
    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.5, top_p=0.3, min_p=0.1),
]


@pytest.mark.parametrize("vocab", [V, 1000])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_temperature_top_k_top_p_min_p_match_hf_warpers(vocab: int, scale: float) -> None:
    """Small vocab: all rows settle among candidates; large vocab: flat rows take the exact dense path."""
    torch.manual_seed(7)
    cases = WARPER_CASES + [
        SamplingParams(temperature=1.0, min_p=0.001, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=100, min_p=0.5),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    logits = torch.randn(len(cases), vocab) * scale
    state, rows = make_state(cases, vocab=vocab)
    ours = Sampler().processed_logits(logits, state.make_metadata(rows))
    for i, p in enumerate(cases):
        assert_same_distribution(ours[i], hf_warp(logits[i], p))


def test_top_k_alone_uses_partial_topk_and_matches_hf() -> None:
    torch.manual_seed(8)
    cases = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 3, 7, 0, V, V + 5)]
    logits = torch.randn(len(cases), V)
    logits[0, :4] = 10.0  # ties at the k-th value are kept, as HF does
    state, rows = make_state(cases)
    md = state.make_metadata(rows)
    assert md.top_p is None and md.max_top_k == 7
    ours = Sampler().processed_logits(logits, md)
    for i, p in enumerate(cases):
        assert_same_distribution(ours[i], hf_warp(logits[i], p))


def test_sampling_only_picks_tokens_the_warpers_keep() -> None:
    torch.manual_seed(9)
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.9)] * 32
    state, rows = make_state(params)
    logits = torch.randn(32, V)
    kept = torch.isfinite(Sampler().processed_logits(logits, state.make_metadata(rows)))
    for _ in range(10):
        got = sample(state, rows, logits, append=False).sampled_token_ids
        assert kept[torch.arange(32), got].all()


# ---------------------------------------------------------------------- seeds
def _seeded_run(row: int, others: int, seed_of_others: int, steps: int, logits_seq: list[torch.Tensor]) -> list[int]:
    """Tokens of one seeded request placed at `row` among `others` random requests."""
    params = [SamplingParams(temperature=1.0, seed=1234, top_p=0.95)]
    rows = [row]
    gen = torch.Generator().manual_seed(seed_of_others)
    for i in range(others):
        seed = None if i % 3 else i  # a mix of unseeded and other seeded rows
        params.append(SamplingParams(temperature=float(torch.rand(1, generator=gen)) + 0.5, seed=seed))
        rows.append(i if i < row else i + 1)
    state, rows_np = make_state(params, rows=rows)
    order = np.argsort(rows_np)  # logits rows in row order, so the seeded one sits mid-batch
    rows_np = rows_np[order]
    where = int(np.nonzero(rows_np == row)[0][0])
    out = []
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=gen)
        logits[where] = logits_seq[step]
        out.append(int(sample(state, rows_np, logits).sampled_token_ids[where]))
    return out


def test_seeded_request_reproduces_alone_in_batch_and_across_runs() -> None:
    torch.manual_seed(10)
    seq = [torch.randn(V) for _ in range(12)]
    alone = _seeded_run(0, 0, 0, 12, seq)
    batched = _seeded_run(17, 32, 1, 12, seq)
    batched_again = _seeded_run(5, 32, 2, 12, seq)
    torch.manual_seed(999)  # global RNG must not matter
    alone_again = _seeded_run(0, 0, 3, 12, seq)
    assert alone == batched == batched_again == alone_again
    assert len(set(alone)) > 1  # temperature 1 over 12 steps: genuinely random tokens
    other_seed = SamplingParams(temperature=1.0, seed=4321, top_p=0.95)
    state, rows = make_state([other_seed])
    diff = [int(sample(state, rows, s.unsqueeze(0)).sampled_token_ids[0]) for s in seq]
    assert diff != alone, "a different seed gave the same tokens"


def test_seeded_request_resumes_its_stream_after_preemption() -> None:
    torch.manual_seed(11)
    seq = [torch.randn(1, V) for _ in range(8)]
    p = SamplingParams(temperature=1.0, seed=77)
    state, rows = make_state([p])
    full = [int(sample(state, rows, s).sampled_token_ids[0]) for s in seq]
    resumed_state, rows = make_state([p], outputs=[full[:5]])
    resumed = [int(sample(resumed_state, rows, s).sampled_token_ids[0]) for s in seq[5:]]
    assert resumed == full[5:]


def test_move_row_carries_generator_and_penalty_counts() -> None:
    torch.manual_seed(12)
    p_seed = SamplingParams(temperature=1.0, seed=5)
    p_pen = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    seq = [torch.randn(2, V) for _ in range(6)]
    ref_state, ref_rows = make_state([p_seed, p_pen], outputs=[[], [4, 4]])
    ref = [sample(ref_state, ref_rows, s).sampled_token_ids.tolist() for s in seq]

    state, _ = make_state([SamplingParams(), SamplingParams(), p_pen, p_seed], outputs=[[], [], [4, 4], []])
    rows = np.array([3, 2])
    got = [sample(state, rows, s).sampled_token_ids.tolist() for s in seq[:3]]
    state.remove_request(0)
    state.move_row(3, 0)  # condense: the seeded request moves into the hole
    state.remove_request(1)
    state.move_row(2, 1)  # and the penalized one
    rows = np.array([0, 1])
    got += [sample(state, rows, s).sampled_token_ids.tolist() for s in seq[3:]]
    assert got == ref
    with pytest.raises(ValueError, match="hold no request"):
        state.make_metadata(np.array([3]))


# ---------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_with_correct_ranks() -> None:
    torch.manual_seed(13)
    params = [
        SamplingParams(temperature=0.9, logprobs=5, top_k=4, repetition_penalty=1.5, logit_bias={1: 3.0}),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    state, rows = make_state(params)
    logits = torch.randn(3, V) * 2
    out = sample(state, rows, logits)
    lp = out.logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (3, 6) and lp.logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.logprob_token_ids), atol=1e-5, rtol=0)
    top = raw.topk(5, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top.indices)
    for i in range(3):
        tok = int(out.sampled_token_ids[i])
        assert int(lp.selected_token_ranks[i]) == int((raw[i] > raw[i, tok]).sum()) + 1
    assert int(lp.selected_token_ranks[1]) == 1  # greedy picks the best raw token here (no processors)


def test_no_logprobs_requested_returns_none() -> None:
    state, rows = make_state([SamplingParams(temperature=1.0)] * 3)
    assert sample(state, rows, torch.randn(3, V)).logprobs_tensors is None


def test_compute_prompt_logprobs_matches_log_softmax() -> None:
    torch.manual_seed(14)
    logits = torch.randn(9, V)
    targets = torch.randint(0, V, (9,))
    lp = compute_prompt_logprobs(logits, targets, 3)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(lp.logprob_token_ids[:, 0], targets)
    torch.testing.assert_close(lp.logprobs[:, 0], raw[torch.arange(9), targets], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.logprobs[:, 1:], raw.topk(3, -1).values, atol=1e-5, rtol=0)
    assert torch.equal(lp.selected_token_ranks, (raw > raw[torch.arange(9), targets].unsqueeze(1)).sum(-1) + 1)
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(logits, targets[:3], 1)


# ---------------------------------------------------------------------- mixed batch
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.4, logit_bias={3: 2.0}, logprobs=2),
    SamplingParams(temperature=0.7, top_k=6, seed=11),
    SamplingParams(temperature=1.3, top_p=0.7, presence_penalty=1.0, seed=12, logprobs=4),
    SamplingParams(temperature=1.0, min_p=0.3, frequency_penalty=0.5, seed=13),
    SamplingParams(temperature=0.9, allowed_token_ids=[1, 5, 9, 30, 31], seed=14),
    SamplingParams(temperature=0.8, _bad_words_token_ids=[[2], [10, 11]], min_tokens=5, seed=15),
    SamplingParams(temperature=0.0, allowed_token_ids=[7, 8], _bad_words_token_ids=[[8]]),
    SamplingParams(temperature=1.1, top_k=12, top_p=0.9, min_p=0.02, repetition_penalty=0.8, seed=16),
]


def test_mixed_batch_matches_per_row_processing() -> None:
    torch.manual_seed(15)
    n = len(MIXED)
    prompts = [torch.randint(0, V, (6,)).tolist() for _ in range(n)]
    outputs = [torch.randint(0, V, (3,)).tolist() + [10] for _ in range(n)]
    batch_state, rows = make_state(MIXED, prompts=prompts, outputs=outputs, eos=0)
    singles = [make_state([p], prompts=[prompts[i]], outputs=[outputs[i]], eos=0) for i, p in enumerate(MIXED)]
    row6_out = list(outputs[6])
    for _ in range(6):
        logits = torch.randn(n, V) * 3
        md = batch_state.make_metadata(rows)
        processed = Sampler().processed_logits(logits, md)
        out = sample(batch_state, rows, logits)
        for i, (s_state, s_rows) in enumerate(singles):
            s_md = s_state.make_metadata(s_rows)
            s_processed = Sampler().processed_logits(logits[i : i + 1], s_md)
            assert torch.equal(torch.isinf(processed[i]), torch.isinf(s_processed[0])), i
            torch.testing.assert_close(processed[i].softmax(-1), s_processed[0].softmax(-1), atol=1e-6, rtol=1e-5)
            s_out = sample(s_state, s_rows, logits[i : i + 1])
            # All rows are greedy or seeded, so every token must agree.
            assert int(s_out.sampled_token_ids[0]) == int(out.sampled_token_ids[i]), i
            if s_out.logprobs_tensors is not None:
                assert out.logprobs_tensors is not None
                k = s_out.logprobs_tensors.logprobs.shape[1]
                torch.testing.assert_close(out.logprobs_tensors.logprobs[i, :k], s_out.logprobs_tensors.logprobs[0])
        toks = out.sampled_token_ids.numpy()
        assert toks[5] in (1, 5, 9, 30, 31) and toks[7] == 7 and toks[6] != 2
        assert not (row6_out[-1] == 10 and toks[6] == 11), "bad word [10, 11] completed"
        assert not (len(row6_out) < 5 and toks[6] == 0), "EOS before min_tokens"
        row6_out.append(int(toks[6]))


# ---------------------------------------------------------------------- cheap when unused, bad input
def test_metadata_skips_features_no_row_uses() -> None:
    state, rows = make_state([SamplingParams(temperature=0.0)] * 4)
    md = state.make_metadata(rows)
    assert md.all_greedy and md.temperature is None and md.top_k is None and md.top_p is None
    assert md.min_p is None and md.no_penalties and md.banned_index is None and md.allowed_index is None
    assert md.logit_bias_index is None and md.max_num_logprobs is None and not md.generators
    assert state.seen is None, "penalty counts were allocated though no request needs them"


def test_bad_input_raises_value_error_naming_the_field() -> None:
    state = SamplingState(4, V, 32, CPU)
    with pytest.raises(ValueError, match="row"):
        state.add_request(4, SamplingParams(), [1], [], None)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        state.add_request(0, SamplingParams(allowed_token_ids=[V]), [1], [], None)
    with pytest.raises(ValueError, match="logit_bias"):
        state.add_request(0, SamplingParams(logit_bias={V + 1: 1.0}), [1], [], None)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        state.add_request(0, SamplingParams(_bad_words_token_ids=[[1, V]]), [1], [], None)
    with pytest.raises(TypeError, match="params"):
        state.add_request(0, {"temperature": 1.0}, [1], [], None)  # type: ignore[arg-type]
    state.add_request(0, SamplingParams(), [1], [], None)
    with pytest.raises(ValueError, match="token_ids"):
        state.append_token_ids(np.array([0]), np.array([V]))
    with pytest.raises(ValueError, match="same length"):
        state.append_token_ids(np.array([0]), np.array([1, 2]))
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(2, V), state.make_metadata(np.array([0])))


def test_top_p_on_large_vocab_matches_hf_for_peaked_and_flat_rows() -> None:
    """Peaked rows are settled among the top candidates; flat rows need the full-sort fallback."""
    torch.manual_seed(16)
    vocab = 4096
    logits = torch.randn(6, vocab)
    logits[:3] *= 8.0  # peaked: top-p mass within a few hundred tokens
    logits[3:] *= 0.3  # nearly flat: top-p needs most of the vocabulary
    cases = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_p=0.5, top_k=600),
        SamplingParams(temperature=1.0, top_p=0.97, min_p=0.01),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.3, top_k=3000),
        SamplingParams(temperature=1.0),
    ]
    state, rows = make_state(cases, vocab=vocab)
    ours = Sampler().processed_logits(logits, state.make_metadata(rows))
    for i, p in enumerate(cases):
        assert_same_distribution(ours[i], hf_warp(logits[i], p))
    kept = torch.isfinite(ours).sum(-1)
    assert kept[3] > 512 and kept[0] < 512 and kept[5] == vocab


def test_penalties_track_many_distinct_tokens_and_reused_rows() -> None:
    """Hundreds of distinct prompt/output tokens (storage grows), and a row reused after another request."""
    torch.manual_seed(17)
    vocab = 2000
    p = SamplingParams(temperature=1.0, repetition_penalty=1.25, frequency_penalty=0.4, presence_penalty=0.3)
    state = SamplingState(4, vocab, 1024, CPU)
    state.add_request(2, SamplingParams(frequency_penalty=1.0), list(range(500)), list(range(300)), None)
    state.remove_request(2)  # leaves stale storage behind in row 2
    prompt = torch.randint(0, vocab, (300,)).tolist()
    output = torch.randint(0, vocab, (250,)).tolist()
    state.add_request(2, p, prompt, output[:50], None)
    state.add_request(0, p, [], [], None)  # nothing seen yet: penalties must not touch anything
    state.add_request(1, SamplingParams(temperature=1.0), [5], [], None)
    rows = np.array([2, 0, 1])
    before = torch.randn(3, vocab)
    assert torch.equal(Sampler.apply_logits_processors(before, state.make_metadata(rows))[1], before[1])
    for t in output[50:]:
        state.append_token_ids(rows, np.array([t, 7, 8]))
    logits = torch.randn(3, vocab) * 3
    ours = Sampler.apply_logits_processors(logits, state.make_metadata(rows))
    torch.testing.assert_close(ours[0], hf_penalize(logits[0], p, prompt, output), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ours[1], hf_penalize(logits[1], p, [], [7] * 200), atol=1e-5, rtol=1e-6)
    assert torch.equal(ours[2], logits[2])


# ---------------------------------------------------------------------- through the engine
def test_engine_seeded_sampling_is_batch_invariant_and_features_apply_end_to_end() -> None:
    """LLM.generate: a seeded request repeats alone and in a crowd; allowed ids / bias / bad words hold."""
    from vllm_lite import LLM
    from vllm_lite.testing.checkpoints import get_checkpoint

    llm = LLM(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=128)
    try:
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
        prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
        alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
        crowd_prompts = [{"prompt_token_ids": [i + 3, i + 11, 2 * i + 1]} for i in range(6)]
        crowd_params = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 6
        outs = llm.generate(
            [*crowd_prompts[:3], prompt, *crowd_prompts[3:]],
            [*crowd_params[:3], seeded, *crowd_params[3:]],
            use_tqdm=False,
        )
        assert outs[3].outputs[0].token_ids == alone
        assert llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids == alone

        allowed = [10, 20, 30]
        out = llm.generate(
            prompt,
            SamplingParams(temperature=1.0, allowed_token_ids=allowed, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        assert set(out[0].outputs[0].token_ids) <= set(allowed)
        out = llm.generate(
            prompt,
            SamplingParams(temperature=1.0, logit_bias={33: 100.0}, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
        assert out[0].outputs[0].token_ids == [33] * 6
        greedy = llm.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2), use_tqdm=False
        )[0].outputs[0]
        bad_tok = greedy.token_ids[0]
        banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={bad_tok: -100.0})
        assert llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids[0] != bad_tok
        assert greedy.logprobs is not None and all(lp[t].rank == 1 for lp, t in zip(greedy.logprobs, greedy.token_ids))
    finally:
        llm.shutdown()


def test_top_k_keeps_ties_beyond_the_candidates_like_hf() -> None:
    """bf16-like logits with 100 tokens tied at the top: top-k=5 keeps all ties (HF), via the dense path."""
    torch.manual_seed(18)
    vocab = 1000
    logits = torch.randn(2, vocab)
    logits[:, 100:200] = 6.0
    cases = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.9, top_k=5, top_p=0.5)]
    state, rows = make_state(cases, vocab=vocab)
    ours = Sampler().processed_logits(logits, state.make_metadata(rows))
    for i, p in enumerate(cases):
        assert_same_distribution(ours[i], hf_warp(logits[i], p))
    assert int(torch.isfinite(ours[0]).sum()) == 100
