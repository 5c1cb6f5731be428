"""The attention layer models use: writes this step's K/V to its paged cache, then attends."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm_lite.worker.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention for one transformer layer. The runner binds `kv_cache` after allocating it."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}.")
        self.kv_cache: Optional[torch.Tensor] = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        rotary_emb: Optional[nn.Module] = None,
    ) -> torch.Tensor:
        """query [T, H*D], key/value [T, KVH*D] -> [T, H*D].

        With `rotary_emb` (a RotaryEmbedding) and `positions`, query and key are rotated first, as
        `rotary_emb(positions, query, key)` does; where the backend can (`fuses_rotary_kv_write`: Triton) and the
        rotary's kernels run (CUDA), the rotation of q and k and the K/V cache write are one kernel."""
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound: allocate the KV cache before running the model.")
        ctx = get_forward_context()
        md = ctx.metadata
        n = md.num_actual_tokens
        if rotary_emb is not None:
            if positions is None:
                raise ValueError("Attention: rotary_emb needs positions.")
            if getattr(ctx.backend, "fuses_rotary_kv_write", False) and rotary_emb.rotate_and_write_kv(
                positions, query[:n], key[:n], value[:n], self.kv_cache, md.slot_mapping
            ):
                q = query[:n].view(n, self.num_heads, self.head_size)
                out = ctx.backend.forward(q, self.kv_cache, md, self.scale, self.sliding_window, self.logits_soft_cap)
                return out.reshape(n, self.num_heads * self.head_size)
            query, key = rotary_emb(positions, query, key)
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        ctx.backend.write_kv_step(k, v, self.kv_cache, md)
        out = ctx.backend.forward(q, self.kv_cache, md, self.scale, self.sliding_window, self.logits_soft_cap)
        return out.reshape(n, self.num_heads * self.head_size)
