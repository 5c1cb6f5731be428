"""A slow, obviously-correct paged attention in float64: the oracle that kernel tests compare against."""

from __future__ import annotations

from typing import Optional

import torch

from vllm_lite.testing.paged import make_attention_metadata, random_block_tables
from vllm_lite.worker.attention.backend import AttentionMetadata


def reference_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
) -> torch.Tensor:
    """Per request: gather its keys through the block table, mask keys after each row's position, softmax.

    With a window W a row at position p sees keys in (p - W, p]; keys no row of the request sees are
    not even gathered (their blocks may hold garbage). A soft cap c maps scores to c * tanh(s / c)."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    group = query.shape[1] // num_kv_heads
    query, kv_cache = query.cpu(), kv_cache.cpu()
    table = md.block_table.cpu()
    out = torch.empty(query.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    for b in range(md.num_reqs):
        q0, q1, s = qsl[b], qsl[b + 1], seq_lens[b]
        first = 0 if sliding_window is None else max(0, s - (q1 - q0) - sliding_window + 1)
        pos = torch.arange(first, s)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        k = kv_cache[0].reshape(-1, num_kv_heads, head_size)[slots].double().repeat_interleave(group, 1)
        v = kv_cache[1].reshape(-1, num_kv_heads, head_size)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].double(), k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        qpos = torch.arange(s - (q1 - q0), s).view(1, -1, 1)
        hidden = pos.view(1, 1, -1) > qpos
        if sliding_window is not None:
            hidden |= pos.view(1, 1, -1) <= qpos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def poison_blocks_before_window(kv_cache: torch.Tensor, md: AttentionMetadata, window: int) -> torch.Tensor:
    """A copy of the cache with NaN in every block wholly before each request's window.

    Those blocks may be freed and reused by the KV-cache manager, so a windowed kernel must never
    read them; NaN there makes any read visible in the output."""
    block_size = kv_cache.shape[2]
    out = kv_cache.clone()
    qsl, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    table = md.block_table.cpu()
    for b in range(md.num_reqs):
        first_visible = max(0, seq_lens[b] - (qsl[b + 1] - qsl[b]) - window + 1)
        for j in range(first_visible // block_size):
            out[:, int(table[b, j])] = float("nan")
    return out


def random_attention_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, kv_cache, metadata): a cache full of random values (never zeros) and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=seed)
    md = make_attention_metadata(query_lens, seq_lens, tables, block_size)
    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g) * 2).to(dtype)
    query = torch.randn(md.num_actual_tokens, num_heads, head_size, generator=g).to(dtype)
    return query, cache, md
