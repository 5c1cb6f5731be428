"""The sampler's rules, one at a time, against a naive per-row reference written here (plain Python over one row).

Each test names the rule it checks. The reference never calls the code under test: it walks one row's vocabulary
with the rule as vLLM/HF state it (masks, bias, penalties, temperature -> min-p -> top-k -> top-p), and seeded rows
are checked token for token against the exponential race drawn from the row's own `torch.Generator`.
"""

from __future__ import annotations

import math
import random
from typing import Optional

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.devices import requires_cuda_devices
from vllm_lite.worker import sampler as sampler_module
from vllm_lite.worker.sampler import (
    Sampler,
    WarpedLogits,
    apply_grammar_bitmask,
    apply_top_k,
    apply_top_p,
    compute_prompt_logprobs,
    expand_bitmask,
    gather_logprobs,
    keep_grammar_over_bans,
    warp,
)
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.sampling_state import _ROW_FIELDS, SamplingState
from vllm_lite.worker.sampling_tables import RowEntries, SeenTokens

CPU = torch.device("cpu")
NEG = float("-inf")


# ---------------------------------------------------------------------- the naive reference, one row at a time
def ref_processors(
    row: torch.Tensor,
    p: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos: Optional[int],
    bitmask_row: Optional[list[int]] = None,
) -> torch.Tensor:
    """Grammar mask, allowed ids, bad words, min_tokens stop bans, logit bias, then penalties, over one row."""
    vocab = row.shape[0]
    x = [float(v) for v in row]
    grammar_only = None
    if bitmask_row is not None:
        for t in range(vocab):
            word = t // 32
            if word >= len(bitmask_row) or not (bitmask_row[word] >> (t % 32)) & 1:
                x[t] = NEG
        grammar_only = list(x)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else NEG for t, v in enumerate(x)]
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = NEG
    if len(output) < p.min_tokens:
        for t in p.all_stop_token_ids + ([] if eos is None else [eos]):
            x[t] = NEG
    constrained = bitmask_row is not None and any(w != -1 for w in bitmask_row)
    if constrained and all(v == NEG for v in x):
        assert grammar_only is not None
        x = grammar_only
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    r = p.repetition_penalty
    for t in {t for t in prompt if 0 <= t < vocab} | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


def _softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != NEG else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k (ties with the k-th kept), top-p (keep while the mass ranked above < p)."""
    x = [float(v) / p.temperature for v in row]
    vocab = len(x)
    if p.min_p > 0:
        probs = _softmax(x)
        top = max(probs)
        x = [NEG if q < p.min_p * top else v for v, q in zip(x, probs)]
    if 0 < p.top_k < vocab:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [NEG if v < kth else v for v in x]
    if p.top_p < 1.0:
        probs = _softmax(x)
        above = 0.0
        for rank, t in enumerate(sorted(range(vocab), key=lambda t: -x[t])):
            if rank > 0 and above >= p.top_p:
                x[t] = NEG
            above += probs[t]
    return torch.tensor(x, dtype=torch.float64)


def ref_seeded_tokens(rows: list[torch.Tensor], seed: int) -> list[int]:
    """The exponential race argmax(p / E), E = -log(U) drawn as one [V] vector per step from the seed's own stream."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for warped in rows:
        noise = torch.rand(warped.shape[0], generator=gen).double().log().neg()
        probs = torch.tensor(_softmax(warped.tolist()), dtype=torch.float64)
        out.append(int((probs / noise).argmax()))
    return out


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), f"{what}: different tokens were kept"
    kept = torch.isfinite(ref)
    torch.testing.assert_close(ours.double().softmax(-1)[kept], ref.softmax(-1)[kept], atol=1e-6, rtol=1e-4)


def load(
    params: list[SamplingParams],
    vocab: int,
    prompts: Optional[list[list[int]]] = None,
    outputs: Optional[list[list[int]]] = None,
    eos: Optional[int] = None,
    max_model_len: int = 64,
) -> tuple[SamplingState, np.ndarray]:
    state = SamplingState(len(params), vocab, max_model_len, CPU)
    for row, p in enumerate(params):
        state.add_request(row, p, prompts[row] if prompts else [], outputs[row] if outputs else [], eos)
    return state, np.arange(len(params), dtype=np.int64)


def random_params(rng: random.Random, vocab: int, processors: bool, warpers: bool) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.5, 1.0, 1.7]) if warpers else 1.0}
    if warpers:
        kw["top_k"] = rng.choice([0, 0, 1, 3, 20, vocab, vocab + 3])
        kw["top_p"] = rng.choice([1.0, 1.0, 0.3, 0.8, 0.95])
        kw["min_p"] = rng.choice([0.0, 0.0, 0.05, 0.3])
    if processors:
        if rng.random() < 0.3:
            kw["allowed_token_ids"] = rng.sample(range(vocab), 6)
        if rng.random() < 0.5:
            kw["_bad_words_token_ids"] = [
                [rng.randrange(vocab)],
                [rng.randrange(vocab) for _ in range(rng.choice([2, 3]))],
            ]
        if rng.random() < 0.4:
            kw["min_tokens"] = rng.choice([2, 5])
            kw["stop_token_ids"] = [rng.randrange(vocab)]
            kw["_all_stop_token_ids"] = kw["stop_token_ids"]
        if rng.random() < 0.5:
            kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-3.0, 2.5]), rng.randrange(vocab): 1.25}
        if rng.random() < 0.6:
            kw["repetition_penalty"] = rng.choice([1.0, 0.7, 1.4])
            kw["frequency_penalty"] = rng.choice([0.0, 0.6, -0.4])
            kw["presence_penalty"] = rng.choice([0.0, 1.1, -0.3])
    return SamplingParams(**kw)


