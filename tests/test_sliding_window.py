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


# ---------------------------------------------------------------------------- KV-cache manager with a window


def _request(rid: str, n: int, start: int = 0):
    from vllm_lite.core.request import Request
    from vllm_lite.sampling_params import SamplingParams

    return Request(rid, list(range(start, start + n)), SamplingParams(), None, 0.0)


def test_kv_manager_frees_blocks_wholly_before_the_window_and_frees_the_rest_once() -> None:
    """W=6, blocks of 4: a step starting at token c needs keys from c - 5, so earlier blocks go back."""
    from vllm_lite.core.kv_cache_manager import KVCacheManager

    m = KVCacheManager(num_blocks=20, block_size=4, sliding_window=6)
    r = _request("a", 13)
    assert len(m.allocate_slots(r, 8)) == 2  # chunk 0..7
    r.num_computed_tokens = 8
    m.cache_blocks(r, 8)
    assert len(m.allocate_slots(r, 5)) == 2  # chunk 8..12: keys from 3 on, block 0 is kept
    assert m.num_blocks_in_use("a") == 4
    r.num_computed_tokens = 13
    r.append_output_token_ids(7)
    m.allocate_slots(r, 1)  # decode at 13: keys from 8 on, blocks 0 and 1 are freed
    ids = m.get_block_ids("a")
    assert ids[:2] == [0, 0] and m.num_blocks_in_use("a") == 2
    assert m.num_free_blocks == 19 - 2
    m.free(r)  # the null placeholders are not freed a second time
    assert m.num_free_blocks == 19


def test_kv_manager_without_window_or_with_mixed_layers_frees_nothing_early() -> None:
    from vllm_lite.core.kv_cache_manager import KVCacheManager

    m = KVCacheManager(num_blocks=20, block_size=4, sliding_window=None)
    r = _request("a", 40)
    m.allocate_slots(r, 40)
    r.num_computed_tokens = 40
    r.append_output_token_ids(1)
    m.allocate_slots(r, 1)
    assert m.num_blocks_in_use("a") == 11


def test_prefix_hit_blocks_behind_the_window_are_released_at_admission() -> None:
    """A hit that covers more than the window keeps only the blocks the first new token can see."""
    from vllm_lite.core.kv_cache_manager import KVCacheManager

    m = KVCacheManager(num_blocks=30, block_size=4, sliding_window=6)
    a = _request("a", 24)
    m.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    m.cache_blocks(a, 24)
    m.free(a)
    b = _request("b", 26)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 24
    m.allocate_slots(b, 2, num_hit, hits)
    # First new token is 24: keys from 19 on, i.e. block 4 onwards; blocks 0-3 released.
    assert m.get_block_ids("b")[:4] == [0, 0, 0, 0] and m.num_blocks_in_use("b") == 3
    m.free(b)
    assert m.num_free_blocks == m.num_total_blocks


def test_swap_copies_only_blocks_inside_the_window_and_restores_the_placeholders() -> None:
    from vllm_lite.core.kv_cache_manager import KVCacheManager

    m = KVCacheManager(num_blocks=20, block_size=4, sliding_window=6, num_cpu_blocks=10)
    r = _request("a", 20)
    m.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    r.append_output_token_ids(5)
    m.allocate_slots(r, 1)  # keys from 15 on: blocks 0-2 freed
    assert m.num_blocks_in_use("a") == 3
    out = m.swap_out(r)
    assert len(out) == 3 and m.host_pool.get_num_free_blocks() == 7
    back = m.swap_in(r, 1)
    assert len(back) == 3 and m.get_block_ids("a")[:3] == [0, 0, 0] and m.num_blocks_in_use("a") == 3
    assert [d for _, d in back] == m.get_block_ids("a")[3:]
    m.free(r)
    assert m.num_free_blocks == m.num_total_blocks and m.host_pool.get_num_free_blocks() == 10
