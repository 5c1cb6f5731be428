"""Gemma 3 (text): Gemma 2's layer with q/k RMSNorm, per-layer-type RoPE bases and its own sliding pattern.

As transformers' modeling_gemma3 does it: q and k are RMS-normalised per head (Gemma's 1 + weight gain)
before RoPE; sliding layers rotate with the local base (`rope_parameters["sliding_attention"]`, from the
old `rope_local_base_freq`), full layers with the global one and its scaling (e.g. linear x8); which
layers slide comes from `layer_types` (from `sliding_window_pattern`: every pattern-th layer is global);
attention and final-logit soft-capping apply only where the config sets them (null in released configs).
Embedding scale, sandwich norms, gelu-tanh MLP and the tied LM head are Gemma 2's.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_lite.worker.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
    GemmaRMSNorm,
)
from vllm_lite.worker.models.layers import norm_per_head

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings of one layer type: transformers' per-type `rope_parameters`, else the old flat fields."""
    rp = getattr(config, "rope_parameters", None)
    params = dict(rp[layer_type]) if isinstance(rp, dict) and isinstance(rp.get(layer_type), dict) else {}
    if not params:
        if layer_type == "full_attention":
            params = dict(getattr(config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(config, "rope_theta", None))
        else:
            params["rope_theta"] = getattr(config, "rope_local_base_freq", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = DEFAULT_THETA[layer_type]
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention plus per-head q/k RMSNorm before RoPE, and a RoPE base per layer type."""

    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__(config, sliding_window)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def rope_parameters(self, config, sliding_window: int | None) -> dict[str, Any]:
        """Sliding layers use the local base, full layers the global base and its scaling."""
        return layer_rope_parameters(config, "sliding_attention" if sliding_window else "full_attention")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = norm_per_head(self.q_norm, q, self.num_heads, self.head_dim)
        k = norm_per_head(self.k_norm, k, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder; logits, soft-capping and loading are Gemma 2's."""

    model_cls = Gemma3Model

    def __init__(self, config) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported for causal generation.")
        super().__init__(config)
