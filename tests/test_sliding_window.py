"""Sliding-window attention: every backend against the naive masked oracle, and the KV blocks a windowed model keeps."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import (
    poison_blocks_before_window,
    random_attention_case,
    reference_paged_attention,
)
from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
from vllm_lite.worker.attention.torch_ref import TorchRefBackend

# Decodes with and without context, a first prefill, chunks with context (one spanning many key tiles).
QUERY_LENS = [1, 1, 5, 1, 9, 40]
SEQ_LENS = [1, 40, 5, 70, 30, 75]


def _backends() -> list:
    backends = [("torch", lambda: TorchRefBackend()), ("torch-expand-kv", lambda: TorchRefBackend(True))]
    if load_cpu_ops():
        from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

        backends.append(("cpu", CpuNativeBackend))
    return backends


BACKENDS = _backends()


@pytest.mark.parametrize("name,make", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize(
    "window,soft_cap,block_size,head_size,gqa,dtype",
    [
        (1, None, 16, 64, 2, torch.float32),  # each query sees only itself
        (20, None, 16, 64, 4, torch.float32),
        (7, None, 1, 32, 1, torch.float32),
        (33, 0.5, 8, 32, 2, torch.float32),  # Gemma 2: window with soft-capping
        (None, 0.5, 16, 64, 2, torch.float32),
        (20, None, 16, 64, 2, torch.bfloat16),
        (20, None, 16, 40, 2, torch.float32),  # head size without a vector fast path
    ],
)
def test_windowed_attention_matches_masked_oracle_without_reading_blocks_before_window(
    name, make, window, soft_cap, block_size, head_size, gqa, dtype
) -> None:
    """Keys in (p - W, p] only; blocks wholly before the window hold NaN, so any read of them shows."""
    query, cache, md = random_attention_case(QUERY_LENS, SEQ_LENS, 2 * gqa, 2, head_size, block_size, dtype, seed=1)
    scale = 1.0 / math.sqrt(head_size)
    expected = reference_paged_attention(query, cache, md, scale, window, soft_cap)
    if window is not None:
        cache = poison_blocks_before_window(cache, md, window)
        assert torch.isnan(cache).any(), "the case must have blocks before some window"
    out = make().forward(query, cache, md, scale, window, soft_cap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_window_changes_the_output_for_queries_past_it() -> None:
    """The window cases above are not vacuous: without the window the same queries give other values."""
    query, cache, md = random_attention_case(QUERY_LENS, SEQ_LENS, 4, 2, 64, 16, torch.float32, seed=1)
    full = reference_paged_attention(query, cache, md, 0.125)
    windowed = reference_paged_attention(query, cache, md, 0.125, 20)
    assert not torch.allclose(full, windowed, atol=1e-3)
