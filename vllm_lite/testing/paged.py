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
