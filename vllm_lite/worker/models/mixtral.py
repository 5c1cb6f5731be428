"""Mixtral: Llama/Mistral attention with a sparse mixture-of-experts MLP in every layer.

The MoE block goes through the one fused-MoE layer (fused_moe.py): softmax router, top-k
(`num_experts_per_tok`) renormalised to sum 1, experts stacked into one tensor per projection at load.
The decoder here is shared with Qwen3-MoE (qwen3_moe.py), which changes the attention (q/k norm)
and which layers are sparse. On CPU its layers run as one C++ call where that applies (cpu_decoder_stack.py:
attention, the router, top-k and the C++ expert op; the same results as the Python layers).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_lite.worker.models.cpu_decoder_stack import StackDecoder
from vllm_lite.worker.models.decoder import CausalLM, PreNormResidualLayer
from vllm_lite.worker.models.fused_moe import SparseMoeBlock, load_moe_weights
from vllm_lite.worker.models.layers import RMSNorm
from vllm_lite.worker.models.llama import STACKED, LlamaAttention, LlamaMLP
from vllm_lite.worker.models.sliding_window import layer_sliding_windows


class MoEDecoderLayer(PreNormResidualLayer):
    """Llama's layer wiring with a sparse (or dense) MLP under the checkpoint's name for it."""

    def __init__(self, config, attn: nn.Module, mlp: nn.Module, mlp_name: str) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)  # the checkpoint's name: "block_sparse_moe" (Mixtral) or "mlp"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.mlp_name)(hidden)


# The classes whose exact instances the CPU decoder stack's C++ op stands in for (a layer's MLP: a SparseMoeBlock
# or, on Qwen3-MoE's dense layers, a LlamaMLP).
STACK_KINDS = (MoEDecoderLayer, LlamaAttention, LlamaMLP)


class MoEDecoder(StackDecoder):
    """PreNormDecoder whose layers run as one C++ call on CPU where it applies (cpu_decoder_stack.py)."""

    stack_kinds = STACK_KINDS


class MixtralForCausalLM(CausalLM):
    """Mixtral decoder + LM head. Subclasses override `make_layer` for other MoE families."""

    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        windows = layer_sliding_windows(config)
        self.model = MoEDecoder(config, [self.make_layer(config, i, w) for i, w in enumerate(windows)])
        self.init_lm_head(config, self.model.embed_tokens, tie_default=False)

    def make_attention(self, config, sliding_window: int | None) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, bias, bias, self.qk_norm, sliding_window)

    def make_layer(self, config, index: int, sliding_window: int | None) -> MoEDecoderLayer:
        moe = SparseMoeBlock(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            act=getattr(config, "hidden_act", "silu"),
        )
        return MoEDecoderLayer(config, self.make_attention(config, sliding_window), moe, "block_sparse_moe")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_moe_weights(self, weights, STACKED, tied_names=self.tied_names())
