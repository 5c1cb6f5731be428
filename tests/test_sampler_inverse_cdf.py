"""Unseeded CPU rows draw by inverse CDF (sampler.inverse_cdf_sample): the softmax distribution, never a token
without mass, whatever the uniform; seeded rows keep their own race (tests/test_sampler_rules.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.chi_square import chi_square_pvalue
from vllm_lite.worker import sampler as sampler_mod
from vllm_lite.worker.sampler import inverse_cdf_sample


def test_draws_follow_the_distribution_over_a_large_vocabulary() -> None:
    vocab, n = 32000, 6000
    logits = torch.full((vocab,), float("-inf"))
    live = torch.tensor([0, 7, 500, 12345, 31990, 31998])  # mass spread far apart in the row
    logits[live] = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    probs = logits.softmax(-1).expand(n, vocab)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        got = inverse_cdf_sample(probs)
    counts = torch.bincount(got, minlength=vocab)
    assert counts.sum() == counts[live].sum() == n  # nothing outside the live tokens
    assert chi_square_pvalue(counts[live], probs[0, live]) > 1e-4


@pytest.mark.parametrize("u", [0.0, 1.0])  # 1.0: as when u * total rounds up to the total
def test_extreme_uniforms_pick_the_first_and_last_tokens_with_mass(monkeypatch: pytest.MonkeyPatch, u: float) -> None:
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=kw.get("dtype")))
    got = inverse_cdf_sample(probs).tolist()
    assert got == ([2, 1] if u == 0.0 else [4, 2])


def test_cpu_unseeded_dense_rows_draw_one_uniform_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise tensor of the race is gone from the unseeded CPU path: one uniform per row."""
    shapes: list[tuple[int, ...]] = []
    real = torch.rand

    def rand(*args, **kwargs):
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "rand", rand)
    logits = torch.randn(3, 1000)
    got = sampler_mod._race(logits, None, None, {}, 1000)
    assert got.shape == (3,) and shapes == [(3, 1)]
