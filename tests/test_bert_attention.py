"""BERT's CPU attention (one unpadded SDPA per prompt) against the padded, key-masked batch devices run."""

from __future__ import annotations

import torch

from vllm_lite.testing.paged import make_attention_metadata
from vllm_lite.worker.models.bert import (
    MATH_ATTENTION_MAX_LEN,
    EncoderBatch,
    padded_attention,
    per_prompt_attention,
)


def _qkv(lens: list[int], heads: int = 4, dim: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(sum(lens), heads, dim, generator=g) for _ in range(3))


def test_per_prompt_attention_equals_the_padded_masked_batch_over_mixed_lengths() -> None:
    """Short prompts take the bmm + softmax path, the one past MATH_ATTENTION_MAX_LEN torch's SDPA: both exact."""
    lens = [7, 1, 30, MATH_ATTENTION_MAX_LEN, MATH_ATTENTION_MAX_LEN + 21, 12]
    md = make_attention_metadata(lens, lens, [[0]] * len(lens), 1024)
    q, k, v = _qkv(lens)
    batch = EncoderBatch.from_metadata(md, torch.device("cpu"), padded=True)
    got = per_prompt_attention(q, k, v, batch, 0.25)
    torch.testing.assert_close(got, padded_attention(q, k, v, batch, 0.25), atol=1e-5, rtol=0)


def test_each_prompt_attends_only_to_its_own_tokens() -> None:
    """Changing one prompt's keys and values leaves every other prompt's output as it was."""
    lens = [5, 9, 3]
    md = make_attention_metadata(lens, lens, [[0]] * len(lens), 1024)
    q, k, v = _qkv(lens)
    batch = EncoderBatch.from_metadata(md, torch.device("cpu"))
    before = per_prompt_attention(q, k, v, batch, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[5:14] += 1.0
    v2[5:14] -= 2.0
    after = per_prompt_attention(q, k2, v2, batch, 0.25)
    assert torch.equal(before[:5], after[:5]) and torch.equal(before[14:], after[14:])
    assert not torch.allclose(before[5:14], after[5:14])


def test_the_cpu_batch_builds_no_padded_layout() -> None:
    lens = [4, 2]
    md = make_attention_metadata(lens, lens, [[0]] * len(lens), 1024)
    batch = EncoderBatch.from_metadata(md, torch.device("cpu"))
    assert batch.query_bounds == [(0, 4), (4, 6)] and batch.gather is None and batch.key_mask is None
