"""Vocab-parallel token embedding and LM head.

Each rank holds a contiguous block of ceil(vocab/tp) rows (the last block is
zero-padded). Embedding: look up ids in this rank's block, zero the others,
all-reduce. LM head: each rank scores its block, then the blocks are
all-gathered into full-vocab logits before sampling (every rank sees the same
logits). At TP=1 both are exactly nn.Embedding / F.linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.worker.models.cpu_prepack import linear
from vllm_lite.worker.models.parallel_linear import copy_checked, loaded_shape, read_shard
from vllm_lite.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, embedding_dim: int) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = min(self.tp_rank * per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)
        super().__init__(per_rank, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def load_weight(self, param: torch.Tensor, loaded: Any) -> None:
        rows = loaded_shape(loaded)[0]
        if rows != self.vocab_size:
            raise ValueError(f"embedding: checkpoint has {rows} rows, the model's vocab_size is {self.vocab_size}.")
        n = self.vocab_end - self.vocab_start
        with torch.no_grad():
            if n:
                copy_checked(param.data[:n], read_shard(loaded, 0, self.vocab_start, n), "vocab-parallel embedding")
            param.data[n:].zero_()  # padding rows: score 0 and never selected (trimmed before sampling)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection: same sharding as the embedding, used only through `lm_head_logits`."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied through lm_head_logits(), not called.")


def lm_head_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """Full-vocab float32 logits [T, vocab] on every rank."""
    logits = linear(hidden, head, None)
    if head.tp_size == 1:
        return logits.float()
    return tensor_model_parallel_all_gather(logits, dim=-1)[:, : head.vocab_size].float()