# ---------------------------------------------------------------------- processors
@pytest.mark.parametrize("seed", [0, 1])
def test_processors_equal_the_row_reference_across_steps(seed: int) -> None:
    """Every logits processor, any mix per row, across steps whose outputs grow by append_token_ids."""
    rng = random.Random(seed)
    vocab, n = 48, 14
    params = [random_params(rng, vocab, processors=True, warpers=False) for _ in range(n)]
    # Prompts carry ids past the vocabulary (never penalized) and outputs repeat tokens (frequency counts).
    prompts = [[rng.randrange(vocab + 8) for _ in range(rng.randrange(0, 6))] for _ in range(n)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 4))] for _ in range(n)]
    # Plant multi-token bad-word prefixes at the tail of some outputs so they match.
    for i, p in enumerate(params):
        if p.bad_words_token_ids and i % 2:
            outputs[i] += p.bad_words_token_ids[1][:-1]
    eos = 1
    state, rows = load(params, vocab, prompts, [list(o) for o in outputs], eos=eos)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        logits = torch.randn(n, vocab, generator=gen) * 3
        ours = Sampler.apply_logits_processors(logits, state.make_metadata(rows))
        for i, p in enumerate(params):
            ref = ref_processors(logits[i], p, prompts[i], outputs[i], eos)
            assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, p)
            kept = torch.isfinite(ref)
            torch.testing.assert_close(ours[i].double()[kept], ref[kept], atol=1e-4, rtol=1e-5)
        # The next tokens: each row's tail grows, so bad-word prefixes complete and min_tokens counts advance.
        nxt = [p.bad_words_token_ids[1][0] if p.bad_words_token_ids else rng.randrange(vocab) for p in params]
        state.append_token_ids(rows, np.array(nxt))
        for o, t in zip(outputs, nxt):
            o.append(t)


def test_logit_bias_is_added_to_the_logit_not_written_over_it() -> None:
    logits = torch.tensor([[1.5, -2.0, 0.25, 4.0]])
    state, rows = load([SamplingParams(logit_bias={0: 0.5, 3: -1.0})], 4)
    ours = Sampler.apply_logits_processors(logits, state.make_metadata(rows))
    assert ours.tolist() == [[2.0, -2.0, 0.25, 3.0]]


def test_processors_never_modify_the_callers_logits_and_return_float32() -> None:
    logits = torch.randn(2, 16).to(torch.bfloat16)
    before = logits.clone()
    state, rows = load(
        [SamplingParams(logit_bias={3: 5.0}), SamplingParams(presence_penalty=1.0)], 16, outputs=[[], [2]]
    )
    ours = Sampler.apply_logits_processors(logits, state.make_metadata(rows))
    assert ours.dtype == torch.float32 and torch.equal(logits, before)
    plain, plain_rows = load([SamplingParams()], 16)
    assert Sampler.apply_logits_processors(logits[:1], plain.make_metadata(plain_rows)).dtype == torch.float32


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0]])
    state, rows = load([SamplingParams(repetition_penalty=2.0)], 4, prompts=[[0, 1, 2, 4, -1]])  # 4, -1: no token
    assert Sampler.apply_logits_processors(logits, state.make_metadata(rows)).tolist() == [[1.0, -4.0, 0.0, 3.0]]


def test_frequency_counts_only_outputs_and_presence_applies_once() -> None:
    logits = torch.zeros(1, 5)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=2.0)
    state, rows = load([p], 5, prompts=[[4, 4]], outputs=[[1, 1, 1, 2]])
    state.append_token_ids(rows, np.array([2]))
    assert Sampler.apply_logits_processors(logits, state.make_metadata(rows)).tolist() == [[0.0, -3.5, -3.0, 0.0, 0.0]]


# ---------------------------------------------------------------------- grammar bitmask
def _pack(allowed: list[list[bool]]) -> torch.Tensor:
    words = (len(allowed[0]) + 31) // 32
    out = []
    for bits in allowed:
        row = []
        for w in range(words):
            v = sum(1 << j for j in range(32) if w * 32 + j < len(bits) and bits[w * 32 + j])
            row.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(row)
    return torch.tensor(out, dtype=torch.int32)


def test_grammar_keeps_its_own_mask_when_bans_would_leave_no_token() -> None:
    """A finished grammar allows only EOS; min_tokens bans it: the row keeps the grammar's mask (EOS), not token 0."""
    vocab, eos = 40, 33
    only_eos = [t == eos for t in range(vocab)]
    two = [t in (5, eos) for t in range(vocab)]
    bitmask = torch.cat([_pack([only_eos]), _pack([two]), torch.full((1, 2), -1, dtype=torch.int32)])
    p = SamplingParams(temperature=0.0, min_tokens=4, logit_bias={eos: 0.5})
    state, rows = load([p, p, p], vocab, outputs=[[2], [2], [2]], eos=eos)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    md = state.make_metadata(rows)
    ours = Sampler.apply_logits_processors(logits, md, bitmask)
    for i in range(3):
        ref = ref_processors(logits[i], p, [], [2], eos, bitmask[i].tolist())
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), i
        torch.testing.assert_close(ours[i].double()[torch.isfinite(ref)], ref[torch.isfinite(ref)])
    assert Sampler()(logits, md, bitmask).sampled_token_ids.tolist()[:2] == [eos, 5]


def test_keep_grammar_over_bans_only_restores_constrained_rows_left_empty() -> None:
    grammar_only = torch.tensor([[1.0, NEG], [2.0, 3.0], [4.0, 5.0]])
    banned = torch.tensor([[NEG, NEG], [NEG, NEG], [NEG, 6.0]])
    bitmask = torch.tensor([[1], [-1], [3]], dtype=torch.int32)
    got = keep_grammar_over_bans(grammar_only, banned, bitmask)
    assert got.tolist() == [[1.0, NEG], [NEG, NEG], [NEG, 6.0]]


