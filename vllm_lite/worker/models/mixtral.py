"""Mixtral: Llama/Mistral attention with a sparse mixture-of-experts MLP in every layer.

The MoE block goes through the one fused-MoE layer (fused_moe.py): softmax router, top-k
(`num_experts_per_tok`) renormalised to sum 1, experts stacked into one tensor per projection at load.
The decoder here is shared with Qwen3-MoE (qwen3_moe.py), which changes the attention (q/k norm)
and which layers are sparse.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_lite.worker.models.fused_moe import SparseMoeBlock, load_moe_weights
from vllm_lite.worker.models.layers import RMSNorm
from vllm_lite.worker.models.llama import STACKED, LlamaAttention
from vllm_lite.worker.models.sliding_window import layer_sliding_windows
from vllm_lite.worker.models.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    lm_head_logits,
)


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention + MLP (sparse or dense) with the residual carried into the fused add+norm, as Llama."""

    def __init__(self, config, attn: nn.Module, mlp: nn.Module, mlp_name: str) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)  # the checkpoint's name: "block_sparse_moe" (Mixtral) or "mlp"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class MoEModel(nn.Module):
    def __init__(self, layers: list[MoEDecoderLayer], config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MixtralForCausalLM(nn.Module):
    """Mixtral decoder + LM head. Subclasses override `make_layer` for other MoE families."""

    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        windows = layer_sliding_windows(config)
        self.model = MoEModel([self.make_layer(config, i, w) for i, w in enumerate(windows)], config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def make_attention(self, config, sliding_window: int | None) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, bias, bias, self.qk_norm, sliding_window)

    def make_layer(self, config, index: int, sliding_window: int | None) -> MoEDecoderLayer:
        moe = SparseMoeBlock(
            config.num_local_experts, config.num_experts_per_tok, config.hidden_size, config.intermediate_size,
            renormalize=True, act=getattr(config, "hidden_act", "silu"),
        )
        return MoEDecoderLayer(config, self.make_attention(config, sliding_window), moe, "block_sparse_moe")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(hidden_states, self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_moe_weights(self, weights, STACKED, tied_names=tied)
