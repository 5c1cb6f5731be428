"""PyTorch reference attention backend: correct on any device, the oracle for native kernels.

The mixed batch is split (on the host, once per step) into two groups: decode
rows (query_len == 1) and prefill rows (query_len > 1). Each group is padded
to [R, max_q] queries, gathers its keys/values from the paged cache through
the block table in one indexing op, and runs one batched
`scaled_dot_product_attention` with a causal-with-offset mask. Splitting keeps
a single long prefill from padding every decode row to its length.

With a sliding window each request gathers only the blocks from the first one
its earliest query can see: blocks before it may already be freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class _Group:
    """One padded sub-batch: which tokens/requests it holds and where they sit."""

    tok_idx: torch.Tensor  # int64 [N]: flattened token rows of this group
    pad_pos: torch.Tensor  # int64 [N]: row * max_q + j in the padded query
    req_idx: torch.Tensor  # int64 [R]: requests of this group (rows of block_table)
    mask: torch.Tensor  # bool [R, 1, max_q, max_s]: True = may attend
    first_block: torch.Tensor  # int64 [R]: first block-table column gathered (0 without a window)
    num_reqs: int
    max_q: int
    max_s: int  # keys gathered per request, counted from its first gathered block
    num_blocks: int  # blocks per request to gather: ceil(max_s / block_size)


def _build_group(
    req_ids: torch.Tensor,  # int64 CPU [R]
    q_start: torch.Tensor,  # int64 CPU [B]
    q_lens: torch.Tensor,  # int64 CPU [B]
    seq_lens: torch.Tensor,  # int64 CPU [B]
    block_size: int,
    device: torch.device,
    window: Optional[int] = None,
) -> Optional[_Group]:
    r = int(req_ids.numel())
    if r == 0:
        return None
    ql = q_lens[req_ids]
    sl = seq_lens[req_ids]
    max_q = int(ql.max())
    n = int(ql.sum())
    # Token rows for each request: q_start[i] + 0..ql[i]-1, laid out request by request.
    row_of_tok = torch.repeat_interleave(torch.arange(r), ql, output_size=n)
    first_tok = torch.cumsum(ql, 0) - ql
    j = torch.arange(n) - first_tok[row_of_tok]
    tok_idx = q_start[req_ids][row_of_tok] + j
    pad_pos = row_of_tok * max_q + j
    ctx = sl - ql  # position of each request's first query token
    if window is None:
        first_block = torch.zeros(r, dtype=torch.int64)
    else:
        first_block = torch.clamp(ctx - window + 1, min=0) // block_size
    num_blocks = int(((sl + block_size - 1) // block_size - first_block).max())
    max_s = num_blocks * block_size
    # Query j (position ctx + j) sees keys at positions <= ctx + j (and > ctx + j - window).
    qpos = ctx.view(r, 1, 1) + torch.arange(max_q).view(1, max_q, 1)
    kpos = (first_block * block_size).view(r, 1, 1) + torch.arange(max_s).view(1, 1, max_s)
    mask = (kpos <= qpos) & (kpos < sl.view(r, 1, 1))
    if window is not None:
        mask &= kpos > qpos - window
    return _Group(
        tok_idx=tok_idx.to(device, non_blocking=True),
        pad_pos=pad_pos.to(device, non_blocking=True),
        req_idx=req_ids.to(device, non_blocking=True),
        mask=mask.unsqueeze(1).to(device, non_blocking=True),
        first_block=first_block.to(device, non_blocking=True),
        num_reqs=r,
        max_q=max_q,
        max_s=max_s,
        num_blocks=num_blocks,
    )


class TorchRefBackend(AttentionBackend):
    """Reference paged attention in plain PyTorch (float32 softmax for bf16 inputs)."""

    name = "torch_ref"

    def __init__(self, expand_kv_heads: Optional[bool] = None) -> None:
        # Repeat KV heads to match query heads before SDPA (None: on non-CPU devices, where the
        # fused kernels need it; CPU broadcasts GQA natively). Tests force it to cover that path.
        self.expand_kv_heads = expand_kv_heads
        # The plan depends only on the step's metadata, so all layers of a step share it.
        self._plan_for: Optional[AttentionMetadata] = None
        self._plan_block_size = 0
        self._plans: dict[Optional[int], list[_Group]] = {}  # by sliding window

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        n = key.shape[0]
        kvh, d = kv_cache.shape[-2], kv_cache.shape[-1]
        slots = slot_mapping[:n]
        kv_cache[0].view(-1, kvh, d).index_copy_(0, slots, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, kvh, d).index_copy_(0, slots, value.to(kv_cache.dtype))

    def _get_plan(
        self, md: AttentionMetadata, block_size: int, device: torch.device, window: Optional[int]
    ) -> list[_Group]:
        if self._plan_for is not md or self._plan_block_size != block_size:
            self._plans = {}
            self._plan_for = md
            self._plan_block_size = block_size
        if window in self._plans:
            return self._plans[window]
        qsl = md.query_start_loc_cpu[: md.num_reqs + 1].to(torch.int64)
        q_start = qsl[:-1]
        q_lens = qsl[1:] - q_start
        seq_lens = md.seq_lens_cpu[: md.num_reqs].to(torch.int64)
        all_reqs = torch.arange(md.num_reqs)
        groups = [
            _build_group(all_reqs[q_lens == 1], q_start, q_lens, seq_lens, block_size, device, window),
            _build_group(all_reqs[q_lens > 1], q_start, q_lens, seq_lens, block_size, device, window),
        ]
        self._plans[window] = [g for g in groups if g is not None]
        return self._plans[window]

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        n, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}.")
        out = torch.empty_like(query)
        for g in self._get_plan(metadata, block_size, query.device, sliding_window):
            o = self._attend(query, kv_cache, metadata.block_table, g, scale, logits_soft_cap)
            out.index_copy_(0, g.tok_idx, o)
        return out

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        g: _Group,
        scale: float,
        soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        """Attention for one group; returns rows aligned with g.tok_idx."""
        _, num_heads, head_size = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        rows = block_table.index_select(0, g.req_idx).to(torch.int64)
        cols = g.first_block.view(-1, 1) + torch.arange(g.num_blocks, device=rows.device).view(1, -1)
        # Columns past a request's own blocks are fully masked; clamp them onto the table.
        blocks = rows.gather(1, cols.clamp_(max=rows.shape[1] - 1)).reshape(-1)
        # index_select over flattened blocks (several times faster than advanced indexing on CPU):
        # [2, R*nb, bs*KVH*D] -> keys/values [R, KVH, S, D]
        kv = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)
        q = query.new_zeros(g.num_reqs * g.max_q, num_heads, head_size)
        q.index_copy_(0, g.pad_pos, query.index_select(0, g.tok_idx))
        gqa = num_heads != num_kv_heads
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # CPU: upcast so scores and softmax are float32 (the bf16 CPU kernel is also slower
            # for short queries); convert while contiguous, a strided convert is much slower.
            kv, q = kv.float(), q.float()
        expand = self.expand_kv_heads if self.expand_kv_heads is not None else q.device.type != "cpu"
        expand = expand or soft_cap is not None
        if gqa and expand:
            # GPU fused kernels (float32 softmax internally) want equal head counts.
            kv = kv.view(2, -1, block_size, num_kv_heads, head_size)
            kv = kv.repeat_interleave(num_heads // num_kv_heads, dim=3)
            num_kv_heads, gqa = num_heads, False
        kv = kv.view(2, g.num_reqs, g.num_blocks * block_size, num_kv_heads, head_size)
        kv = kv[:, :, : g.max_s].transpose(2, 3)
        k, v = kv[0], kv[1]
        q = q.view(g.num_reqs, g.max_q, num_heads, head_size).transpose(1, 2)
        if soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        else:
            # SDPA has no soft-capping: scores by hand, capped before the mask (as HF's eager Gemma 2).
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / soft_cap) * soft_cap
            scores = scores.masked_fill(~g.mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), v)
        # [R, H, max_q, D] -> [R*max_q, H, D] -> this group's token rows
        o = o.transpose(1, 2).reshape(g.num_reqs * g.max_q, num_heads, head_size)
        return o.index_select(0, g.pad_pos).to(query.dtype)
