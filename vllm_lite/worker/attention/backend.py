"""The attention-backend interface: one flattened, mixed batch over a paged KV cache.

A step's tokens from many requests are concatenated: request i owns query rows
query_start_loc[i]:query_start_loc[i+1] (a prefill chunk or a single decode).
Its context is seq_lens[i] tokens long, the last (query_len) of which are this
step's tokens; keys/values of all of them are read from the paged cache
through block_table[i] after this step's K/V are written at slot_mapping.

KV cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_size]
(index 0 = keys, 1 = values). Slot s lives at block s // block_size, offset s % block_size.

Per-layer options every backend honours: `sliding_window` W (a query at
position p sees keys in (p - W, p], Hugging Face's convention for Mistral,
Qwen2 and Gemma 2) and `logits_soft_cap` c (scores become c * tanh(s / c)
after scaling, before the mask and softmax, as Gemma 2 does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # T: rows of q/k/v that are real
    num_reqs: int  # B
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [B+1], on the device
    seq_lens: torch.Tensor  # int32 [B], on the device
    block_table: torch.Tensor  # int32 [B, max_blocks_per_req], on the device
    slot_mapping: torch.Tensor  # int64 [T], on the device
    query_start_loc_cpu: torch.Tensor  # int32 [B+1], CPU copy for host-side decisions
    seq_lens_cpu: torch.Tensor  # int32 [B], CPU copy
    # int32 [B], on the device: each request's known tokens (prompt + outputs so far), which a chunk of a long
    # prompt has before its seq_len does; read by models whose rotation depends on it (LongRoPE). None: seq_lens.
    num_tokens: Optional[torch.Tensor] = None


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes causal attention for the mixed batch."""

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value: [T, num_kv_heads, head_size]; writes row t at slot_mapping[t]."""

    def write_kv_step(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """write_kv at the step's slots (metadata.slot_mapping); a backend may reuse what it prepared for the step."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        """Returns [T, num_heads, head_size]. K/V for this step are already in the cache.

        Blocks wholly before a window may have been freed (their block-table entries are then
        stale), so a windowed backend must not read them."""

    def copy_blocks(self, kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
        """Duplicate blocks within each layer's cache: src_to_dst int64 [N, 2]."""
        if src_to_dst.numel() == 0:
            return
        src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]

    def swap_blocks(
        self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_to_dst: torch.Tensor
    ) -> None:
        """Move blocks between two sets of caches (device <-> host swap space)."""
        if src_to_dst.numel() == 0:
            return
        src = src_to_dst[:, 0].to(src_caches[0].device)
        dst = src_to_dst[:, 1].to(dst_caches[0].device)
        for s, d in zip(src_caches, dst_caches):
            d[:, dst] = s[:, src].to(d.device, non_blocking=False)