def test_bitmask_shorter_than_the_vocabulary_forbids_the_rest() -> None:
    allowed = [[t % 3 == 0 for t in range(32)], [True] * 32]
    bitmask = _pack(allowed)
    mask = expand_bitmask(bitmask, 40)
    assert mask.shape == (2, 40) and mask.dtype == torch.bool
    assert mask[:, :32].tolist() == allowed and not mask[:, 32:].any()
    logits = torch.zeros(2, 40)
    out = apply_grammar_bitmask(logits, bitmask)
    assert torch.isinf(out[:, 32:]).all() and torch.equal(torch.isfinite(out[:, :32]), torch.tensor(allowed))
    assert expand_bitmask(bitmask, 20).tolist() == [r[:20] for r in allowed]  # spare bits ignored


def test_byte_table_is_built_per_device_and_value_then_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row b of the table holds b's bits, least significant first, compared with `value`."""
    monkeypatch.setattr(sampler_module, "_BYTE_BITS", {})
    ones = sampler_module._byte_bits(CPU, True)
    zeros = sampler_module._byte_bits(CPU, False)
    assert ones.shape == (256, 8) and ones.dtype == torch.bool and ones.device == CPU
    assert ones.tolist() == [[bool((b >> j) & 1) for j in range(8)] for b in range(256)]
    assert torch.equal(zeros, ~ones)
    assert sampler_module._byte_bits(CPU, True) is ones and sampler_module._byte_bits(CPU, False) is zeros
    assert set(sampler_module._BYTE_BITS) == {(CPU, True), (CPU, False)}
    bitmask = _pack([[t in (0, 9, 31, 32, 38) for t in range(40)]])
    assert expand_bitmask(bitmask, 40)[0].nonzero().flatten().tolist() == [0, 9, 31, 32, 38]


def test_processed_logits_apply_the_grammar_bitmask() -> None:
    vocab = 40
    allowed = [[t % 4 == 1 for t in range(vocab)], [True] * vocab, [t < 20 for t in range(vocab)]]
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.5)]
    params.append(SamplingParams(temperature=0.5, allowed_token_ids=[3, 7, 25]))  # allowed ids within the grammar
    state, rows = load(params, vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    ours = Sampler().processed_logits(logits, state.make_metadata(rows), _pack(allowed))
    assert torch.isfinite(ours[:2]).tolist() == allowed[:2]
    assert torch.isfinite(ours[2]).nonzero().flatten().tolist() == [3, 7]
    torch.testing.assert_close(ours[1], logits[1] / 0.5)


@requires_cuda_devices(1)
def test_sampler_on_cuda_moves_host_bitmasks_and_keeps_seeded_streams() -> None:
    """The grammar bitmask arrives from the host; seeded rows draw on the device from their own generator."""
    vocab, cuda = 100, torch.device("cuda")
    allowed = [[t % 3 == 0 for t in range(vocab)], [True] * vocab]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, seed=7)]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    outs = []
    for device in (CPU, cuda):
        state = SamplingState(2, vocab, 16, device)
        for row, p in enumerate(params):
            state.add_request(row, p, [], [], None)
        md = state.make_metadata(np.arange(2))
        out = Sampler()(logits.to(device), md, _pack(allowed))
        assert out.sampled_token_ids.device.type == device.type
        assert Sampler().processed_logits(logits.to(device), md, _pack(allowed)).device.type == device.type
        outs.append(out.sampled_token_ids.cpu())
    assert outs[0][0] == outs[1][0] == int(logits[0].masked_fill(~torch.tensor(allowed[0]), NEG).argmax())
    assert outs[1][1] in logits[1].topk(5).indices


# ---------------------------------------------------------------------- warpers
@pytest.mark.parametrize("vocab, scale", [(48, 3.0), (200, 0.5), (200, 6.0)])
def test_warpers_equal_the_row_reference(vocab: int, scale: float) -> None:
    """Temperature -> min-p -> top-k -> top-p; 48 tokens: all among candidates; 200: flat rows fall back dense."""
    rng = random.Random(vocab + int(scale))
    params = [random_params(rng, vocab, processors=False, warpers=True) for _ in range(24)]
    params += [
        SamplingParams(temperature=1.0, min_p=0.02),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.1, top_k=70),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, top_p=0.99, min_p=0.001),
    ]
    state, rows = load(params, vocab)
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    md = state.make_metadata(rows)
    ours = Sampler().processed_logits(logits, md)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    for i in random_rows:
        assert_same_distribution(ours[i], ref_warp(logits[i], params[i]), f"row {i} {params[i]}")
    # Greedy rows: the sampler takes the argmax of the processed logits.
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    sampled = Sampler()(logits, md).sampled_token_ids
    assert sampled[greedy].tolist() == logits[greedy].argmax(-1).tolist()
    for i in random_rows:
        assert math.isfinite(ours[i, int(sampled[i])]), i


@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_top_p_alone_is_normalized_over_the_whole_row(scale: float) -> None:
    """A lone top-p row over more tokens than the candidates: its mass is measured against the full vocabulary."""
    vocab = 300
    p = SamplingParams(temperature=0.8, top_p=0.6)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(30)) * scale
    state, rows = load([p], vocab)
    ours = Sampler().processed_logits(logits, state.make_metadata(rows))
    assert_same_distribution(ours[0], ref_warp(logits[0], p))


def test_min_p_of_one_keeps_only_the_best_tokens_and_their_ties() -> None:
    vocab = 200
    p = SamplingParams(temperature=1.0, min_p=1.0)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(31))
    logits[1] = 0.5  # every token ties with the best: all of them stay, past the candidates
    state, rows = load([p, p], vocab)
    ours = Sampler().processed_logits(logits, state.make_metadata(rows))
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [int(logits[0].argmax())]
    assert torch.isfinite(ours[1]).all()
    assert_same_distribution(ours[0], ref_warp(logits[0], p))


