"""Comparing two engines' outputs for the same prompts: speculative decoding must change nothing a user sees."""

from __future__ import annotations

from typing import Any

LOGPROB_TOL = 1e-5  # issue 20: logprobs of accepted tokens equal the non-speculative ones within this


def token_prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in ids]


def assert_same_outputs(a: list[Any], b: list[Any], logprobs: bool = False, text: bool = True) -> None:
    """Same tokens, finish reasons (and text, and logprobs with their ranks within LOGPROB_TOL when asked)."""
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            if text:
                assert cx.text == cy.text
            assert cx.finish_reason == cy.finish_reason
            if logprobs:
                assert len(cx.logprobs) == len(cy.logprobs) == len(cx.token_ids)
                for px, py in zip(cx.logprobs, cy.logprobs):
                    assert px.keys() == py.keys()
                    for tok in px:
                        assert abs(px[tok].logprob - py[tok].logprob) <= LOGPROB_TOL
                        assert px[tok].rank == py[tok].rank


def token_counts(outputs: list[Any], position: int) -> dict[int, int]:
    """How often each token id stands at ``position`` of the first completion, over many sampled runs."""
    counts: dict[int, int] = {}
    for out in outputs:
        tok = out.outputs[0].token_ids[position]
        counts[tok] = counts.get(tok, 0) + 1
    return counts
