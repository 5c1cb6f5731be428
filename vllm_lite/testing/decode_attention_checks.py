"""What the CPU decode attention tests share (tests/test_cpu_attention_decode_bf16.py and _f32.py, one a cache
dtype): context lengths that cross the kernels' tiles and chunks, a backend's output checked against the float64
oracle, and the property greedy decoding relies on: a request decodes the same bits alone in a batch and on one
thread as in a batch on all of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from vllm_lite.testing.attention_oracle import random_attention_case, reference_paged_attention
from vllm_lite.testing.torch_threads import torch_threads

if TYPE_CHECKING:
    from vllm_lite.worker.attention.backend import AttentionMetadata
    from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

# Decodes only: no context, one tile, a partial tile, one chunk exactly, and several chunks with a partial one.
DECODE_SEQ_LENS = [1, 16, 37, 256, 257, 700, 1001]


def assert_matches_oracle(
    backend: "CpuNativeBackend",
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: "AttentionMetadata",
    scale: float,
    tol: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """The backend's output for the step, within tol (absolute and relative) of the float64 oracle's; returned."""
    out = backend.forward(query, kv_cache, md, scale, sliding_window)
    expected = reference_paged_attention(query, kv_cache, md, scale, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return out


def assert_decode_bits_alone_and_on_one_thread(
    backend: "CpuNativeBackend", num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> None:
    """Four requests (three decodes and a 7-token chunk) as one batch; the second, a decode at 600 keys, again as
    the only request of a batch (its block table row and its query row alone), and the batch again on one thread:
    the same bits each time."""
    query, cache, md = random_attention_case(
        [1, 1, 7, 1], [300, 600, 40, 90], num_heads, num_kv_heads, head_size, 16, dtype, seed=11
    )
    together = backend.forward(query, cache, md, 0.125)
    _, _, solo_md = random_attention_case([1], [600], num_heads, num_kv_heads, head_size, 16, dtype, seed=11)
    solo_md.block_table[0, :38] = md.block_table[1, :38]
    solo = backend.forward(query[1:2].contiguous(), cache, solo_md, 0.125)
    assert torch.equal(solo[0], together[1])
    with torch_threads(1):
        one = backend.forward(query, cache, md, 0.125)
    assert torch.equal(one, together)