def test_seeded_rows_draw_exactly_the_reference_race_step_after_step() -> None:
    """Seeded rows (narrow candidates, dense fallback, no warper) equal argmax(p / E) with E from their own stream."""
    vocab = 160
    cases = [
        SamplingParams(temperature=0.8, top_k=4, seed=21),  # narrow
        SamplingParams(temperature=1.0, top_p=0.97, seed=22),  # flat rows: dense fallback
        SamplingParams(temperature=1.3, seed=23),  # no truncation: dense
        SamplingParams(temperature=1.0, min_p=0.2, top_p=0.9, seed=24),
        SamplingParams(temperature=0.6),  # an unseeded row in between
        SamplingParams(temperature=0.0, seed=25),  # greedy ignores its seed
    ]
    state, rows = load(cases, vocab)
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(len(cases), vocab, generator=gen) * s for s in (0.4, 3.0, 0.4, 2.0, 0.3)]
    got = []
    for logits in steps:
        got.append(Sampler()(logits, state.make_metadata(rows)).sampled_token_ids.tolist())
        state.append_token_ids(rows, np.array(got[-1]))
    for i, p in enumerate(cases):
        if p.seed is not None and p.temperature > 0:
            expected = ref_seeded_tokens([ref_warp(s[i], p) for s in steps], p.seed)
            assert [g[i] for g in got] == expected, (i, p)
    assert [g[5] for g in got] == [int(s[5].argmax()) for s in steps]


def test_seeded_rows_past_the_vocabulary_size_in_an_all_random_batch() -> None:
    """More rows than tokens: every seeded row, wherever it sits, draws from its own stream."""
    vocab = 4
    params = [SamplingParams(temperature=1.0, seed=100 + i) if i in (1, 4, 6) else SamplingParams() for i in range(7)]
    state, rows = load(params, vocab)
    gen = torch.Generator().manual_seed(4)
    steps = [torch.randn(7, vocab, generator=gen) for _ in range(6)]
    got = []
    for logits in steps:
        got.append(Sampler()(logits, state.make_metadata(rows)).sampled_token_ids.tolist())
    for i in (1, 4, 6):
        assert [g[i] for g in got] == ref_seeded_tokens([s[i].double() for s in steps], 100 + i), i


def test_unseeded_narrow_rows_follow_the_warped_distribution() -> None:
    """Rows settled among their candidates sample each kept token with its renormalized probability."""
    from vllm_lite.testing.chi_square import chi_square_pvalue

    vocab, n = 96, 3000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 2
    p = SamplingParams(temperature=0.9, top_k=5, top_p=0.9)
    state, rows = load([p] * n, vocab)
    md = state.make_metadata(rows)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        sampled = Sampler()(base.expand(n, vocab).clone(), md).sampled_token_ids
    probs = torch.tensor(_softmax(ref_warp(base, p).tolist()))
    counts = torch.bincount(sampled, minlength=vocab)
    assert chi_square_pvalue(counts, probs) > 1e-4


def test_warp_returns_rows_in_batch_order_and_leaves_logits_alone() -> None:
    """Greedy rows are skipped; the random rows come back at their batch indices, narrow or dense."""
    vocab = 200
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.999),
        SamplingParams(temperature=2.0),
    ]
    state, rows = load(params, vocab)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 0.2
    before = logits.clone()
    md = state.make_metadata(rows)
    w = warp(logits, md, (~md.greedy_mask).nonzero().squeeze(1))
    assert torch.equal(logits, before)
    assert w.narrow_rows is not None and w.narrow_rows.tolist() == [1]
    assert w.dense_rows is not None and w.dense_rows.tolist() == [3, 4]
    dense = w.to_dense()
    assert torch.isinf(dense[[0, 2]]).all()
    for i in (1, 3, 4):
        assert_same_distribution(dense[i], ref_warp(logits[i], params[i]), str(i))
    only_temp = warp(logits, md, torch.tensor([4]))
    assert only_temp.narrow_rows is None and only_temp.dense_rows.tolist() == [4]
    torch.testing.assert_close(only_temp.dense, logits[4:5] / 2.0)


def test_dense_top_k_and_top_p_keep_ties_and_the_best_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0], [5.0, 1.0, 1.0, 1.0, 1.0]])
    distinct = torch.tensor([[1.0, 3.0, 2.5, 2.0, 0.0], [5.0, 1.0, 1.0, 1.0, 1.0]])
    assert torch.isfinite(apply_top_k(logits.clone(), torch.tensor([2, 5]))).tolist() == [
        [False, True, True, False, False],
        [True] * 5,
    ]
    assert torch.isfinite(apply_top_k(logits.clone(), torch.tensor([3, 1]))).tolist() == [
        [False, True, True, True, False],
        [True, False, False, False, False],
    ]
    # p tiny keeps the best token only; p = 1 keeps everything.
    kept = torch.isfinite(apply_top_p(distinct.clone(), torch.tensor([1e-6, 1.0])))
    assert kept.tolist() == [[False, True, False, False, False], [True] * 5]
    graded = torch.tensor([[1.0, 3.0, 2.5, 2.0, 0.0], [5.0, 1.0, 0.5, 0.0, -1.0]])
    kept = torch.isfinite(apply_top_p(graded, torch.tensor([0.5, 0.97])))
    assert kept.tolist() == [[False, True, True, False, False], [True, True, False, False, False]]


# ---------------------------------------------------------------------- logprobs
def test_logprobs_of_a_batch_asking_only_for_the_sampled_token() -> None:
    state, rows = load([SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)], 8)
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))
    lp = Sampler()(logits, state.make_metadata(rows)).logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (2, 1)
    assert lp.logprob_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert lp.selected_token_ranks.tolist() == [1, 1]


