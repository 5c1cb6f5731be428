"""Gemma 2: alternating sliding-window and global layers, logit soft-capping, sandwich norms.

Differences from Llama, each as transformers' Gemma2 does it: embeddings scaled by
sqrt(hidden_size) (rounded to the activation dtype); RMSNorm multiplies by (1 + weight);
norms after attention and after the MLP as well as before; a gelu-tanh gated MLP; attention
scale query_pre_attn_scalar ** -0.5; attention scores soft-capped (c * tanh(s / c)) before the
mask; final logits soft-capped the same way. Layer i is windowed when layer_types says so
(default: even layers). One KV layout serves both layer kinds, so the KV-cache manager frees
nothing early for Gemma 2 (its full layers need every block).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models.decoder import CausalLM
from vllm_lite.worker.models.layers import (
    MergedLinear,
    QKVLinear,
    RotaryEmbedding,
    RowParallelLinear,
    cpu_fused_ops_for,
    fused_activation_name,
    get_activation,
    get_rope_parameters,
    triton_fused_for,
    triton_fused_module,
)
from vllm_lite.worker.models.llama import STACKED  # the same fused qkv_proj and gate_up_proj as Llama's
from vllm_lite.worker.models.loading import load_hf_weights
from vllm_lite.worker.models.sliding_window import layer_sliding_windows
from vllm_lite.worker.models.vocab_parallel import VocabParallelEmbedding


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back (Gemma's zero-centred gain)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """norm(x), or add + norm(x) (the sandwich layer's residual add, fused on CUDA)."""
        ops = cpu_fused_ops_for(x)  # CPU: one C++ call with the same roundings (layers.py, csrc/fused_cpu_ops.cpp)
        if ops is not None and self.weight.dtype in (torch.float32, torch.bfloat16):
            y = ops.rms_norm(x, None, self.weight, self.eps, True)[0]
            return y if add is None else add + y
        if (
            triton_fused_for(x)
            and self.weight.dtype == x.dtype
            and triton_fused_module().rms_norm_supported(x, self.weight, add)
        ):
            return triton_fused_module().rms_norm(x, self.weight, self.eps, gemma=True, add=add)[0]  # CUDA: one kernel
        y = (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return y if add is None else add + y


class Gemma2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, False, [0, 1], "intermediate_size")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, "intermediate_size")
        self.act = get_activation(act)
        self.fused_act = fused_activation_name(self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        tf = triton_fused_module() if self.fused_act is not None and triton_fused_for(gate_up) else None
        if tf is not None and tf.act_and_mul_supported(gate_up):
            return self.down_proj(tf.act_and_mul(gate_up, self.fused_act))  # CUDA: one kernel
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma2Attention(nn.Module):
    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias, "num_attention_heads*head_dim")
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, self.rope_parameters(config, sliding_window)
        )
        scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            scale,
            self.qkv_proj.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def rope_parameters(self, config, sliding_window: int | None) -> dict:
        """Gemma 2 rotates every layer alike; Gemma 3 overrides this per layer type."""
        return get_rope_parameters(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class Gemma2DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP; Gemma 3 swaps in its own attention through attention_cls."""

    attention_cls: type[nn.Module] = Gemma2Attention

    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_cls(config, sliding_window)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = Gemma2MLP(d, config.intermediate_size, act)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)), add=hidden)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)), add=hidden)


class Gemma2Model(nn.Module):
    """Scaled embedding, the layers, a final norm; layer_cls picks the architecture's layer."""

    layer_cls: type[nn.Module] = Gemma2DecoderLayer

    def __init__(self, config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(config, w) for w in layer_sliding_windows(config)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF rounds the normalizer to the activation dtype before multiplying.
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 decoder + LM head (tied to the embedding) with final logit soft-capping."""

    model_cls: type[nn.Module] = Gemma2Model

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.init_lm_head(config, self.model.embed_tokens, tie_default=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_hf_weights(self, weights, STACKED, tied_names=self.tied_names())
