"""Comparing two engines' outputs for the same prompts: speculative decoding must change nothing a user sees."""

from __future__ import annotations

from typing import Any

LOGPROB_TOL = 1e-5  # issue 20: logprobs of accepted tokens equal the non-speculative ones within this

# Prompts whose continuations repeat spans of themselves (n-gram lookups hit), for the tiny llama checkpoint.
REPEATING = [[5, 6, 7, 8, 9, 10] * 3 + [5, 6, 7], [40, 41, 42, 43] * 4 + [40], [300, 301, 302, 300, 301]]


def tiny_llm(**kwargs: Any) -> Any:
    """The spec-decode tests' engine: the tiny llama checkpoint, float32, in-process, one thread, 128 tokens."""
    from vllm_lite import LLM
    from vllm_lite.testing.checkpoints import get_checkpoint

    return LLM(
        model=get_checkpoint("llama"),
        dtype="float32",
        max_model_len=128,
        multiprocess=False,
        num_threads=1,
        disable_log_stats=True,
        **kwargs,
    )


def record_params() -> list[Any]:
    """Sampling settings whose rows record emitted tokens differently (greedy, penalties, bad words, top-k): the
    recording tests draw each request's from these."""
    from vllm_lite.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, _bad_words_token_ids=[[14], [15, 16]]),
        SamplingParams(temperature=0.8, top_k=5),
    ]


def record_requests() -> Any:
    """Hypothesis: 1-4 requests as (index into record_params(), prompt length 1-23, output tokens 0-3)."""
    from hypothesis import strategies as st

    n = len(record_params())
    return st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 23), st.integers(0, 3)), min_size=1, max_size=4)


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


def recording_batches(reqs: list[tuple[int, int, int]], vocab: int = 32, max_len: int = 24) -> tuple[list[Any], Any]:
    """Two identical CPU InputBatches holding `reqs` (record_requests()' draws: params index, prompt length, output
    tokens), random prompts and outputs, and the generator that made them (for the tokens a test records next)."""
    import numpy as np
    import torch

    from vllm_lite.worker.input_batch import InputBatch
    from vllm_lite.worker.step import NewRequestData

    params = record_params()
    batches = [InputBatch(4, max_len, 6, vocab, torch.device("cpu")) for _ in range(2)]
    rng = np.random.default_rng(len(reqs))
    for i, (p, n_prompt, n_out) in enumerate(reqs):
        prompt = rng.integers(0, vocab, size=n_prompt).tolist()
        outputs = rng.integers(0, vocab, size=min(n_out, max_len - n_prompt)).tolist()
        for b in batches:
            b.add_request(NewRequestData(f"r{i}", prompt, outputs, params[p], [1], 0, 2))
    return batches, rng


def assert_same_recording(got: Any, ref: Any, rows: Any) -> None:
    """Two batches after recording emitted tokens for `rows`: the same token counts, each row's tokens, output
    counts, bad-word history and penalty tables."""
    import numpy as np
    import torch

    rows = np.asarray(rows, dtype=np.int64)
    assert got.num_tokens.tolist() == ref.num_tokens.tolist()
    for r in rows.tolist():
        n = int(ref.num_tokens[r])
        assert got.token_ids[r, :n].tolist() == ref.token_ids[r, :n].tolist()
    assert got.sampling.num_output.tolist() == ref.sampling.num_output.tolist()
    if ref.sampling.history is not None:
        assert np.array_equal(got.sampling.history, ref.sampling.history)
    md_got, md_ref = got.sampling_metadata(rows), ref.sampling_metadata(rows)
    for name in ("penalty_token_ids", "penalty_output_counts", "banned_index"):
        a, b = getattr(md_got, name), getattr(md_ref, name)
        assert (a is None) == (b is None), name
        if isinstance(a, tuple):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), name
        elif a is not None:
            assert torch.equal(a, b), name