def test_logprobs_asking_for_more_than_the_vocabulary_return_the_whole_vocabulary() -> None:
    state, rows = load([SamplingParams(temperature=0.0, logprobs=20)], 6)
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(6))
    lp = Sampler()(logits, state.make_metadata(rows)).logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (1, 7)
    ref = torch.log_softmax(logits.double(), -1)[0]
    assert lp.logprob_token_ids[0, 1:].tolist() == sorted(range(6), key=lambda t: -float(ref[t]))
    assert compute_prompt_logprobs(logits, torch.tensor([2]), 50).logprobs.shape == (1, 7)


def test_gather_logprobs_ranks_count_strictly_better_tokens() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 2.0, 1.0]], dtype=torch.float64), -1)
    for token, rank in [(1, 1), (2, 1), (3, 3), (0, 4)]:
        lp = gather_logprobs(logprobs, torch.tensor([token], dtype=torch.int32), 1)
        assert lp.selected_token_ranks.tolist() == [rank] and lp.logprob_token_ids.shape == (1, 2)
        assert lp.logprob_token_ids[0, 1] in (1, 2)
        assert lp.logprob_token_ids.dtype == torch.int64 and lp.selected_token_ranks.dtype == torch.int64
        assert lp.logprobs.dtype == torch.float32 and lp.logprob_token_ids[0, 0] == token
    only_chosen = gather_logprobs(logprobs, torch.tensor([3], dtype=torch.int32), 0)
    assert only_chosen.logprob_token_ids.dtype == torch.int64 and only_chosen.logprob_token_ids.tolist() == [[3]]


def test_prompt_logprob_argument_errors_say_what_was_given() -> None:
    logits = torch.zeros(3, 5)
    with pytest.raises(
        ValueError, match=r"^logits must be \[M, V\] and target_token_ids \[M\], got \(3, 5\) and \(2,\)\.$"
    ):
        compute_prompt_logprobs(logits, torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match=r"got \(15,\) and \(3,\)"):
        compute_prompt_logprobs(logits.flatten(), torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match=r"^num_logprobs must be >= 0, got -1\.$"):
        compute_prompt_logprobs(logits, torch.zeros(3, dtype=torch.int64), -1)
    assert compute_prompt_logprobs(logits, torch.zeros(3, dtype=torch.int64), 0).logprobs.shape == (3, 1)


def test_sampler_refuses_logits_of_the_wrong_shape() -> None:
    state, rows = load([SamplingParams(), SamplingParams()], 4)
    md = state.make_metadata(rows)
    with pytest.raises(ValueError, match=r"^logits must be \[2, V\], got \(3, 4\)\.$"):
        Sampler()(torch.zeros(3, 4), md)
    with pytest.raises(ValueError, match=r"got \(2, 4, 1\)"):
        Sampler()(torch.zeros(2, 4, 1), md)


# ---------------------------------------------------------------------- SamplingState: metadata
def test_metadata_neutralizes_unused_settings_per_row() -> None:
    vocab = 10
    greedy = SamplingParams(temperature=0.0, seed=1, logprobs=1)
    # Greedy rows use no warper even if the parameters (set past SamplingParams' own normalization) say so.
    greedy.top_k, greedy.top_p, greedy.min_p = 3, 0.5, 0.2
    params = [
        greedy,
        SamplingParams(temperature=0.7, top_k=4, top_p=0.6, min_p=0.25, seed=2),
        SamplingParams(temperature=1.0, top_k=-1),
        SamplingParams(temperature=1.0, top_k=vocab),
        SamplingParams(temperature=0.0),
    ]
    state, rows = load(params, vocab)
    md = state.make_metadata(rows)
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False, False, False, True]
    assert md.temperature is not None and md.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0, 1.0])
    assert md.top_k is not None and md.top_k.tolist() == [vocab, 4, vocab, vocab, vocab] and md.max_top_k == 4
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 0.6, 1.0, 1.0, 1.0])
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.0, 0.25, 0.0, 0.0, 0.0])
    assert list(md.generators) == [1] and md.max_num_logprobs == 1
    assert md.temperature.dtype == torch.float32 and md.top_k.dtype == torch.int64
    random_only, rr = load(params[1:4], vocab)
    md = random_only.make_metadata(rr)
    assert md.all_random and not md.all_greedy and md.greedy_mask is None and md.max_num_logprobs is None
    greedy_only, gr = load([params[0], params[4]], vocab)
    md = greedy_only.make_metadata(gr)
    assert md.all_greedy and md.temperature is None and md.generators == {} and md.top_k is None


def test_metadata_of_an_empty_batch_is_all_greedy_and_empty() -> None:
    state, _ = load([SamplingParams(logit_bias={1: 1.0}, presence_penalty=1.0)], 4)
    md = state.make_metadata(np.zeros(0, np.int64))
    assert md.num_rows == 0 and md.all_greedy and md.max_num_logprobs is None
    assert md.logit_bias_index is None and md.penalty_token_ids is None and md.banned_index is None


def test_metadata_gathers_rows_in_the_order_given() -> None:
    """Logits row i is batch row rows[i]: every per-row table must follow that order, not the state's."""
    vocab = 12
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 50.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[7]),
        SamplingParams(temperature=0.0, _bad_words_token_ids=[[0]], frequency_penalty=2.0),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9], _all_stop_token_ids=[9]),
    ]
    state, _ = load(params, vocab, outputs=[[], [], [5], []])
    logits = torch.zeros(4, vocab)
    logits[:, 0] = 10.0
    logits[:, 5] = 9.0
    logits[:, 9] = 8.0
    order = np.array([3, 1, 0, 2])
    got = Sampler()(logits, state.make_metadata(order)).sampled_token_ids.tolist()
    assert got == [0, 7, 3, 9]
    # Rows outside the step are neither touched nor required to be active.
    md = state.make_metadata(np.array([2]))
    assert md.banned_index is not None and md.banned_index[0].tolist() == [0]
    assert md.allowed_index is None and md.logit_bias_index is None


