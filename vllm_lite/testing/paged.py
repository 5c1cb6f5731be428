"""Helpers that build paged-attention step metadata by hand, for tests and kernel benchmarks.

The model runner builds the same thing from the scheduler's output; these
helpers let a test drive a backend or a model directly with arbitrary
(non-contiguous, shuffled) block tables.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from vllm_lite.worker.attention.backend import AttentionMetadata


def random_block_tables(
    seq_lens: Sequence[int], block_size: int, num_blocks: Optional[int] = None, seed: int = 0
) -> tuple[list[list[int]], int]:
    """Give each request enough blocks for its seq_len, drawn from a shuffled pool.

    Returns (block_tables, num_blocks). Blocks are disjoint across requests and
    deliberately out of order, so a kernel that assumes contiguity fails.
    """
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(need)
    num_blocks = num_blocks if num_blocks is not None else total + 3
    if num_blocks < total:
        raise ValueError(f"num_blocks={num_blocks} is fewer than the {total} blocks the requests need.")
    perm = np.random.default_rng(seed).permutation(num_blocks).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return tables, num_blocks


def slot_mapping_for(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> np.ndarray:
    """Cache slot of every query token: the last query_len positions of each request's context."""
    slots = []
    for ql, sl, bt in zip(query_lens, seq_lens, block_tables):
        pos = np.arange(sl - ql, sl)
        table = np.asarray(bt, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """AttentionMetadata for one step; request i runs query_lens[i] tokens ending at seq_lens[i]."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request.")
    for i, (ql, sl, bt) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if ql < 1 or ql > sl:
            raise ValueError(f"request {i}: query_len {ql} must be in 1..seq_len ({sl}).")
        if len(bt) * block_size < sl:
            raise ValueError(f"request {i}: {len(bt)} blocks of {block_size} cannot hold seq_len {sl}.")
    device = torch.device(device)
    b = len(query_lens)
    qsl = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(np.asarray(query_lens, dtype=np.int32), out=qsl[1:])
    max_blocks = max((len(bt) for bt in block_tables), default=1)
    table = np.zeros((b, max_blocks), dtype=np.int32)
    for i, bt in enumerate(block_tables):
        table[i, : len(bt)] = bt
    slots = slot_mapping_for(query_lens, seq_lens, block_tables, block_size)
    qsl_t = torch.from_numpy(qsl)
    seq_t = torch.tensor(list(seq_lens), dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_reqs=b,
        max_query_len=int(max(query_lens, default=0)),
        max_seq_len=int(max(seq_lens, default=0)),
        query_start_loc=qsl_t.to(device),
        seq_lens=seq_t.to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(device),
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
    )


class PagedModelDriver:
    """Runs a model step by step over its own paged KV cache, like the runner but driven by a test.

    Each step names how many new tokens every request feeds (0 = idle this
    step); the driver builds the flattened batch, the metadata and the slot
    mapping, and returns the logits of every fed token.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        token_lists: Sequence[Sequence[int]],
        block_size: int,
        backend,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from vllm_lite.worker.attention.layer import Attention

        self.model, self.backend, self.block_size = model, backend, block_size
        self.device = torch.device(device)
        self.tokens = [list(t) for t in token_lists]
        self.computed = [0] * len(self.tokens)
        self.tables, num_blocks = random_block_tables([len(t) for t in self.tokens], block_size, seed=seed)
        g = torch.Generator().manual_seed(seed)
        for layer in (m for m in model.modules() if isinstance(m, Attention)):
            # Noise, not zeros: reading a slot nobody wrote must change the result.
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.randn(shape, generator=g).to(device=self.device, dtype=dtype)

    @torch.inference_mode()
    def step(self, num_new: Sequence[int]) -> list[torch.Tensor]:
        """Feed num_new[i] tokens of request i; returns per request float32 logits [num_new[i], vocab]."""
        from vllm_lite.worker.forward_context import set_forward_context

        rows = [i for i, n in enumerate(num_new) if n > 0]
        ids, pos = [], []
        for i in rows:
            start, n = self.computed[i], num_new[i]
            if start + n > len(self.tokens[i]):
                raise ValueError(f"request {i}: feeding {n} tokens from {start} overruns its {len(self.tokens[i])}.")
            ids += self.tokens[i][start : start + n]
            pos += range(start, start + n)
        qlens = [num_new[i] for i in rows]
        seqlens = [self.computed[i] + num_new[i] for i in rows]
        md = make_attention_metadata(qlens, seqlens, [self.tables[i] for i in rows], self.block_size, self.device)
        with set_forward_context(md, self.backend):
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(pos, dtype=torch.int64, device=self.device),
            )
            logits = self.model.compute_logits(hidden)
        out = [logits.new_empty(0, logits.shape[-1]) for _ in num_new]
        for i, chunk in zip(rows, logits.split(qlens)):
            self.computed[i] += num_new[i]
            out[i] = chunk
        return out


def as_decodes(md: AttentionMetadata, block_size: int) -> AttentionMetadata:
    """The same query tokens as a batch of decodes: token i of request b as its own one-token request at its
    position (seq_len = position + 1), reading request b's block table row. A prompt token's attention must equal
    the decode's there (the CPU bf16 kernels promise the same bits)."""
    qsl = md.query_start_loc.tolist()
    seq = md.seq_lens.tolist()
    qlens, slens, tables = [], [], []
    for b in range(len(seq)):
        ctx = seq[b] - (qsl[b + 1] - qsl[b])
        for i in range(qsl[b + 1] - qsl[b]):
            pos = ctx + i
            qlens.append(1)
            slens.append(pos + 1)
            tables.append(md.block_table[b, : (pos + block_size) // block_size].tolist())
    return make_attention_metadata(qlens, slens, tables, block_size)
