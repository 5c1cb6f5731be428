"""prompt_logprobs when chunked prefill splits the prompt: every position against Hugging Face float32.

The prompts are longer than `max_num_batched_tokens`, and two of them share each step's token budget,
so each prompt is cut at several offsets that are not multiples of one another. A chunk that used the
wrong offset (targets or hidden rows taken from the chunk's start instead of its place in the prompt)
gives other positions' logprobs; HF's one full forward over the whole prompt does not chunk at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import hf_model_eager
from vllm_lite.testing.hf_oracle import PROMPT_TEXT

TOL = 1e-4
NUM_LOGPROBS = 5
BUDGET = 16  # max_num_batched_tokens: the 70-token prompt takes at least five chunks
LENGTHS = (70, 45)


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def run(path: str) -> tuple[list[list[int]], list[Any]]:
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
    ) as llm:
        ids = llm.get_tokenizer()(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
        prompts = [ids[i : i + n] for i, n in enumerate(LENGTHS)]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=NUM_LOGPROBS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, outs


@torch.no_grad()
def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """log_softmax over the vocabulary at every prompt position, from one unchunked HF forward."""
    logits = hf_model_eager(path)(input_ids=torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def rank_bounds(row: torch.Tensor, value: float) -> tuple[int, int]:
    """The ranks a token of logprob `value` may have in HF's `row`: any vocabulary entry within TOL of it may
    be ordered either way by float32 rounding (on CUDA 1148 vs 1147 was seen); an entry clearly above counts."""
    return int((row > value + TOL).sum()) + 1, int((row > value - TOL).sum())  # the latter counts the token too


def test_rank_bounds_allow_only_float32_ties() -> None:
    row = torch.tensor([-1.0, -2.0, -2.00005, -3.0, -2.00002])
    assert rank_bounds(row, -1.0) == (1, 1)  # nothing within TOL: the one rank
    assert rank_bounds(row, -3.0) == (5, 5)
    assert rank_bounds(row, -2.00002) == (2, 4)  # three values within TOL of one another: any order
    low, high = rank_bounds(row, -2.0)
    assert not low <= 1 <= high and not low <= 5 <= high  # a wrong rank still fails


def test_prompts_are_longer_than_the_step_budget(run) -> None:
    prompts, _ = run
    assert all(len(p) > 2 * BUDGET for p in prompts)


@pytest.mark.parametrize("which", range(len(LENGTHS)))
def test_every_prompt_position_matches_hf_across_chunk_boundaries(path: str, run, which: int) -> None:
    prompts, outs = run
    prompt, out = prompts[which], outs[which]
    plps = out.prompt_logprobs
    assert plps is not None and len(plps) == len(prompt), "one entry per prompt token"
    assert plps[0] is None, "the first prompt token has no logprob"
    hf = hf_prompt_logprobs(path, prompt)
    for pos in range(1, len(prompt)):
        row, tok, got = hf[pos - 1], prompt[pos], plps[pos]
        assert got is not None and tok in got, f"position {pos}: the actual prompt token is missing"
        assert abs(got[tok].logprob - float(row[tok])) < TOL, f"position {pos}: {got[tok].logprob} vs {float(row[tok])}"
        low, high = rank_bounds(row, float(row[tok]))
        assert low <= got[tok].rank <= high, (
            f"position {pos}: rank {got[tok].rank} of the prompt token, HF {low}..{high}"
        )
        top = row.topk(NUM_LOGPROBS)
        ours = sorted(((lp.rank, t, lp.logprob) for t, lp in got.items() if lp.rank <= NUM_LOGPROBS))
        assert [r for r, _, _ in ours] == list(range(1, NUM_LOGPROBS + 1)), f"position {pos}: ranks {ours}"
        for (_, t, v), hf_id, hf_v in zip(ours, top.indices.tolist(), top.values.tolist()):
            assert abs(v - hf_v) < TOL, f"position {pos}: top value {v} vs HF {hf_v}"
            # The same id, unless HF itself has the two within TOL (a float32 tie, either order is right).
            assert t == hf_id or abs(float(row[t]) - hf_v) < TOL, f"position {pos}: top id {t} vs HF {hf_id}"