def test_min_tokens_bans_stop_ids_only_while_outputs_are_short() -> None:
    vocab = 10
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4, 6], _all_stop_token_ids=[4, 6])
    state, rows = load([p, SamplingParams(min_tokens=3)], vocab, eos=6)
    banned = lambda: sorted(zip(*(t.tolist() for t in state.make_metadata(rows).banned_index)))  # noqa: E731
    assert banned() == [(0, 4), (0, 6), (1, 6)]
    state.append_token_ids(rows, np.array([1, 1]))
    assert banned() == [(0, 4), (0, 6), (1, 6)]
    state.append_token_ids(rows, np.array([1, 1]))
    assert banned() == [(1, 6)]
    state.append_token_ids(rows, np.array([1, 1]))
    assert state.make_metadata(rows).banned_index is None
    no_stop, r = load([SamplingParams(min_tokens=3)], vocab, eos=None)
    assert no_stop.make_metadata(r).banned_index is None and len(no_stop.stop_ids) == 0


def test_multi_token_bad_words_match_the_outputs_tail_only() -> None:
    vocab = 10
    p = SamplingParams(temperature=0.0, _bad_words_token_ids=[[1, 2, 3], [2, 4]])
    cases = {
        (): [],
        (1,): [],
        (1, 2): [3, 4],
        (2,): [4],
        (2, 1, 2): [3, 4],
        (1, 2, 5): [],
        (9, 1, 2): [3, 4],
        (1, 1): [],
    }
    for out, expected in cases.items():
        state, rows = load([SamplingParams(temperature=0.0), p], vocab, outputs=[[0, 0, 0], list(out)])
        md = state.make_metadata(rows)
        got = [] if md.banned_index is None else sorted(md.banned_index[1].tolist())
        assert got == expected, out
        assert md.banned_index is None or set(md.banned_index[0].tolist()) == {1}


def test_bad_word_history_stops_at_max_model_len() -> None:
    """Outputs that fill the history: the last slot is read, and a shorter word's padding never indexes past it."""
    vocab = 10
    p = SamplingParams(temperature=0.0, _bad_words_token_ids=[[1, 2], [0, 0, 1, 5]])
    state, rows = load([p], vocab, outputs=[[0, 0, 0, 1]], max_model_len=4)
    assert state.make_metadata(rows).banned_index[1].tolist() == [2, 5]
    state.append_token_ids(rows, np.array([5]))  # past max_model_len: not recorded, never an index error
    assert state.history is not None and state.history[0].tolist() == [0, 0, 0, 1]
    long_state, rows = load([p], vocab, outputs=[[3, 3, 3, 3, 1]], max_model_len=4)
    assert long_state.history is not None and long_state.history[0].tolist() == [3, 3, 3, 3]


def test_allowed_ids_confine_only_their_own_rows() -> None:
    vocab = 8
    state, rows = load([SamplingParams(allowed_token_ids=[2, 5]), SamplingParams()], vocab)
    md = state.make_metadata(rows)
    assert md.allowed_rows is not None and md.allowed_rows.tolist() == [True, False]
    out = Sampler.apply_logits_processors(torch.zeros(2, vocab), md)
    assert torch.isfinite(out).tolist() == [[t in (2, 5) for t in range(vocab)], [True] * vocab]


