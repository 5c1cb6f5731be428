"""SamplingState.make_metadata hands out its last result again while the same rows come back unchanged (issue #14:
the steady decode step rebuilt identical metadata, and copied it to the device, every step).

Two persistent batches take the same random requests, joins, leaves (condensing), sampled tokens and min_tokens
progress; one reuses metadata, the other (`reuse_metadata = False`) builds it every step. Their metadata and their
sampled tokens must be equal at every step: across batch changes, mixed greedy / random / seeded rows, penalties,
min_tokens bans, single- and multi-token bad words, logit bias, allowed tokens and logprobs coming and going.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.sampler import Sampler
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.step import NewRequestData

VOCAB = 40
EOS = 2


def _params(rng: np.random.Generator) -> SamplingParams:
    kind = int(rng.integers(0, 16))
    if kind <= 3 or kind >= 12:
        return SamplingParams(temperature=0.0, max_tokens=1000)  # greedy: the common case, reused
    if kind == 4:
        return SamplingParams(temperature=0.9, top_k=5, seed=int(rng.integers(0, 1000)), max_tokens=1000)
    if kind == 5:
        return SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, max_tokens=1000)
    if kind == 6:
        return SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.3, max_tokens=1000)
    if kind == 7:
        return SamplingParams(temperature=0.0, min_tokens=int(rng.integers(1, 4)), max_tokens=1000)
    if kind == 8:
        return SamplingParams(temperature=0.0, _bad_words_token_ids=[[5], [3, 4]], max_tokens=1000)
    if kind == 9:
        return SamplingParams(temperature=0.0, _bad_words_token_ids=[[6]], logit_bias={7: 4.0}, max_tokens=1000)
    if kind == 10:
        return SamplingParams(temperature=0.0, allowed_token_ids=[3, 4, 5, 8, 9], logprobs=2, max_tokens=1000)
    return SamplingParams(temperature=0.7, max_tokens=1000, logprobs=1)


def _new(rid: str, params: SamplingParams, rng: np.random.Generator) -> NewRequestData:
    prompt = rng.integers(3, VOCAB, size=int(rng.integers(2, 6))).tolist()
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling_params=params,
        block_ids=[0],
        num_computed_tokens=len(prompt),
        eos_token_id=EOS,
    )


def _same(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):  # generators: same rows, same stream position
        return a.keys() == b.keys() and all(torch.equal(a[k].get_state(), b[k].get_state()) for k in a)
    return a == b


def assert_same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        assert _same(getattr(a, f.name), getattr(b, f.name)), f.name


def _pair() -> tuple[InputBatch, InputBatch]:
    fast = InputBatch(16, 64, 4, VOCAB, torch.device("cpu"))
    slow = InputBatch(16, 64, 4, VOCAB, torch.device("cpu"))
    slow.sampling.reuse_metadata = False
    return fast, slow


@pytest.mark.parametrize("seed", range(12))
def test_reused_metadata_and_tokens_equal_building_every_step(seed):
    rng = np.random.default_rng(seed)
    fast, slow = _pair()
    sampler = Sampler()
    live: list[str] = []
    next_id = 0
    reused = 0
    for step in range(80):
        # Mostly steady steps (the same rows again), sometimes a join or a leave (condensing moves the last row).
        r = rng.random()
        if (r < 0.1 or not live) and len(live) < 16:
            params = _params(rng)
            state = rng.bit_generator.state
            fast.add_request(_new(f"r{next_id}", params, rng))
            rng.bit_generator.state = state
            slow.add_request(_new(f"r{next_id}", params, rng))
            live.append(f"r{next_id}")
            next_id += 1
        elif r < 0.16 and len(live) > 1:
            gone = live.pop(int(rng.integers(0, len(live))))
            assert fast.remove_request(gone) and slow.remove_request(gone)
        order = live if rng.random() < 0.9 else list(rng.permutation(live))  # now and then another row order
        rows = fast.rows_of(order)
        assert np.array_equal(rows, slow.rows_of(order))
        before = fast.sampling._md_cache
        md_fast = fast.sampling_metadata(rows)
        md_slow = slow.sampling_metadata(rows)
        assert_same_metadata(md_fast, md_slow)
        reused += before is not None and md_fast is before[3]
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed * 1000 + step)) * 3
        torch.manual_seed(step)
        out_fast = sampler(logits.clone(), md_fast)
        torch.manual_seed(step)
        out_slow = sampler(logits.clone(), md_slow)
        assert torch.equal(out_fast.sampled_token_ids, out_slow.sampled_token_ids), step
        lp_fast, lp_slow = out_fast.logprobs_tensors, out_slow.logprobs_tensors
        assert (lp_fast is None) == (lp_slow is None)
        if lp_fast is not None:
            for name in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
                assert torch.equal(getattr(lp_fast, name), getattr(lp_slow, name)), name
        toks = out_fast.sampled_token_ids.numpy()
        if step % 2:  # the synchronous path's record ...
            fast.record_sampled(rows, toks)
            slow.record_sampled(rows, toks)
        else:  # ... and async scheduling's: counted at launch, values later
            for b in (fast, slow):
                b.note_sampled(rows, step)
                b.fill_pending(toks, step)
    assert reused > 10  # the fast path ran (steady steps of static batches)


def test_steady_greedy_batch_reuses_and_any_row_change_rebuilds():
    fast, _ = _pair()
    rng = np.random.default_rng(0)
    for i in range(4):
        fast.add_request(_new(f"g{i}", SamplingParams(temperature=0.0), rng))
    rows = fast.rows_of(["g0", "g1", "g2", "g3"])
    md = fast.sampling_metadata(rows)
    assert fast.sampling_metadata(rows.copy()) is md  # same rows, nothing changed
    fast.record_sampled(rows, np.array([5, 6, 7, 8]))  # tokens alone change nothing a greedy batch reads
    assert fast.sampling_metadata(rows) is md
    assert fast.sampling_metadata(rows[::-1].copy()) is not md  # another order
    md = fast.sampling_metadata(rows)
    fast.add_request(_new("s", SamplingParams(temperature=1.0, seed=3), rng))
    md2 = fast.sampling_metadata(rows)  # same rows, but a row was added: built again (and equal)
    assert md2 is not md
    assert_same_metadata(md, md2)
    # Condensing: g1 leaves, the seeded request moves into its row; the rows asked for are the same numbers.
    fast.remove_request("g1")
    md3 = fast.sampling_metadata(rows)
    assert md3 is not md2 and not md3.all_greedy and md3.generators


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=0.0, _bad_words_token_ids=[[3, 4]]),
    ],
    ids=["penalties", "min_tokens", "multi_token_bad_words"],
)
def test_per_step_metadata_is_never_reused(params):
    """Penalties read the output counts, min_tokens bans the output count, multi-token bad words the history:
    their metadata follows the tokens, so it is built again each step while it can still change."""
    fast, slow = _pair()
    rng = np.random.default_rng(1)
    for b in (fast, slow):
        b.add_request(_new("p", params, np.random.default_rng(1)))
        b.add_request(_new("g", SamplingParams(temperature=0.0), np.random.default_rng(2)))
    rows = fast.rows_of(["p", "g"])
    seen = []
    for tok in (3, 4, 3, 9):
        md = fast.sampling_metadata(rows)
        assert all(md is not m for m in seen)
        seen.append(md)
        assert_same_metadata(md, slow.sampling_metadata(rows))
        for b in (fast, slow):
            b.record_sampled(rows, np.array([tok, int(rng.integers(3, VOCAB))]))
    if params.min_tokens:  # the ban is over (the count passed min_tokens): from here on it is reused
        md = fast.sampling_metadata(rows)
        assert md.banned_index is None and fast.sampling_metadata(rows) is md


@pytest.mark.parametrize("change", ["remove", "move"])
def test_rows_that_lost_their_request_are_refused_after_reuse(change):
    """Reuse never skips make_metadata's checks: a row removed or moved away since is an error, as when building."""
    from vllm_lite.worker.sampling_state import SamplingState

    state = SamplingState(4, VOCAB, 64, torch.device("cpu"))
    state.add_request(0, SamplingParams(temperature=0.0), [3, 4], [], EOS)
    state.add_request(2, SamplingParams(temperature=0.0), [5, 6], [], EOS)
    rows = np.array([0, 2])
    md = state.make_metadata(rows)
    assert state.make_metadata(rows) is md
    if change == "remove":
        state.remove_request(2)
    else:
        state.move_row(2, 1)
    with pytest.raises(ValueError, match="hold no request"):
        state.make_metadata(rows)
