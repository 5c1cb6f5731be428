"""Llama-family decoder (Llama, Mistral; Qwen2/Qwen3 reuse it with their variations).

Sliding windows apply per layer as transformers decides them (sliding_window.py): every
layer for Mistral, layers >= max_window_layers for Qwen2 with use_sliding_window.

Parameter names mirror Hugging Face's so checkpoints map one to one, except
the fused qkv_proj and gate_up_proj, which `load_weights` fills shard by shard.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models.cpu_decoder_stack import StackDecoder
from vllm_lite.worker.models.decoder import CausalLM, PreNormResidualLayer
from vllm_lite.worker.models.layers import (
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    get_rope_parameters,
    norm_per_head,
)
from vllm_lite.worker.models.loading import load_hf_weights
from vllm_lite.worker.models.sliding_window import layer_sliding_windows

logger = logging.getLogger(__name__)

STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by the gated MLP; expected 'silu'.")
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias, [0, 1], "intermediate_size")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, "intermediate_size")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: Optional[int] = None
    ) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias)
        # This rank's heads (all of them at TP=1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, o_bias, "num_attention_heads*head_dim"
        )
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, get_rope_parameters(config))
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, sliding_window=sliding_window
        )

    # forward(..., keep=) is honoured (PreNormResidualLayer: the output projection of the kept rows only).
    selects_rows = True

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, keep: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """[T, hidden]; with `keep` (int64 row indices) only those rows go through o_proj: [len(keep), hidden]."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.qk_norm:
            q = norm_per_head(self.q_norm, q, self.num_heads, self.head_dim)
            k = norm_per_head(self.k_norm, k, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, positions, self.rotary_emb)  # rotates q and k (with the K/V write on CUDA)
        if keep is not None:
            out = out.index_select(0, keep)
        return self.o_proj(out)


class LlamaDecoderLayer(PreNormResidualLayer):
    def __init__(
        self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: Optional[int] = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, qk_norm, sliding_window)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bool(getattr(config, "mlp_bias", False)),
            getattr(config, "hidden_act", "silu"),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# The classes whose exact instances the CPU decoder stack's C++ op stands in for (cpu_decoder_stack.py).
STACK_KINDS = (LlamaDecoderLayer, LlamaAttention, LlamaMLP)


class LlamaModel(StackDecoder):
    """On CPU the layers run as one C++ call where it applies (cpu_decoder_stack.py); the same results."""

    stack_kinds = STACK_KINDS

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        layers = [LlamaDecoderLayer(config, qkv_bias, o_bias, qk_norm, w) for w in layer_sliding_windows(config)]
        super().__init__(config, layers)


class LlamaForCausalLM(CausalLM):
    """Llama decoder + LM head. Subclasses set the bias / qk-norm variations via class attributes."""

    qkv_bias: Optional[bool] = None  # None: config.attention_bias
    o_bias: Optional[bool] = None  # None: config.attention_bias
    qk_norm: bool = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attn_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm)
        self.init_lm_head(config, self.model.embed_tokens, tie_default=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, weights, STACKED, tied_names=self.tied_names())


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture with a sliding window on every layer (when the config sets one)."""