# ---------------------------------------------------------------------- SamplingState: lifecycle and errors
def test_constructor_refuses_empty_sizes_with_the_field_named() -> None:
    for args, msg in [
        ((0, 4, 4), r"^max_num_reqs must be >= 1, got 0\.$"),
        ((1, 0, 4), r"^vocab_size must be >= 1, got 0\.$"),
        ((1, 4, 0), r"^max_model_len must be >= 1, got 0\.$"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingState(*args, CPU)
    smallest = SamplingState(1, 1, 1, "cpu")
    assert smallest.device == CPU and smallest.max_num_reqs == 1 and smallest.vocab_size == 1
    assert all(getattr(smallest, name).dtype == dtype for name, dtype, _ in _ROW_FIELDS)


def test_add_request_errors_name_the_field_and_the_bad_value() -> None:
    state = SamplingState(2, 8, 16, CPU)
    empty_word = SamplingParams()
    empty_word._bad_words_token_ids = [[3], []]  # SamplingParams refuses it too; the state must not rely on that
    cases = [
        (dict(row=2), r"^row must be in \[0, 2\), got 2\.$"),
        (dict(row=-1), r"^row must be in \[0, 2\), got -1\.$"),
        (dict(row=1.0), r"^row must be in \[0, 2\), got 1\.0\.$"),
        (dict(outputs=[8]), r"^output_token_ids contains token id 8 outside the vocabulary \(size 8\)\.$"),
        (dict(outputs=[-1]), r"^output_token_ids contains token id -1 "),
        (dict(p=SamplingParams(allowed_token_ids=[9])), r"^allowed_token_ids contains token id 9 "),
        (dict(p=SamplingParams(logit_bias={8: 1.0})), r"^logit_bias contains token id 8 "),
        (dict(p=SamplingParams(min_tokens=1, stop_token_ids=[8])), r"^stop token ids contains token id 8 "),
        (dict(p=SamplingParams(_bad_words_token_ids=[[3, 8]])), r"^bad_words_token_ids contains token id 8 "),
        (dict(p=empty_word), r"^bad_words_token_ids must not contain an empty sequence, got \[\[3\], \[\]\]\.$"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            state.add_request(kw.get("row", 0), kw.get("p", SamplingParams()), [], kw.get("outputs", []), None)
    with pytest.raises(TypeError, match=r"^params must be SamplingParams, got dict\.$"):
        state.add_request(0, {}, [], [], None)  # type: ignore[arg-type]
    state.add_request(np.int64(1), SamplingParams(min_tokens=1), [], [], 7)  # numpy ints are rows too
    assert state.active[1] and state.stop_ids.tokens.tolist() == [7] and state.stop_ids.rows.tolist() == [1]


def test_append_and_move_errors_name_the_field() -> None:
    state, rows = load([SamplingParams(), SamplingParams(presence_penalty=1.0)], 8)
    with pytest.raises(ValueError, match=r"^rows must be in \[0, 2\), got "):
        state.append_token_ids(np.array([2]), np.array([1]))
    with pytest.raises(ValueError, match=r"^rows must be in \[0, 2\)"):
        state.append_token_ids(np.array([-1]), np.array([1]))
    with pytest.raises(ValueError, match=r"^token_ids must be in \[0, 8\), got "):
        state.append_token_ids(np.array([0]), np.array([-1]))
    with pytest.raises(ValueError, match=r"^rows and token_ids must have the same length, got 2 and 1\.$"):
        state.append_token_ids(np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match=r"^rows must be distinct, got "):
        state.append_token_ids(np.array([1, 1]), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"^src must be in \[0, 2\), got 5\.$"):
        state.move_row(5, 0)
    with pytest.raises(ValueError, match=r"^dst must be in \[0, 2\), got -1\.$"):
        state.move_row(0, -1)
    with pytest.raises(ValueError, match=r"^rows must be in \[0, 2\), got "):
        state.make_metadata(np.array([0, 2]))
    state.remove_request(0)
    with pytest.raises(ValueError, match=r"^rows \[0\] hold no request\.$"):
        state.make_metadata(np.array([1, 0]))
    state.append_token_ids(np.zeros(0, np.int64), np.zeros(0, np.int64))  # an empty step is fine
    assert state.num_output.tolist() == [0, 0]


def test_remove_request_resets_every_row_field_and_table() -> None:
    p = SamplingParams(
        temperature=0.5, top_k=3, top_p=0.5, min_p=0.1, presence_penalty=1.0, frequency_penalty=0.5,
        repetition_penalty=1.2, min_tokens=3, logprobs=2, seed=3, allowed_token_ids=[1, 2],
        logit_bias={4: 1.0}, _bad_words_token_ids=[[5], [6, 7]], stop_token_ids=[3], _all_stop_token_ids=[3],
    )  # fmt: skip
    state, _ = load([SamplingParams(seed=9), p], 10, prompts=[[1], [1, 2]], outputs=[[], [6]])
    assert state.tracks_history[1] and state.penalized[1] and state.has_allowed[1] and 1 in state.generators
    state.remove_request(1)
    for name, _, neutral in _ROW_FIELDS:
        assert getattr(state, name)[1] == neutral, name
    for table in (state.allowed, state.bad_single, state.bad_multi, state.logit_bias, state.stop_ids):
        assert len(table) == 0
    assert list(state.generators) == [0] and state.seen is not None and state.seen.lens[1] == 0
    state.remove_request(1)  # removing an empty row is harmless


def test_re_adding_a_row_replaces_the_previous_request() -> None:
    vocab = 10
    state, rows = load([SamplingParams(temperature=0.0, logit_bias={3: 100.0}, frequency_penalty=1.0, seed=4)], vocab)
    state.add_request(0, SamplingParams(temperature=0.0), [], [], None)
    assert len(state.logit_bias) == 0 and not state.generators and not state.penalized[0]
    logits = torch.arange(vocab, dtype=torch.float32).unsqueeze(0)
    assert Sampler()(logits, state.make_metadata(rows)).sampled_token_ids.tolist() == [vocab - 1]


def test_move_row_carries_every_table_and_clears_the_source() -> None:
    vocab = 10
    moved = SamplingParams(
        temperature=0.0,
        logit_bias={2: 30.0},
        allowed_token_ids=[2, 3, 8],
        _bad_words_token_ids=[[1, 3]],
        min_tokens=5,
        presence_penalty=0.5,
        repetition_penalty=2.0,
    )
    first = SamplingParams(temperature=0.0, logit_bias={9: 1.0})
    state, _ = load([first, SamplingParams(), moved], vocab, prompts=[[], [], [8]], outputs=[[], [], [1]], eos=2)
    ref, ref_rows = load([moved], vocab, prompts=[[8]], outputs=[[1]], eos=2)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9))
    expected = Sampler.apply_logits_processors(logits, ref.make_metadata(ref_rows))
    state.move_row(2, 0)  # over an active row: that request is dropped
    state.move_row(1, 1)  # onto itself: nothing happens
    assert state.active.tolist() == [True, True, False]
    for name, _, neutral in _ROW_FIELDS:
        assert getattr(state, name)[2] == neutral, name
    got = Sampler.apply_logits_processors(logits, state.make_metadata(np.array([0])))
    assert torch.equal(got, expected)
    assert state.history is not None and state.history[0, 0] == 1
    assert 9 not in state.logit_bias.tokens.tolist()


def test_seed_is_ignored_by_greedy_rows_and_skips_used_draws_on_resume() -> None:
    state, _ = load([SamplingParams(temperature=0.0, seed=3), SamplingParams(seed=3)], 6, outputs=[[], [1, 2]])
    assert list(state.generators) == [1]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        torch.rand(6, generator=gen)
    assert torch.equal(state.generators[1].get_state(), gen.get_state())


# ---------------------------------------------------------------------- the tables
def test_row_entries_add_remove_move_select() -> None:
    t = RowEntries()
    empty = t.select(np.array([0, -1]))
    assert len(t) == 0 and empty.tolist() == [] and empty.dtype == np.int64
    t.remove(0)  # nothing to remove
    t.add(0, [])  # an empty list adds nothing
    assert len(t) == 0 and t.prefixes.shape == (0, 0)
    t.add(0, [5, 6], values=[1.5, -2.0])
    t.add(1, [7, 8], prefixes=[[1, 2, 3], [4]])
    t.add(2, [9])
    assert t.rows.tolist() == [0, 0, 1, 1, 2] and t.tokens.tolist() == [5, 6, 7, 8, 9]
    assert t.values.tolist() == [1.5, -2.0, 0.0, 0.0, 0.0] and t.values.dtype == np.float32
    assert t.prefixes.tolist() == [[-1] * 3, [-1] * 3, [1, 2, 3], [4, -1, -1], [-1] * 3]
    assert t.prefix_lens.tolist() == [0, 0, 3, 1, 0]
    assert t.select(np.array([-1, 0, 1])).tolist() == [2, 3, 4]
    t.remove(3)  # a row with no entries: unchanged
    assert len(t) == 5
    t.remove(0)
    assert t.rows.tolist() == [1, 1, 2] and t.values.tolist() == [0.0, 0.0, 0.0]
    assert t.prefixes.tolist() == [[1, 2, 3], [4, -1, -1], [-1] * 3] and t.prefix_lens.tolist() == [3, 1, 0]
    t.move(1, 0)
    assert t.rows.tolist() == [0, 0, 2] and t.tokens.tolist() == [7, 8, 9]


def test_seen_tokens_count_outputs_grow_and_pad_with_slot_zero() -> None:
    s = SeenTokens(3)
    assert s.tokens.shape == (3, 64) and s.counts.dtype == np.int32
    s.load(0, np.array([9, 4, 4]), np.array([4, 2, 2]))
    assert s.lens.tolist() == [3, 0, 0]
    assert s.tokens[0, :3].tolist() == [2, 4, 9] and s.counts[0, :3].tolist() == [2, 1, 0]
    s.load(1, np.arange(100, 230), np.zeros(0, np.int64))  # 130 distinct: capacity doubles twice
    assert s.tokens.shape == s.counts.shape == (3, 256) and s.lens[1] == 130
    assert s.tokens[0, :3].tolist() == [2, 4, 9] and s.counts[0, :3].tolist() == [2, 1, 0]
    s.append(np.array([0, 1]), np.array([9, 5]))
    assert s.counts[0, :3].tolist() == [2, 1, 1] and s.lens.tolist() == [3, 131, 0]
    assert s.tokens[1, 130] == 5 and s.counts[1, 130] == 1
    s.append(np.array([0]), np.array([7]))
    tokens, counts = s.gather(np.array([0, 2]))
    assert tokens.shape == (2, 4)
    assert tokens.tolist() == [[2, 4, 9, 7], [0, 0, 0, 0]] and counts.tolist() == [[2, 1, 1, 1], [0, 0, 0, 0]]
    s.move(0, 2)
    assert s.lens.tolist() == [0, 131, 4] and s.gather(np.array([2]))[0].tolist() == [[2, 4, 9, 7]]
    s.clear(1)
    assert s.gather(np.array([1]))[0].tolist() == [[0]]
    s.load(2, np.zeros(0, np.int64), np.array([3]))  # a reload forgets the old entries
    tokens, counts = s.gather(np.array([2, 0]))
    assert tokens.tolist() == [[3], [0]] and counts.tolist() == [[1], [0]]


def test_seen_tokens_grow_at_the_exact_capacity_and_ignore_stale_slots() -> None:
    s = SeenTokens(2)
    s.load(0, np.arange(64), np.zeros(0, np.int64))  # full at 64
    s.append(np.array([0]), np.array([500]))  # the 65th slot: capacity doubles
    assert s.tokens.shape == s.counts.shape == (2, 128) and s.tokens[0, 64] == 500 and s.lens[0] == 65
    s.load(1, np.array([1, 2, 3]), np.zeros(0, np.int64))
    s.load(1, np.array([1]), np.zeros(0, np.int64))  # slots 1 and 2 still hold 2 and 3, past lens
    s.append(np.array([1]), np.array([2]))
    tokens, counts = s.gather(np.array([1]))
    assert tokens.tolist() == [[1, 2]] and counts.tolist() == [[0, 1]]


def test_penalties_with_a_repeated_token_in_one_row_and_padding_in_another() -> None:
    """Padding repeats slot 0, so scatters of duplicate ids write equal values; an empty row stays untouched."""
    vocab = 12
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5)
    prompts, outputs = [list(range(10)), [], [3]], [[1, 1, 2], [], []]
    state, rows = load([p, p, p], vocab, prompts=prompts, outputs=outputs)
    md = state.make_metadata(rows)
    assert md.repetition_penalties is not None and md.repetition_penalties.tolist() == [1.5, 1.0, 1.5]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(12))
    ours = Sampler.apply_logits_processors(logits, md)
    for i in range(3):
        ref = ref_processors(logits[i], p, prompts[i], outputs[i], None)
        torch.testing.assert_close(ours[i].double(), ref, atol=1e-5, rtol=1e-5)


def test_warped_logits_to_dense_with_only_narrow_or_only_dense_rows() -> None:
    narrow = WarpedLogits(2, 4, None, None, torch.tensor([1]), torch.tensor([[2.0, NEG]]), torch.tensor([[3, 0]]))
    assert narrow.to_dense().tolist() == [[NEG] * 4, [NEG, NEG, NEG, 2.0]]
    dense = WarpedLogits(2, 3, None, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), None, None, None)
    assert dense.to_dense().tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    wide = WarpedLogits(2, 3, torch.tensor([0]), torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64), None, None, None)
    assert wide.to_dense().dtype == torch.float64 and wide.to_dense().tolist() == [[1.0, 2.0, 3.0], [NEG] * 3]


def test_sampling_metadata_reports_no_penalties_only_without_penalty_tokens() -> None:
    md = SamplingMetadata(1, True, False, None, None, None, 0, None, None)
    assert md.no_penalties and md.generators == {} and md.max_num_logprobs is None
    md.penalty_token_ids = torch.zeros(1, 1, dtype=torch.int64)
    assert not md.no_penalties
